"""A KVPool reconcile end to end as a pure function: children, ring, scale-down, drain, status."""

import json
from dataclasses import replace
from typing import Any

from kvpool.core.push_status import DrainStatus
from kvpool.wire.convert import ring_to_pb
from kvpool.wire.counters import StoreCounter
from kvpool_operator.membership import StorePod
from kvpool_operator.model import SpecError, parse_tier
from kvpool_operator.rebalance import RebalanceState
from kvpool_operator.reconcile import PoolObserved, PoolPlan, plan_pool
from kvpool_operator.settings import Settings
from kvpool_operator.status import NodeStats
from kvpool_operator.testing import apply_merge_patch, pool_body, tier_body

S = Settings()
GI = 1 << 30
NOW = 1_700_000_000_000


def _pods(n: int, ready: bool = True) -> list[StorePod]:
    return [StorePod(f"p-store-{i}", i, f"127.0.0.{10 + i}", ready=ready) for i in range(n)]


def _stats(n: int, used: int = 0, epoch: int = 0) -> dict[str, NodeStats | None]:
    return {f"p-store-{i}": NodeStats(f"p-store-{i}", epoch=epoch, capacity_bytes=GI, used_bytes=used)
            for i in range(n)}


def _conds(plan: PoolPlan) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in plan.status["conditions"]}


def _run(body: dict[str, Any], **obs: Any) -> tuple[PoolPlan, dict[str, Any]]:
    plan = plan_pool(PoolObserved(body=body, now_ms=obs.pop("now_ms", NOW), now_iso="t", **obs), S)
    new_body = dict(body, status=apply_merge_patch(body.get("status") or {}, plan.status))
    return plan, new_body


def test_new_pool_creates_children_and_then_becomes_ready() -> None:
    body = pool_body(storage={"replicas": 3}, tenancy={"defaultTenant": "public"})
    plan, body = _run(body)
    assert plan.replicas == 3 and [c["kind"] for c in plan.children][-1] == "StatefulSet"
    assert plan.children[-1]["spec"]["replicas"] == 3
    assert _conds(plan)["Ready"] == ("False", "NodesNotReady") and plan.status["phase"] == "Progressing"
    plan, body = _run(body, pods=_pods(3), sts_replicas=3, stats=_stats(3))
    assert plan.ring is not None and plan.ring.epoch == 2 and len(plan.ring.active) == 3
    assert {m.id for m in plan.push_ring} == {"p-store-0", "p-store-1", "p-store-2"}
    assert _conds(plan)["Ready"] == ("True", "NodesReady") and plan.status["phase"] == "Ready"
    assert plan.status["readyReplicas"] == 3 and plan.status["capacity"] == "3.0Gi"
    assert any(e.reason == "NodesReady" for e in plan.events)
    # Nodes now at the ring's epoch: nothing to push, nothing changes.
    plan2, _ = _run(body, pods=_pods(3), sts_replicas=3, stats=_stats(3, epoch=2))
    assert plan2.push_ring == () and plan2.ring == plan.ring and len(plan2.configure) == 3


