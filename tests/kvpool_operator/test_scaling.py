"""Scale decisions: autoscaling on utilization; scale-down refused above the limit unless forced."""

from typing import Any

from kvpool_operator.model import PoolSpec, parse_pool
from kvpool_operator.scaling import autoscale_target, decide
from kvpool_operator.testing import pool_body

GI = 1 << 30


def _pool(replicas: int, force: bool = False, **spec: Any) -> PoolSpec:
    body = pool_body(storage={"replicas": replicas}, **spec)
    if force:
        body["metadata"]["annotations"] = {"kvpool.io/force-scale-down": "true"}
    return parse_pool(body)


def test_no_change_and_up() -> None:
    assert decide(_pool(3), 3, 0, GI).action == "none"
    d = decide(_pool(5), 3, 0, GI)
    assert (d.action, d.target, d.reason) == ("up", 5, "SpecChanged")


def test_scale_down_allowed_at_the_limit() -> None:
    # 3 → 2 nodes of 1Gi with 1.6Gi used: exactly 0.8 of what remains, allowed.
    d = decide(_pool(2), 3, int(1.6 * GI), GI)
    assert (d.action, d.target) == ("down", 2) and abs(d.projected_utilization - 0.8) < 1e-9


def test_scale_down_refused_above_the_limit() -> None:
    d = decide(_pool(2), 3, int(1.7 * GI), GI)
    assert (d.action, d.target, d.wanted, d.reason) == ("blocked", 3, 2, "UtilizationTooHigh")
    assert "85.0%" in d.message and "kvpool.io/force-scale-down" in d.message


def test_scale_down_forced_by_annotation() -> None:
    d = decide(_pool(2, force=True), 3, int(1.7 * GI), GI)
    assert (d.action, d.target, d.reason) == ("down", 2, "Forced")


def test_scale_to_zero_with_data_is_refused() -> None:
    d = decide(_pool(0), 1, 1, GI)
    assert d.action == "blocked" and "∞" in d.message
    assert decide(_pool(0), 1, 0, GI).action == "down"


def test_custom_limit() -> None:
    d = decide(_pool(2, scaleDown={"utilizationLimit": 0.9}), 3, int(1.7 * GI), GI)
    assert d.action == "down"


def test_an_autoscaled_pool_starts_at_its_replicas_within_the_bounds() -> None:
    """No nodes yet: spec.storage.replicas, clamped to [min, max] (the CRD's rule keeps it inside
    when both are set; replicas left at its default 1 is lifted to minReplicas)."""
    auto = {"enabled": True, "minReplicas": 2, "maxReplicas": 6, "targetUtilization": 0.5}
    assert autoscale_target(_pool(4, autoscaling=auto), 0, 0, GI) == 4
    assert decide(_pool(4, autoscaling=auto), 0, 0, GI).target == 4
    assert autoscale_target(_pool(1, autoscaling=auto), 0, 0, GI) == 2
    assert autoscale_target(_pool(9, autoscaling=auto), 0, 0, GI) == 6
    # Once it has nodes, the load decides: idle, it steps down towards minReplicas.
    assert autoscale_target(_pool(4, autoscaling=auto), 4, 0, GI) == 3


def test_autoscaler() -> None:
    p = _pool(3, autoscaling={"enabled": True, "minReplicas": 2, "maxReplicas": 6, "targetUtilization": 0.5})
    assert autoscale_target(p, 3, 0, GI) == 2
    assert autoscale_target(p, 3, int(2.5 * GI), GI) == 5
    assert autoscale_target(p, 3, 100 * GI, GI) == 6
    assert autoscale_target(p, 3, int(1.5 * GI), GI) == 3
    # Down one node at a time, and only with room to spare (hysteresis).
    assert autoscale_target(p, 5, int(0.2 * GI), GI) == 4
    assert autoscale_target(p, 5, int(1.9 * GI), GI) == 5
    d = decide(p, 3, int(2.5 * GI), GI)
    assert (d.action, d.target, d.reason) == ("up", 5, "Autoscaling")


def test_autoscaler_down_is_also_guarded() -> None:
    p = _pool(3, autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 6, "targetUtilization": 0.9},
              scaleDown={"utilizationLimit": 0.5})
    d = decide(p, 3, int(1.2 * GI), GI)
    assert d.action == "blocked" and d.wanted == 2


def test_lowered_max_replicas_steps_down_or_is_refused_with_a_reason() -> None:
    # 3 nodes of 1Gi holding 1.7Gi; the user lowers maxReplicas to 1.  Hysteresis (the smaller
    # pool would be above the target) must not hide the bound: one node at a time, each step
    # checked against the limit.
    p = _pool(1, autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 1, "targetUtilization": 0.5})
    assert autoscale_target(p, 3, int(1.7 * GI), GI) == 2
    d = decide(p, 3, int(1.5 * GI), GI)
    assert (d.action, d.target, d.reason) == ("down", 2, "Autoscaling")  # 75 % of what remains
    d = decide(p, 2, int(0.9 * GI), GI)
    assert (d.action, d.target, d.wanted, d.reason) == ("blocked", 2, 1, "UtilizationTooHigh")
    assert "90.0%" in d.message
    # Within the bound, the same load holds the pool where it is (no refusal to report).
    p3 = _pool(1, autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 3, "targetUtilization": 0.5})
    assert decide(p3, 2, int(0.9 * GI), GI).action == "none"
