"""The scale-up rebalance as pure plans: when it starts, when it pushes, what status says."""

from __future__ import annotations

from typing import Any

from kvpool.core.push_status import WarmStatus
from kvpool.core.ring import Member, Ring
from kvpool_operator.membership import StorePod
from kvpool_operator.model import parse_pool
from kvpool_operator.rebalance import RebalanceState, WarmSettings, advance
from kvpool_operator.reconcile import PoolObserved, PoolPlan, plan_pool
from kvpool_operator.settings import Settings
from kvpool_operator.status import NodeStats
from kvpool_operator.testing import apply_merge_patch, pool_body

NOW = 1_700_000_000_000
GI = 1 << 30
W = WarmSettings(fraction=1.0, deadline_seconds=60, bytes_per_second=1 << 20)


def _ring(epoch: int, n: int) -> Ring:
    return Ring(epoch, tuple(Member(f"p-store-{i}", f"127.0.0.{10 + i}:7400") for i in range(n)))


def _pods(n: int) -> list[StorePod]:
    return [StorePod(f"p-store-{i}", i, f"127.0.0.{10 + i}", ready=True) for i in range(n)]


def _done(epoch: int, moved: int = 5) -> WarmStatus:
    return WarmStatus("done", planned_objects=moved + 1, moved_objects=moved, moved_bytes=moved * 100,
                          skipped_objects=1, epoch=epoch)


def test_a_ring_that_adds_members_starts_a_rebalance_that_waits_for_the_ring() -> None:
    step = advance(None, _ring(3, 2), _ring(4, 3), {}, _pods(3), {}, NOW, W, held_bytes={"p-store-0": 1})
    assert step.state is not None and step.calls == ()
    assert step.state.added == ("p-store-2",) and step.state.sources == ("p-store-0", "p-store-1")
    assert step.state.stage == "WaitingForRing" and step.state.deadline_unix_ms == NOW + 60_000
    assert [e.reason for e in step.events] == ["RebalanceStarted"]
    # One node still on the old epoch: wait (the new node must take writes first).
    st = advance(step.state, _ring(4, 3), _ring(4, 3), {"p-store-0": 4, "p-store-1": 4, "p-store-2": 3}, _pods(3),
                 {}, NOW + 1000, W)
    assert st.state is not None and st.state.stage == "WaitingForRing" and st.calls == ()
    # Every member on epoch 4: the previous owners are asked to push.
    epochs = {f"p-store-{i}": 4 for i in range(3)}
    idle = {"p-store-0": WarmStatus(), "p-store-1": WarmStatus()}
    st = advance(st.state, _ring(4, 3), _ring(4, 3), epochs, _pods(3), idle, NOW + 2000, W)
    assert st.state is not None and st.state.stage == "Warming" and st.calls == ("p-store-0", "p-store-1")
    # Asked again while idle or on another epoch (an operator restart resumes), never while running.
    running = WarmStatus("running", planned_objects=9, moved_objects=3, moved_bytes=300, epoch=4)
    st = advance(st.state, _ring(4, 3), _ring(4, 3), epochs, _pods(3),
                 {"p-store-0": running, "p-store-1": WarmStatus("done", epoch=3)}, NOW + 3000, W)
    assert st.state is not None and st.calls == ("p-store-1",)
    assert st.state.totals()["movedObjects"] == 3 and st.finished is None
    # Both done: finished with the counts.
    st = advance(st.state, _ring(4, 3), _ring(4, 3), epochs, _pods(3),
                 {"p-store-0": _done(4, 7), "p-store-1": _done(4, 2)}, NOW + 4000, W)
    assert st.state is None and st.finished is not None
    assert st.finished["result"] == "Completed" and st.finished["movedObjects"] == 9
    assert st.finished["skippedObjects"] == 2 and st.finished["movedBytes"] == 900
    assert [e.reason for e in st.events] == ["RebalanceCompleted"]


def test_no_rebalance_without_added_members_held_bytes_or_fraction() -> None:
    assert advance(None, _ring(3, 3), _ring(4, 2), {}, _pods(2), {}, NOW, W).state is None  # a shrink
    assert advance(None, None, _ring(1, 3), {}, _pods(3), {}, NOW, W).state is None  # a new pool
    assert advance(None, _ring(1, 0), _ring(2, 3), {}, _pods(3), {}, NOW, W).state is None  # no previous owner
    empty = {"p-store-0": 0, "p-store-1": 0}
    assert advance(None, _ring(3, 2), _ring(4, 3), {}, _pods(3), {}, NOW, W, held_bytes=empty).state is None
    off = WarmSettings(fraction=0.0)
    assert advance(None, _ring(3, 2), _ring(4, 3), {}, _pods(3), {}, NOW, off).state is None
    # A scale-down cancels a running rebalance (its drain moves the objects).
    st = advance(None, _ring(3, 2), _ring(4, 3), {}, _pods(3), {}, NOW, W)
    assert st.state is not None
    cancel = advance(st.state, _ring(4, 3), _ring(4, 3), {}, _pods(3), {}, NOW, W, draining=True)
    assert cancel.state is None and cancel.finished is not None and cancel.finished["result"] == "Cancelled"


