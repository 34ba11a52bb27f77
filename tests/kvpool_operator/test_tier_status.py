"""The KVTier status view (pure): the pools using the tier and its validity."""

from __future__ import annotations

from kvpool_operator.handlers.kvtier import _same, tier_status


def tier(spec: dict, status: dict | None = None, generation: int = 3) -> dict:
    return {"metadata": {"name": "t", "generation": generation}, "spec": spec, "status": status or {}}


GOOD = {"medium": "dram", "capacity": {"bytes": "16Mi"}}


def test_lists_pools_and_is_valid() -> None:
    st = tier_status(tier(GOOD), [("a", "p"), ("b", "q")], "2026-01-01T00:00:00Z")
    assert st["pools"] == ["a.p", "b.q"] and st["poolCount"] == 2 and st["observedGeneration"] == 3
    assert [(c["type"], c["status"]) for c in st["conditions"]] == [("Valid", "True")]


def test_invalid_tier_says_why() -> None:
    st = tier_status(tier({"medium": "tape", "capacity": {"bytes": "1Mi"}}), [], "2026-01-01T00:00:00Z")
    (cond,) = st["conditions"]
    assert cond["status"] == "False" and cond["reason"] != "Valid" and cond["message"]


def test_unchanged_status_is_not_rewritten_but_a_new_pool_is() -> None:
    first = tier_status(tier(GOOD), [("a", "p")], "2026-01-01T00:00:00Z")
    later = tier_status(tier(GOOD, first), [("a", "p")], "2026-01-02T00:00:00Z")
    assert later["conditions"][0]["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    assert _same(first, later)
    assert not _same(first, tier_status(tier(GOOD, first), [("a", "p"), ("c", "r")], "2026-01-02T00:00:00Z"))
    assert not _same(first, tier_status(tier(GOOD, first, generation=4), [("a", "p")], "2026-01-02T00:00:00Z"))