def test_scale_down_drains_then_shrinks() -> None:
    body = pool_body(storage={"replicas": 3}, scaleDown={"gracePeriodSeconds": 30})
    _, body = _run(body, pods=_pods(3), sts_replicas=3, stats=_stats(3))
    body["spec"]["storage"]["replicas"] = 2
    plan, body = _run(body, pods=_pods(3), sts_replicas=3, stats=_stats(3, used=GI // 10, epoch=1))
    assert plan.replicas == 3  # not yet
    assert plan.ring is not None and [m.id for m in plan.ring.draining] == ["p-store-2"]
    assert [m.id for m in plan.drain_calls] == ["p-store-2"] and plan.drain_deadline_ms == NOW + 30_000
    assert plan.status["drain"]["leaving"] == ["p-store-2"] and plan.status["drain"]["epoch"] == plan.ring.epoch
    assert _conds(plan)["Draining"] == ("True", "ScaleDown") and plan.status["phase"] == "Draining"
    epoch = plan.ring.epoch
    # An operator restart: the same status, a node that forgot → called again, same deadline.
    again, _ = _run(body, pods=_pods(3), sts_replicas=3, stats=_stats(3, epoch=epoch),
                    drain_statuses={"p-store-2": DrainStatus("idle")}, now_ms=NOW + 5000)
    assert [m.id for m in again.drain_calls] == ["p-store-2"] and again.drain_deadline_ms == NOW + 30_000
    assert again.ring is not None and again.ring.epoch == epoch
    done = DrainStatus("done", moved_objects=10, moved_bytes=1000, epoch=epoch)
    plan, body = _run(body, pods=_pods(3), sts_replicas=3, stats=_stats(3, epoch=epoch),
                      drain_statuses={"p-store-2": done}, now_ms=NOW + 6000)
    assert plan.replicas == 2 and plan.children[-1]["spec"]["replicas"] == 2
    assert plan.ring is not None and [m.id for m in plan.ring.members] == ["p-store-0", "p-store-1"]
    assert plan.ring.epoch == epoch + 1
    assert body["status"].get("drain") is None and body["status"]["lastDrain"]["movedObjects"] == 10
    assert _conds(plan)["Draining"] == ("False", "NotDraining")
    assert any(e.reason == "DrainCompleted" for e in plan.events)


def test_scale_down_refused_and_forced() -> None:
    body = pool_body(storage={"replicas": 3})
    _, body = _run(body, pods=_pods(3), sts_replicas=3, stats=_stats(3))
    body["spec"]["storage"]["replicas"] = 2
    full = _stats(3, used=int(0.6 * GI), epoch=1)  # 1.8Gi on 2Gi: 90 %
    plan, body = _run(body, pods=_pods(3), sts_replicas=3, stats=full)
    assert plan.replicas == 3 and plan.drain_calls == () and plan.status.get("drain") is None
    assert _conds(plan)["ScaleDownBlocked"] == ("True", "UtilizationTooHigh") and plan.status["phase"] == "Blocked"
    assert any(e.type == "Warning" and e.reason == "UtilizationTooHigh" for e in plan.events)
    assert plan.ring is not None and len(plan.ring.active) == 3
    body["metadata"]["annotations"] = {"kvpool.io/force-scale-down": "true"}
    plan, _ = _run(body, pods=_pods(3), sts_replicas=3, stats=full)
    assert [m.id for m in plan.drain_calls] == ["p-store-2"]
    assert _conds(plan)["ScaleDownBlocked"] == ("False", "NotBlocked")


def test_spec_error_is_a_condition_not_a_crash() -> None:
    plan, _ = _run(pool_body(storage={"tiers": ["missing"]}))
    assert plan.spec_error is not None and plan.children == () and plan.status["phase"] == "Failed"
    assert _conds(plan)["Degraded"] == ("True", "TierNotFound")
    bad = SpecError("InvalidTier", "KVTier x: watermarks bad")
    plan, _ = _run(pool_body(storage={"tiers": ["x"]}), tiers={"x": bad})
    assert _conds(plan)["Degraded"] == ("True", "InvalidTier")


def test_tiers_and_tenancy_reach_the_plan() -> None:
    tiers = {"d": parse_tier(tier_body("d", capacity={"bytes": "2Gi"}, watermarks={"high": 0.9, "low": 0.5}))}
    plan, _ = _run(pool_body(storage={"tiers": ["d"]}, ttl={"agent": "1h"}), tiers=tiers)
    assert plan.policy is not None and plan.policy.high_watermark == 0.9 and plan.policy.ttl_seconds["agent"] == 3600
    assert plan.layout is not None and plan.layout.dram_bytes == 2 * GI


def test_unreachable_node_degrades() -> None:
    body = pool_body(storage={"replicas": 2})
    stats = _stats(2)
    stats["p-store-1"] = None
    plan, _ = _run(body, pods=_pods(2), sts_replicas=2, stats=stats)
    assert _conds(plan)["Degraded"] == ("True", "NodesUnreachable") and "p-store-1" in plan.status["message"]


def test_autoscaler_steps_are_spaced_by_the_cooldown() -> None:
    body = pool_body(storage={"replicas": 2}, autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 5,
                                                           "targetUtilization": 0.5})
    hot = _stats(2, used=GI, epoch=1)  # 2Gi used on 2Gi: wants 4 nodes
    plan, body = _run(body, pods=_pods(2), sts_replicas=2, stats=hot)
    assert plan.replicas == 4 and plan.status["lastScaleUnixMs"] == NOW
    plan, body = _run(body, pods=_pods(4), sts_replicas=4, stats=_stats(4, used=GI, epoch=1), now_ms=NOW + 1000)
    assert plan.replicas == 4  # 4Gi used on 4Gi would want more, but the last step is too recent
    assert body["status"]["rebalance"]["added"] == ["p-store-2", "p-store-3"]
    plan, _ = _run(body, pods=_pods(4), sts_replicas=4, stats=_stats(4, used=GI, epoch=1), now_ms=NOW + 61_000)
    assert plan.replicas == 4  # nor while the warm-up of the new nodes runs (owned bytes under-count)
    body = dict(body, status={**body["status"], "rebalance": None})  # the warm-up done
    plan, _ = _run(body, pods=_pods(4), sts_replicas=4, stats=_stats(4, used=GI, epoch=1), now_ms=NOW + 61_000)
    assert plan.replicas == 5


def test_the_autoscaler_goes_by_owned_bytes_not_a_warm_ups_copies() -> None:
    """After a scale-up the warm-up's sources keep their copies of what moved (foreign there):
    counted as load they would grow the pool again, and again, up to maxReplicas."""
    body = pool_body(storage={"replicas": 1}, autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 3,
                                                           "targetUtilization": 0.5})
    # 0.9Gi owned on 2 nodes of 1Gi (within the target: stay), and 0.45Gi of warm-up copies.
    stats = _stats(2, used=int(0.675 * GI), epoch=1)
    stats["p-store-0"] = replace(stats["p-store-0"], foreign_bytes=int(0.45 * GI))  # type: ignore[type-var]
    plan, _ = _run(body, pods=_pods(2), sts_replicas=2, stats=stats)
    assert plan.scale is not None and plan.scale.action == "none" and plan.replicas == 2
    assert plan.status["usedBytes"] == 2 * int(0.675 * GI) and plan.status["foreignBytes"] == int(0.45 * GI)
    # The scale-down limit too: one node would hold the 0.9Gi owned (90 %), not the 1.35Gi held.
    capped = dict(body, spec={**body["spec"], "autoscaling": {**body["spec"]["autoscaling"], "maxReplicas": 1}})
    plan, _ = _run(capped, pods=_pods(2), sts_replicas=2, stats=stats)
    assert plan.scale is not None and plan.scale.action == "blocked" and "90.0%" in plan.scale.message