def test_a_second_scale_up_restarts_the_warm_up_for_every_new_member() -> None:
    st = advance(None, _ring(3, 2), _ring(4, 3), {}, _pods(4), {}, NOW, W)
    assert st.state is not None
    again = advance(st.state, _ring(4, 3), _ring(5, 4), {}, _pods(4), {}, NOW + 500, W)
    assert again.state is not None and again.state.epoch == 5
    assert again.state.added == ("p-store-2", "p-store-3") and again.state.sources == ("p-store-0", "p-store-1")
    assert again.state.stage == "WaitingForRing"


def test_deadline_and_a_gone_source() -> None:
    st = advance(None, _ring(3, 2), _ring(4, 3), {}, _pods(3), {}, NOW, W)
    assert st.state is not None
    epochs = {f"p-store-{i}": 4 for i in range(3)}
    st = advance(st.state, _ring(4, 3), _ring(4, 3), epochs, _pods(3), {}, NOW + 1, W)
    assert st.state is not None
    stuck = WarmStatus("running", planned_objects=9, moved_objects=1, remaining_objects=8, epoch=4)
    pods = [p for p in _pods(3) if p.name != "p-store-1"]
    late = advance(st.state, _ring(4, 3), _ring(4, 3), epochs, pods, {"p-store-0": stuck}, NOW + 91_000, W,
                   overrun_seconds=30)
    assert late.state is None and late.finished is not None and late.finished["result"] == "DeadlineExceeded"
    assert late.events[0].type == "Warning" and late.events[0].reason == "RebalanceDeadlineExceeded"
    assert late.finished["remainingObjects"] == 8


def test_state_round_trips_through_status() -> None:
    st = advance(None, _ring(3, 2), _ring(4, 3), {}, _pods(3), {}, NOW, W)
    assert st.state is not None
    doc = st.state.to_status()
    assert doc["phase"] == "Rebalancing" and doc["added"] == ["p-store-2"] and doc["movedObjects"] == 0
    assert RebalanceState.from_status(doc) == st.state
    assert RebalanceState.from_status(None) is None and RebalanceState.from_status({"phase": "Done"}) is None


def _stats(n: int, epoch: int, used: int = GI // 10) -> dict[str, NodeStats | None]:
    return {f"p-store-{i}": NodeStats(f"p-store-{i}", epoch=epoch, capacity_bytes=GI, used_bytes=used)
            for i in range(n)}


def _run(body: dict[str, Any], **obs: Any) -> tuple[PoolPlan, dict[str, Any]]:
    plan = plan_pool(PoolObserved(body=body, now_ms=obs.pop("now_ms", NOW), now_iso="t", **obs), Settings())
    return plan, dict(body, status=apply_merge_patch(body.get("status") or {}, plan.status))


def _conds(plan: PoolPlan) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in plan.status["conditions"]}


def test_scale_up_through_plan_pool_shows_rebalancing_then_done() -> None:
    body = pool_body(storage={"replicas": 2}, scaleUp={"warmBandwidth": "8Mi", "warmFraction": 0.5})
    assert parse_pool(body).warm_bytes_per_second == 8 << 20
    _, body = _run(body, pods=_pods(2), sts_replicas=2, stats=_stats(2, 0))
    plan, body = _run(body, pods=_pods(2), sts_replicas=2, stats=_stats(2, 1))
    assert _conds(plan)["Rebalancing"] == ("False", "Balanced") and plan.status["phase"] == "Ready"
    body["spec"]["storage"]["replicas"] = 3
    plan, body = _run(body, pods=_pods(2), sts_replicas=2, stats=_stats(2, 1))
    assert plan.replicas == 3 and plan.rebalance is None  # the new pod is not Ready yet
    # The new pod is Ready: a new ring epoch names it, and the rebalance starts.
    plan, body = _run(body, pods=_pods(3), sts_replicas=3, stats={**_stats(3, 0, 0), **_stats(2, 1)})
    assert plan.ring is not None and plan.ring.epoch == 2 and plan.rebalance is not None
    assert plan.warm_calls == () and _conds(plan)["Rebalancing"] == ("True", "WaitingForRing")
    assert plan.status["phase"] == "Rebalancing" and plan.status["rebalance"]["added"] == ["p-store-2"]
    assert "RebalanceStarted" in {e.reason for e in plan.events}
    # Everyone has epoch 2: the previous owners are asked to push, with the pool's bound and fraction.
    plan, body = _run(body, pods=_pods(3), sts_replicas=3, stats=_stats(3, 2), now_ms=NOW + 10_000,
                      warm_statuses={"p-store-0": WarmStatus(), "p-store-1": WarmStatus(epoch=1)})
    assert [m.id for m in plan.warm_calls] == ["p-store-0", "p-store-1"]
    assert plan.warm == WarmSettings(0.5, 300, 8 << 20)
    assert _conds(plan)["Rebalancing"] == ("True", "Warming")
    plan, body = _run(body, pods=_pods(3), sts_replicas=3, stats=_stats(3, 2), now_ms=NOW + 20_000,
                      warm_statuses={"p-store-0": _done(2, 4), "p-store-1": _done(2, 6)})
    assert plan.warm_calls == () and plan.status["rebalance"] is None
    assert _conds(plan)["Rebalancing"] == ("False", "Balanced") and plan.status["phase"] == "Ready"
    last = plan.status["lastRebalance"]
    assert last["result"] == "Completed" and last["movedObjects"] == 10 and last["added"] == ["p-store-2"]
    reasons = [e.reason for e in plan.events]
    assert "RebalanceCompleted" in reasons and "Balanced" in reasons  # the condition's transition Event


