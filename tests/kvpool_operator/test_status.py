"""Status: aggregation of node stats, conditions, phase and transition Events."""

from kvpool.wire.counters import StoreCounter
from kvpool_operator.drain import DrainState
from kvpool_operator.scaling import ScaleDecision
from kvpool_operator.status import (
    NodeStats,
    PoolObservation,
    TenantUsage,
    aggregate,
    merge_conditions,
    pool_conditions,
    usage_status,
)


def _by_type(view: object) -> dict[str, tuple[bool, str]]:
    return {c.type: (c.status, c.reason) for c in view.conditions}  # type: ignore[attr-defined]


def test_aggregate_is_block_weighted() -> None:
    a = NodeStats("a", capacity_bytes=100, used_bytes=30, hit_blocks=90, lookup_blocks=100,
                  tenants=(TenantUsage("t", 10, 50, 2, {StoreCounter.REFUSED_QUOTA: 3, StoreCounter.EVICTED: 1}),))
    b = NodeStats("b", capacity_bytes=100, used_bytes=10, hit_blocks=0, lookup_blocks=900,
                  tenants=(TenantUsage("t", 5, 50, 1, {StoreCounter.REFUSED_QUOTA: 1}),))
    u = aggregate([a, b])
    assert (u.capacity_bytes, u.used_bytes, u.utilization) == (200, 40, 0.2)
    assert u.hit_rate == 0.09  # 90 of 1000 blocks, not the mean of 0.9 and 0.0
    s = usage_status(u)
    assert s["tenants"] == [{"tenantId": "t", "usedBytes": 15, "physicalBytes": 15, "quotaBytes": 50, "objects": 3,
                             "refusals": 4, "evictions": 1}]
    assert s["utilizationPercent"] == "20.0%" and s["hitRatePercent"] == "9.0%"
    assert aggregate([]).hit_rate == 0.0 and aggregate([]).utilization == 0.0


def test_tenant_quota_and_usage_are_the_pools_in_one_unit() -> None:
    """Issue 19, finding 3: status put max(quota) of the nodes beside the sum of their usage.
    Now every node reports the pool quota (and enforces its share of it: ``share_bytes``), and
    the pool's usage of a tenant is in the quota's unit, logical bytes: with R=2 each object is
    on two nodes, so 4 nodes holding 2 MiB of a tenant's replicas hold 1 MiB of its quota."""
    mib = 1 << 20
    nodes = [NodeStats(f"n{i}", capacity_bytes=64 * mib, used_bytes=mib // 2,
                       tenants=(TenantUsage("t", mib // 2, mib, 128, {StoreCounter.REFUSED_QUOTA: 5}),))
             for i in range(4)]
    u = aggregate(nodes, replicas=2)
    t = u.tenants["t"]
    assert (t.used_bytes, t.physical_bytes, t.quota_bytes, t.objects) == (mib, 2 * mib, mib, 256)
    assert u.used_bytes == 2 * mib  # the pool's capacity use stays physical (utilization, autoscaling)
    row = usage_status(u)["tenants"][0]
    assert row["usedBytes"] <= row["quotaBytes"] == mib and row["physicalBytes"] == 2 * mib
    # R=1: logical is physical; R above the nodes that answered: each holds every copy.
    assert aggregate(nodes, replicas=1).tenants["t"].used_bytes == 2 * mib
    assert aggregate(nodes[:1], replicas=3).tenants["t"].used_bytes == mib // 2
    # Rounded up: a usage at the limit never reads under it.
    odd = [NodeStats("a", tenants=(TenantUsage("t", 3, 2),)), NodeStats("b", tenants=(TenantUsage("t", 2, 2),))]
    assert aggregate(odd, replicas=2).tenants["t"].used_bytes == 3


def test_conditions_as_pods_become_ready() -> None:
    starting = pool_conditions(PoolObservation(desired=3, pods=3, ready_pods=1, active_members=1))
    c = _by_type(starting)
    assert c["Ready"] == (False, "NodesNotReady") and c["Progressing"] == (True, "NodesStarting")
    assert starting.phase == "Progressing"
    ready = pool_conditions(PoolObservation(desired=3, pods=3, ready_pods=3, active_members=3))
    c = _by_type(ready)
    assert c["Ready"] == (True, "NodesReady") and c["Progressing"] == (False, "Stable")
    assert c["Degraded"] == (False, "AsExpected") and c["ScaleDownBlocked"] == (False, "NotBlocked")
    assert ready.phase == "Ready" and ready.message == "3/3 store nodes ready in the ring."


def test_blocked_draining_degraded_failed() -> None:
    d = ScaleDecision("blocked", 3, 3, 2, "UtilizationTooHigh", "refused: 90%")
    v = pool_conditions(PoolObservation(desired=3, active_members=3, ready_pods=3, decision=d))
    assert _by_type(v)["ScaleDownBlocked"] == (True, "UtilizationTooHigh") and v.phase == "Blocked"
    st = DrainState(3, 2, ("p-store-2",), 0, 60_000)
    v = pool_conditions(PoolObservation(desired=2, active_members=2, ready_pods=3, drain=st, now_ms=1000))
    assert _by_type(v)["Draining"] == (True, "ScaleDown") and v.phase == "Draining" and "59s" in v.message
    v = pool_conditions(PoolObservation(desired=2, active_members=2, ready_pods=2, unreachable=["p-store-1"]))
    assert _by_type(v)["Degraded"] == (True, "NodesUnreachable") and v.phase == "Degraded"
    v = pool_conditions(PoolObservation(desired=2, spec_error=("TierNotFound", "KVTier x not found")))
    assert _by_type(v)["Degraded"] == (True, "TierNotFound") and v.phase == "Failed"
    assert _by_type(v)["Ready"] == (False, "TierNotFound")


def test_merge_keeps_transition_times_and_emits_events() -> None:
    v1 = pool_conditions(PoolObservation(desired=1, pods=1))
    c1, ev1 = merge_conditions(None, v1.conditions, "t1")
    assert ev1 == []  # a new pool that is not ready yet is not news
    v2 = pool_conditions(PoolObservation(desired=1, pods=1, ready_pods=1, active_members=1))
    c2, ev2 = merge_conditions(c1, v2.conditions, "t2")
    ready = next(c for c in c2 if c["type"] == "Ready")
    assert ready["status"] == "True" and ready["lastTransitionTime"] == "t2"
    deg = next(c for c in c2 if c["type"] == "Degraded")
    assert deg["lastTransitionTime"] == "t1"
    assert {(e.type, e.reason) for e in ev2} == {("Normal", "NodesReady"), ("Normal", "Stable")}
    d = ScaleDecision("blocked", 1, 1, 0, "UtilizationTooHigh", "no")
    v3 = pool_conditions(PoolObservation(desired=1, pods=1, ready_pods=1, active_members=1, decision=d))
    _, ev3 = merge_conditions(c2, v3.conditions, "t3")
    assert ("Warning", "UtilizationTooHigh") in {(e.type, e.reason) for e in ev3}
    _, ev4 = merge_conditions(c2, v2.conditions, "t4")
    assert ev4 == []  # nothing changed, nothing said