def test_during_a_rebalance_the_autoscaler_waits_and_a_scale_down_counts_what_is_held() -> None:
    """Mid warm-up the sources' copies are already foreign but not yet at their owners: owned
    bytes under-count.  The autoscaler must not shrink the pool it has just grown (seen on the
    harness: 1 -> 3 nodes, then at once 3 -> 2), and a user's scale-down is checked against
    what the nodes hold."""
    warming = RebalanceState(epoch=2, added=("p-store-1",), sources=("p-store-0",), started_unix_ms=NOW - 500,
                             deadline_unix_ms=NOW + 60_000, stage="Warming").to_status()
    auto = {"enabled": True, "minReplicas": 1, "maxReplicas": 3, "targetUtilization": 0.5}
    # 0.9Gi on p-store-0, half of it foreign there and not yet at p-store-1.
    stats = _stats(2, used=0, epoch=2)
    stats["p-store-0"] = replace(stats["p-store-0"], used_bytes=int(0.9 * GI),  # type: ignore[type-var]
                                 foreign_bytes=int(0.45 * GI))
    body = dict(pool_body(storage={"replicas": 1}, autoscaling=auto), status={"rebalance": warming})
    plan, _ = _run(body, pods=_pods(2), sts_replicas=2, stats=stats)
    assert plan.scale is not None and plan.scale.action == "none" and plan.replicas == 2
    body = dict(pool_body(storage={"replicas": 1}), status={"rebalance": warming})
    plan, _ = _run(body, pods=_pods(2), sts_replicas=2, stats=stats)
    assert plan.scale is not None and plan.scale.action == "blocked" and "90.0%" in plan.scale.message
    # Once the push is done, owned bytes are the load: the autoscaler shrinks the idle pool.
    settled = dict(pool_body(storage={"replicas": 1}, autoscaling=auto), status={})
    stats["p-store-0"] = replace(stats["p-store-0"], used_bytes=int(0.2 * GI), foreign_bytes=int(0.1 * GI))  # type: ignore[type-var]
    plan, _ = _run(settled, pods=_pods(2), sts_replicas=2, stats=stats)
    assert plan.scale is not None and plan.scale.action == "down"


def test_default_tenant_usage_is_shown_under_its_name() -> None:
    from kvpool_operator.status import TenantUsage

    stats: dict[str, NodeStats | None] = {"p-store-0": NodeStats("p-store-0", capacity_bytes=GI, used_bytes=5,
                                                                 tenants=(TenantUsage("default", 5),))}
    plan, _ = _run(pool_body(tenancy={"defaultTenant": "public"}), pods=_pods(1), sts_replicas=1, stats=stats)
    assert [t["tenantId"] for t in plan.status["tenants"]] == ["public"]