def test_a_previous_owner_silent_when_the_ring_grows_still_gets_its_rebalance() -> None:
    """The reconcile that publishes the grown ring is the only one that can start the warm-up: a
    previous owner that missed that one Stats call (a loaded node) may hold data, so it starts
    (CI saw a scale-up whose Rebalancing never came).  Only owners that all said 0 bytes skip it."""
    body = pool_body(storage={"replicas": 1}, scaleUp={"warmBandwidth": "1Mi"})
    _, body = _run(body, pods=_pods(1), sts_replicas=1, stats=_stats(1, 0))
    _, body = _run(body, pods=_pods(1), sts_replicas=1, stats=_stats(1, 1))
    body["spec"]["storage"]["replicas"] = 2
    _, body = _run(body, pods=_pods(1), sts_replicas=1, stats=_stats(1, 1))
    silent: dict[str, NodeStats | None] = {**_stats(2, 0, 0), "p-store-0": None}
    plan, body = _run(body, pods=_pods(2), sts_replicas=2, stats=silent)
    assert plan.ring is not None and plan.ring.epoch == 2
    assert plan.rebalance is not None and plan.rebalance.sources == ("p-store-0",)
    assert _conds(plan)["Rebalancing"] == ("True", "WaitingForRing")
    # The same step with every previous owner saying "empty" has nothing to warm.
    assert advance(None, _ring(1, 1), _ring(2, 2), {}, _pods(2), {}, NOW, W,
                   held_bytes={"p-store-0": 0, "p-store-1": None}).state is None
    assert advance(None, _ring(1, 1), _ring(2, 2), {}, _pods(2), {}, NOW, W,
                   held_bytes={"p-store-1": 0}).state is not None


def _ring_r(epoch: int, n: int, replicas: int = 2, skip: tuple[int, ...] = (), draining: tuple[int, ...] = ()) -> Ring:
    return Ring(epoch, tuple(Member(f"p-store-{i}", f"127.0.0.{10 + i}:7400",
                                    "draining" if i in draining else "active")
                             for i in range(n) if i not in skip), replicas=replicas)


def test_a_member_lost_without_a_drain_starts_a_re_replication_from_the_survivors() -> None:
    pods = [p for p in _pods(3) if p.name != "p-store-1"]
    step = advance(None, _ring_r(3, 3), _ring_r(4, 3, skip=(1,)), {}, pods, {}, NOW, W)
    assert step.state is not None and step.calls == ()
    assert step.state.removed == ("p-store-1",) and step.state.added == ()
    assert step.state.sources == ("p-store-0", "p-store-2") and step.state.reason == "WaitingForRing"
    assert [e.reason for e in step.events] == ["RebalanceStarted"]
    assert "lost a copy with p-store-1" in step.events[0].message
    epochs = {"p-store-0": 4, "p-store-2": 4}
    st = advance(step.state, _ring_r(4, 3, skip=(1,)), _ring_r(4, 3, skip=(1,)), epochs, pods,
                 {"p-store-0": WarmStatus(), "p-store-2": WarmStatus()}, NOW + 1000, W)
    assert st.state is not None and st.calls == ("p-store-0", "p-store-2")
    assert st.state.stage == "Warming" and st.state.reason == "Rereplicating"
    assert st.state.progress_message(NOW + 1000).startswith("re-replication of the blocks that lost a copy")
    assert RebalanceState.from_status(st.state.to_status()) == st.state
    st = advance(st.state, _ring_r(4, 3, skip=(1,)), _ring_r(4, 3, skip=(1,)), epochs, pods,
                 {"p-store-0": _done(4, 3), "p-store-2": _done(4, 4)}, NOW + 2000, W)
    assert st.state is None and st.finished is not None
    assert st.finished["result"] == "Completed" and st.finished["removed"] == ["p-store-1"]
    assert st.finished["movedObjects"] == 7


