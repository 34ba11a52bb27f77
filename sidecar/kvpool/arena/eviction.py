"""Eviction choice (pure): which objects to move out of a tier, DESIGN §4.

Expired objects first (TTL per traffic class, from last access), then least recently used, until
the bytes to free are reached; pinned and in-flight objects are never chosen.  The caller walks
its LRU order (oldest first) and hands candidates here; demotion or dropping is its business.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol


class Candidate(Protocol):
    size: int
    last_access: float
    traffic_class: str
    pins: int
    inflight: int


@dataclass(frozen=True)
class EvictionPlan:
    expired: list[Candidate]
    lru: list[Candidate]
    freed_bytes: int
    satisfied: bool

    @property
    def victims(self) -> list[Candidate]:
        return self.expired + self.lru


def is_expired(c: Candidate, now: float, ttl_seconds: Mapping[str, float], default_ttl: float) -> bool:
    ttl = ttl_seconds.get(c.traffic_class, default_ttl)
    return ttl > 0 and now - c.last_access > ttl


def choose_victims(
    lru_oldest_first: Iterable[Candidate],
    need_bytes: int,
    now: float,
    ttl_seconds: Mapping[str, float],
    default_ttl: float = 0.0,
    expire_all: bool = True,
) -> EvictionPlan:
    """Pick victims freeing at least ``need_bytes``.

    All expired objects are taken when ``expire_all`` (they are worthless whatever the need);
    then the oldest unexpired ones until the need is met.  ``satisfied`` tells whether it was.
    """
    expired: list[Candidate] = []
    rest: list[Candidate] = []
    freed = 0
    for c in lru_oldest_first:
        if c.pins or c.inflight:
            continue
        if is_expired(c, now, ttl_seconds, default_ttl):
            expired.append(c)
            freed += c.size
        else:
            rest.append(c)
        if not expire_all and freed >= need_bytes:
            break
    lru: list[Candidate] = []
    for c in rest:
        if freed >= need_bytes:
            break
        lru.append(c)
        freed += c.size
    return EvictionPlan(expired, lru, freed, freed >= need_bytes)


def watermark_need(used: int, incoming: int, capacity: int, high: float, low: float) -> int:
    """Bytes to free before admitting ``incoming`` bytes: none below the high watermark, else
    down to the low watermark (batching eviction instead of one object at a time)."""
    if used + incoming <= high * capacity:
        return 0
    return max(0, int(used + incoming - low * capacity))
