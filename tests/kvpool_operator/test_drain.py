"""The scale-down state machine: start, progress, completion, deadline, cancel, resume."""

from kvpool.core.push_status import DrainStatus
from kvpool_operator import drain
from kvpool_operator.drain import DrainState
from kvpool_operator.membership import StorePod

NOW = 1_000_000


def _pods(n: int) -> list[StorePod]:
    return [StorePod(f"p-store-{i}", i, f"127.0.0.{10 + i}", ready=True) for i in range(n)]


def test_start_marks_highest_ordinals() -> None:
    st = drain.start(3, 1, _pods(3), NOW, 60)
    assert st.state is not None
    assert st.state.leaving == ("p-store-1", "p-store-2") and st.draining == {"p-store-1", "p-store-2"}
    assert st.calls == ("p-store-1", "p-store-2")
    assert st.replicas == 3 and st.member_limit == 3  # nothing shrinks until the objects moved
    assert st.state.deadline_unix_ms == NOW + 60_000
    assert st.state.to_status()["deadline"] == "1970-01-01T00:17:40Z"
    assert st.events[0].reason == "DrainStarted"


def test_start_with_nothing_to_drain_scales_at_once() -> None:
    pods = [*_pods(2), StorePod("p-store-2", 2, "", ready=False)]
    st = drain.start(3, 2, pods, NOW, 60)
    assert st.state is None and st.replicas == 2 and st.events[0].reason == "ScaledDown"


def test_progress_then_completion() -> None:
    st = drain.start(3, 2, _pods(3), NOW, 60).state
    assert st is not None
    running = DrainStatus("running", moved_objects=5, moved_bytes=500, remaining_objects=7, epoch=4)
    s1 = drain.step(st, 4, _pods(3), {"p-store-2": running}, NOW + 1000, 2)
    assert s1.state is not None and s1.calls == () and s1.replicas == 3 and s1.draining == {"p-store-2"}
    assert s1.state.totals()["movedObjects"] == 5 and s1.state.epoch == 4
    assert "moved 5 objects" in s1.state.progress_message(NOW + 1000)
    done = DrainStatus("done", moved_objects=12, moved_bytes=1200, dropped_objects=1, dropped_bytes=100, epoch=4)
    s2 = drain.step(s1.state, 4, _pods(3), {"p-store-2": done}, NOW + 2000, 2)
    assert s2.state is None and s2.replicas == 2 and s2.member_limit == 2 and s2.draining == frozenset()
    assert s2.finished is not None and s2.finished["result"] == "Completed"
    assert s2.finished["reason"] == "SpecChanged"  # lastDrain says who asked (the autoscaler: Autoscaling)
    assert (s2.finished["movedObjects"], s2.finished["droppedObjects"], s2.finished["durationSeconds"]) == (12, 1, 2.0)
    assert s2.events[0].reason == "DrainCompleted" and s2.events[0].type == "Normal"


def test_idle_or_stale_epoch_is_called_again() -> None:
    # After an operator (or node) restart the node may not know the drain: ask again, same deadline.
    st = drain.start(3, 2, _pods(3), NOW, 60).state
    assert st is not None
    for answer in (DrainStatus("idle"), DrainStatus("done", epoch=3)):
        s = drain.step(st, 4, _pods(3), {"p-store-2": answer}, NOW + 10, 2)
        assert s.calls == ("p-store-2",) and s.state is not None


def test_resume_from_status() -> None:
    st = drain.start(3, 2, _pods(3), NOW, 60).state
    assert st is not None
    back = DrainState.from_status(st.to_status())
    assert back == st
    assert DrainState.from_status(None) is None and DrainState.from_status({"phase": "Done"}) is None


def test_unreachable_waits_until_the_deadline_then_ends() -> None:
    st = drain.start(3, 2, _pods(3), NOW, 60).state
    assert st is not None
    s1 = drain.step(st, 4, _pods(3), {"p-store-2": None}, NOW + 5000, 2, overrun_seconds=30)
    assert s1.state is not None and s1.state.nodes["p-store-2"]["state"] == "unreachable"
    s2 = drain.step(s1.state, 4, _pods(3), {"p-store-2": None}, NOW + 91_000, 2, overrun_seconds=30)
    assert s2.state is None and s2.replicas == 2
    assert s2.finished is not None and s2.finished["result"] == "DeadlineExceeded"
    assert s2.events[0].type == "Warning"


def test_gone_node_does_not_block() -> None:
    st = drain.start(3, 2, _pods(3), NOW, 60).state
    assert st is not None
    s = drain.step(st, 4, _pods(2), {}, NOW + 10, 2)
    assert s.state is None and s.replicas == 2


def test_scale_back_up_cancels() -> None:
    st = drain.start(3, 2, _pods(3), NOW, 60).state
    assert st is not None
    s = drain.step(st, 4, _pods(3), {}, NOW + 10, 3)
    assert s.state is None and s.replicas == 3 and s.member_limit == 3 and s.draining == frozenset()
    assert s.events[0].reason == "DrainCancelled"