def test_volume_claims_of_a_running_pool_are_kept() -> None:
    tiers = {"d": parse_tier(tier_body("d", capacity={"bytes": "16Mi"})),
             "s": parse_tier(tier_body("s", "ssd", capacity={"bytes": "32Mi"}))}
    body = pool_body(storage={"tiers": ["d", "s"]})
    first, _ = _run(body, tiers=tiers)
    live = first.children[-1]["spec"]["volumeClaimTemplates"]
    same, _ = _run(body, tiers=tiers, sts_replicas=1, sts_claims=live)
    assert _conds(same)["Degraded"] == ("False", "AsExpected")
    bigger = {**tiers, "s": parse_tier(tier_body("s", "ssd", capacity={"bytes": "64Mi"}))}
    plan, _ = _run(body, tiers=bigger, sts_replicas=1, sts_claims=live)
    assert plan.children[-1]["spec"]["volumeClaimTemplates"] == live  # immutable: never sent changed
    cfg = json.loads(plan.children[1]["data"]["node.json"])
    assert cfg["ssdBytes"] == int(_claim(live) / 1.05)  # the node is never told more than its claim holds
    assert _conds(plan)["Degraded"] == ("True", "VolumeClaimsImmutable")
    added, _ = _run(body, tiers=tiers, sts_replicas=1, sts_claims=[])
    assert "ssdBytes" not in json.loads(added.children[1]["data"]["node.json"])
    assert "volumeClaimTemplates" not in added.children[-1]["spec"]


def _claim(claims: list[dict[str, Any]]) -> int:
    from kvpool_operator.units import parse_bytes

    return parse_bytes(claims[0]["spec"]["resources"]["requests"]["storage"])


def test_scale_down_waits_for_the_usage_of_every_node() -> None:
    body = pool_body(storage={"replicas": 3})
    _, body = _run(body, pods=_pods(3), sts_replicas=3, stats=_stats(3))
    body["spec"]["storage"]["replicas"] = 2
    stats = _stats(3, epoch=1)
    stats["p-store-1"] = None
    plan, _ = _run(body, pods=_pods(3), sts_replicas=3, stats=stats)
    assert plan.drain_calls == () and _conds(plan)["ScaleDownBlocked"] == ("True", "NodeStatsUnavailable")


def test_an_unusable_master_key_degrades_and_holds_back_new_store_nodes() -> None:
    body = pool_body(storage={"replicas": 2, "encryption": {"enabled": True, "secretName": "mine"}})
    problem = ("MasterKeySecretMissing", "Secret ns/mine (the master key of encryption at rest) does not exist")
    plan, _ = _run(body, master_key_problem=problem)
    assert _conds(plan)["Degraded"] == ("True", "MasterKeySecretMissing")
    assert "ns/mine" in plan.status["message"]
    kinds = {c["kind"] for c in plan.children}
    assert "StatefulSet" not in kinds and "ConfigMap" in kinds
    assert any(e.reason == "MasterKeySecretMissing" and e.type == "Warning" for e in plan.events)
    # Running nodes are left alone (they hold their keys); the condition says what is wrong.
    plan, _ = _run(body, pods=_pods(2), sts_replicas=2, stats=_stats(2), master_key_problem=problem)
    assert "StatefulSet" in {c["kind"] for c in plan.children}
    assert _conds(plan)["Degraded"] == ("True", "MasterKeySecretMissing")
    # Fixed: the condition clears.
    plan, _ = _run(body, pods=_pods(2), sts_replicas=2, stats=_stats(2))
    assert _conds(plan)["Degraded"] == ("False", "AsExpected")


def test_certificates_that_cannot_be_written_degrade_and_hold_back_new_store_nodes() -> None:
    body = pool_body(storage={"replicas": 2})
    problem = ("CertificatesUnavailable", "the pool's certificates could not be read or written (403 forbidden)")
    plan, _ = _run(body, tls_problem=problem)
    assert _conds(plan)["Degraded"] == ("True", "CertificatesUnavailable")
    assert "StatefulSet" not in {c["kind"] for c in plan.children}
    assert any(e.reason == "CertificatesUnavailable" and e.type == "Warning" for e in plan.events)
    # Running nodes keep theirs and go on serving; fixed, the condition clears.
    plan, _ = _run(body, pods=_pods(2), sts_replicas=2, stats=_stats(2), tls_problem=problem)
    assert "StatefulSet" in {c["kind"] for c in plan.children}
    plan, _ = _run(body, pods=_pods(2), sts_replicas=2, stats=_stats(2))
    assert _conds(plan)["Degraded"] == ("False", "AsExpected")


