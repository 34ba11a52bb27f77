"""The ring from the store pods that are ready (DESIGN §6): who is a member, in which state.

A member whose pod just went not-ready keeps its place for a grace period (a readiness flap is
not a membership change); a deleted pod leaves at once.

Pure. Members come from the pods' own IPs (not Service endpoints, which lag and hide draining
pods); the epoch moves by one exactly when the membership changes, so nodes and sidecars can tell
a stale ring from the current one.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvpool.core.ring import Member, Ring

from .units import parse_time

_ORDINAL = re.compile(r"-(\d+)$")


@dataclass(frozen=True)
class StorePod:
    """What the operator needs to know of one store pod."""

    name: str
    ordinal: int
    ip: str = ""
    ready: bool = False
    terminating: bool = False
    unready_since_ms: int = 0
    """When a not-ready pod's Ready condition last changed (0: unknown or ready)."""

    @property
    def usable(self) -> bool:
        return self.ready and not self.terminating and bool(self.ip)


def ordinal_of(name: str) -> int:
    m = _ORDINAL.search(name)
    return int(m.group(1)) if m else -1


def observe_pod(pod: Mapping[str, Any]) -> StorePod:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    cond: Mapping[str, Any] = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
    ready = cond.get("status") == "True"
    name = str(meta.get("name", ""))
    return StorePod(name=name, ordinal=ordinal_of(name), ip=str(status.get("podIP") or ""), ready=ready,
                    terminating=bool(meta.get("deletionTimestamp")),
                    unready_since_ms=0 if ready else parse_time(cond.get("lastTransitionTime")))



def observe_pods(pods: Iterable[Mapping[str, Any]]) -> list[StorePod]:
    return sorted((observe_pod(p) for p in pods), key=lambda p: (p.ordinal, p.name))


def _identity(r: Ring) -> tuple[int, list[tuple[str, str, str, str]]]:
    return r.replicas, sorted((m.id, m.address, m.state, m.transfer_address) for m in r.members)


def same_membership(a: Ring, b: Ring) -> bool:
    return _identity(a) == _identity(b)


def held_through_unready(pod: StorePod, previous: Ring | None, port: int, now_ms: int, grace_ms: int) -> bool:
    """A member of ``previous`` whose pod went not-ready less than ``grace_ms`` ago and is otherwise
    the same pod (same IP, not being deleted) keeps its place in the ring.

    Why: a readiness flap (a slow probe on a loaded node, a container restart that keeps the pod
    and its SSD tier) would otherwise move every key it owns twice in seconds (two ring epochs,
    two rebalances) and send its clients to owners that hold nothing.  Its clients meanwhile see
    a down node, whose keys are misses.  A pod unready for longer, or without a known transition
    time, leaves the ring as before.
    """
    if pod.usable or pod.terminating or not pod.ip or grace_ms <= 0 or not pod.unready_since_ms or previous is None:
        return False
    member = next((m for m in previous.members if m.id == pod.name), None)
    return (member is not None and member.address == f"{pod.ip}:{port}"
            and 0 <= now_ms - pod.unready_since_ms < grace_ms)


def plan_ring(previous: Ring | None, pods: Iterable[StorePod], draining: Collection[str], port: int,
              replication: int = 1, now_ms: int = 0, unready_grace_ms: int = 0) -> Ring:
    """The ring for the usable pods: ``draining`` ids are members in state draining, the rest active.

    Members of ``previous`` that went not-ready less than ``unready_grace_ms`` before ``now_ms``
    stay (:func:`held_through_unready`).  Returns ``previous`` itself when nothing changed, else a
    ring at ``previous.epoch + 1``.
    """
    members = tuple(
        Member(id=p.name, address=f"{p.ip}:{port}", transfer_address=f"{p.ip}:{port + 1}",
               state="draining" if p.name in draining else "active")
        for p in sorted(pods, key=lambda p: (p.ordinal, p.name))
        if p.usable or held_through_unready(p, previous, port, now_ms, unready_grace_ms))
    epoch = previous.epoch if previous is not None else 0
    candidate = Ring(epoch=epoch, members=members, replicas=replication)
    if previous is not None and same_membership(previous, candidate):
        return previous
    return Ring(epoch=epoch + 1, members=members, replicas=replication)


def ring_from_status(status: Mapping[str, Any] | None) -> Ring | None:
    doc = (status or {}).get("ring")
    if not doc:
        return None
    try:
        return Ring.from_dict(dict(doc))
    except (KeyError, TypeError, ValueError):
        return None  # a hand-edited status: rebuild from the pods (the epoch restarts above 0)


def seed_addresses(ring: Ring | None, service_address: str, limit: int = 3) -> list[str]:
    """Where an injected sidecar bootstraps: a few active members, then the pool's Service."""
    seeds = [m.address for m in (ring.active if ring else [])][:limit]
    return [*seeds, service_address]
