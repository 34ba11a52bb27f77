"""Eviction choice: expired first, then LRU; pinned/in-flight never; watermarks batch."""

from dataclasses import dataclass

from kvpool.arena.eviction import choose_victims, watermark_need
from kvpool.core.traffic import DEFAULT_TRAFFIC_CLASS


@dataclass
class C:
    name: str
    size: int
    last_access: float
    traffic_class: str = DEFAULT_TRAFFIC_CLASS
    pins: int = 0
    inflight: int = 0


def test_expired_first_then_lru() -> None:
    now = 1000.0
    objs = [C("old", 10, 100), C("agent-old", 10, 200, "agent"), C("mid", 10, 500), C("new", 10, 900)]
    ttl = {"agent": 700.0, "chatbot": 10_000.0}
    plan = choose_victims(objs, 15, now, ttl)
    assert [c.name for c in plan.expired] == ["agent-old"]  # 800 s idle > 700 s TTL
    assert [c.name for c in plan.lru] == ["old"]
    assert plan.satisfied and plan.freed_bytes == 20


def test_all_expired_taken_even_if_need_met() -> None:
    objs = [C(f"e{i}", 10, 0) for i in range(5)] + [C("live", 10, 999)]
    plan = choose_victims(objs, 5, 1000.0, {"chatbot": 10.0})
    assert len(plan.expired) == 5 and not plan.lru


def test_never_pinned_or_inflight() -> None:
    objs = [C("pinned", 100, 0, pins=1), C("moving", 100, 0, inflight=1), C("free", 10, 1)]
    plan = choose_victims(objs, 150, 2.0, {})
    assert [c.name for c in plan.victims] == ["free"]
    assert not plan.satisfied


def test_watermarks() -> None:
    assert watermark_need(used=50, incoming=10, capacity=100, high=0.9, low=0.7) == 0
    assert watermark_need(used=85, incoming=10, capacity=100, high=0.9, low=0.7) == 25
    assert watermark_need(used=0, incoming=200, capacity=100, high=0.9, low=0.7) == 130
