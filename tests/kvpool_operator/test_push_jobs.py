"""Following the store nodes' push jobs (drain and warm-up share it): pure, no I/O."""

from __future__ import annotations

from kvpool.core.push_status import DrainStatus
from kvpool_operator.drain import COUNTERS
from kvpool_operator.push_jobs import follow


def test_each_answer_is_classified_for_the_epoch() -> None:
    rows = {"a": {"state": "running"}, "b": {"state": "done", "movedObjects": 7}, "c": {}, "d": {}, "e": {}, "f": {}}
    statuses = {
        "a": DrainStatus(state="done", moved_objects=3, epoch=5),
        "b": None,  # finished before, silent now: stays done
        "c": None,  # never finished: unreachable, waited for
        "d": DrainStatus(state="running", moved_objects=1, remaining_objects=9, epoch=5),
        "e": DrainStatus(state="done", moved_objects=4, epoch=4),  # another epoch: ask again
        "f": DrainStatus(state="idle", epoch=0),
    }
    nodes, calls, pending = follow("abcdefg", rows, statuses, usable=set("abcdef"), epoch=5, counters=COUNTERS)
    assert {k: v["state"] for k, v in nodes.items()} == {
        "a": "done", "b": "done", "c": "unreachable", "d": "running", "e": "pending", "f": "pending", "g": "gone"}
    assert nodes["a"]["movedObjects"] == 3 and nodes["b"]["movedObjects"] == 7
    assert nodes["d"]["remainingObjects"] == 9 and "movedObjects" not in nodes["e"]
    assert calls == ["e", "f"]
    assert pending == 4  # c, d, e, f
    assert rows["a"] == {"state": "running"}  # the rows given are not changed