def test_no_re_replication_with_r1_after_a_drain_or_when_the_member_is_back() -> None:
    pods = _pods(3)
    # R=1: the only copy died with the node.
    assert advance(None, _ring_r(3, 3, 1), _ring_r(4, 3, 1, skip=(1,)), {}, pods, {}, NOW, W).state is None
    # A drained member was draining in the previous ring: its drain moved its objects.
    assert advance(None, _ring_r(3, 3, draining=(1,)), _ring_r(4, 3, skip=(1,)), {}, pods, {}, NOW, W).state is None
    # A member that goes draining is still a member: the drain is in charge.
    assert advance(None, _ring_r(3, 3), _ring_r(4, 3, draining=(1,)), {}, pods, {}, NOW, W).state is None
    # The warm-up turned off does not turn re-replication off.
    off = WarmSettings(fraction=0.0)
    st = advance(None, _ring_r(3, 3), _ring_r(4, 3, skip=(1,)), {}, pods, {}, NOW, off)
    assert st.state is not None and st.state.removed == ("p-store-1",)
    # A second loss before it finished: both are restored.
    four = advance(None, _ring_r(3, 4), _ring_r(4, 4, skip=(1,)), {}, _pods(4), {}, NOW, W)
    assert four.state is not None
    again = advance(four.state, _ring_r(4, 4, skip=(1,)), _ring_r(5, 4, skip=(1, 2)), {}, _pods(4), {}, NOW + 500, W)
    assert again.state is not None and again.state.epoch == 5 and again.state.added == ()
    assert again.state.removed == ("p-store-1", "p-store-2") and again.state.sources == ("p-store-0", "p-store-3")
    # The member back in the ring: the re-replication is superseded by the warm-up of it.
    back = advance(st.state, _ring_r(4, 3, skip=(1,)), _ring_r(5, 3), {}, pods, {}, NOW + 500, W)
    assert back.finished is not None and back.finished["result"] == "Superseded"
    assert back.state is not None and back.state.added == ("p-store-1",) and back.state.removed == ()


def test_a_dead_store_pod_through_plan_pool_shows_rereplicating_and_sends_removed() -> None:
    body = pool_body(storage={"replicas": 3, "replication": 2})
    _, body = _run(body, pods=_pods(3), sts_replicas=3, stats=_stats(3, 0))
    plan, body = _run(body, pods=_pods(3), sts_replicas=3, stats=_stats(3, 1))
    assert plan.ring is not None and plan.ring.epoch == 1 and plan.rebalance is None
    # p-store-1 went not-ready long ago (past the unready grace): it leaves the ring, no drain.
    dead = [*_pods(3)]
    dead[1] = StorePod("p-store-1", 1, "127.0.0.11", ready=False, unready_since_ms=NOW - 600_000)
    stats = {k: v for k, v in _stats(3, 1).items() if k != "p-store-1"}
    plan, body = _run(body, pods=dead, sts_replicas=3, stats=stats)
    assert plan.ring is not None and plan.ring.epoch == 2 and [m.id for m in plan.ring.members] == [
        "p-store-0", "p-store-2"]
    assert plan.rebalance is not None and plan.rebalance.removed == ("p-store-1",)
    assert _conds(plan)["Rebalancing"] == ("True", "WaitingForRing")
    assert plan.status["rebalance"]["removed"] == ["p-store-1"]
    stats2 = {k: v for k, v in _stats(3, 2).items() if k != "p-store-1"}
    plan, body = _run(body, pods=dead, sts_replicas=3, stats=stats2, now_ms=NOW + 10_000,
                      warm_statuses={"p-store-0": WarmStatus(), "p-store-2": WarmStatus()})
    assert [m.id for m in plan.warm_calls] == ["p-store-0", "p-store-2"]
    assert _conds(plan)["Rebalancing"] == ("True", "Rereplicating") and plan.status["phase"] == "Rebalancing"
    plan, body = _run(body, pods=dead, sts_replicas=3, stats=stats2, now_ms=NOW + 20_000,
                      warm_statuses={"p-store-0": _done(2, 4), "p-store-2": _done(2, 6)})
    assert plan.status["rebalance"] is None and plan.status["lastRebalance"]["removed"] == ["p-store-1"]
    assert _conds(plan)["Rebalancing"] == ("False", "Balanced")