def test_a_readiness_flap_keeps_the_ring_and_a_long_outage_leaves_it() -> None:
    body = pool_body(storage={"replicas": 3})
    _, body = _run(body, pods=_pods(3), sts_replicas=3, stats=_stats(3))
    ring = body["status"]["ring"]
    flapping = [*_pods(2), StorePod("p-store-2", 2, "127.0.0.12", ready=False, unready_since_ms=NOW - 2000)]
    stats = _stats(3)
    stats["p-store-2"] = None
    plan, body = _run(body, pods=flapping, sts_replicas=3, stats=stats)
    assert plan.status["ring"] == ring and _conds(plan)["Degraded"][0] == "True"  # degraded, no new epoch
    later = NOW + int(S.member_unready_grace_seconds * 1000)
    plan, _ = _run(body, pods=flapping, sts_replicas=3, stats=stats, now_ms=later)
    assert plan.ring is not None and [m.id for m in plan.ring.members] == ["p-store-0", "p-store-1"]
    assert plan.ring.epoch == ring["epoch"] + 1


def test_a_pool_sets_its_own_unready_grace() -> None:
    # The same flap as above, 2 s old: a pool whose grace is 1 s drops the member, one whose
    # grace is an hour keeps it after the operator's 15 s too.
    flapping = [*_pods(2), StorePod("p-store-2", 2, "127.0.0.12", ready=False, unready_since_ms=NOW - 2000)]
    stats = _stats(3)
    stats["p-store-2"] = None
    for grace, later, kept in ((1, NOW, False), (3600, NOW + 60_000, True)):
        body = pool_body(storage={"replicas": 3, "memberUnreadyGraceSeconds": grace})
        _, body = _run(body, pods=_pods(3), sts_replicas=3, stats=_stats(3))
        ring = body["status"]["ring"]
        plan, _ = _run(body, pods=flapping, sts_replicas=3, stats=stats, now_ms=later)
        assert (plan.status["ring"] == ring) is kept, grace


def test_replication_reaches_the_ring_pushed_to_the_nodes() -> None:
    """spec.storage.replication is the ring's replicas, in status and in the SetRing message;
    changing it is a new epoch (the nodes and sidecars route writes by it)."""
    body = pool_body(storage={"replicas": 3, "replication": 2})
    _, body = _run(body)
    plan, body = _run(body, pods=_pods(3), sts_replicas=3, stats=_stats(3))
    assert plan.ring is not None and plan.ring.replicas == 2 and body["status"]["ring"]["replicas"] == 2
    assert ring_to_pb(plan.ring).replicas == 2 and len(plan.push_ring) == 3
    body["spec"]["storage"]["replication"] = 3
    again, body = _run(body, pods=_pods(3), sts_replicas=3, stats=_stats(3, epoch=plan.ring.epoch))
    assert again.ring is not None and again.ring.epoch == plan.ring.epoch + 1 and again.ring.replicas == 3
    assert len(again.push_ring) == 3


def test_a_tenants_pool_usage_is_in_its_quotas_unit() -> None:
    """Issue 19, finding 3: with R=2 every object is on two nodes; the pool's status shows the
    tenant's usage as its quota counts it (once per object) beside what the replicas take."""
    from kvpool_operator.status import TenantUsage

    mib = 1 << 20
    stats: dict[str, NodeStats | None] = {
        f"p-store-{i}": NodeStats(f"p-store-{i}", capacity_bytes=GI, used_bytes=mib // 2,
                                  tenants=(TenantUsage("t", mib // 2, mib, 128, {StoreCounter.REFUSED_QUOTA: 1}),))
        for i in range(4)}
    body = pool_body(storage={"replicas": 4, "replication": 2})
    plan, _ = _run(body, pods=_pods(4), sts_replicas=4, stats=stats)
    row = next(t for t in plan.status["tenants"] if t["tenantId"] == "t")
    assert (row["usedBytes"], row["physicalBytes"], row["quotaBytes"]) == (mib, 2 * mib, mib)
    assert plan.status["usedBytes"] == 2 * mib  # the pool's capacity use stays physical
