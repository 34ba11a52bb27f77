"""Conversions between the store admin protocol and the planners' types (no sockets)."""

from typing import Any

import pytest

from kvpool.core.ring import Member, Ring
from kvpool.wire.proto import store_pb2 as pb
from kvpool_operator.nodes import Nodes, drain_status_from_pb, ring_to_pb


def test_ring_to_pb() -> None:
    ring = Ring(7, (Member("a", "1.2.3.4:7400", "active", "1.2.3.4:7401"), Member("b", "x:1", "draining")), 2)
    msg = ring_to_pb(ring)
    assert (msg.epoch, msg.replicas) == (7, 2)
    assert [(m.id, m.address, m.state, m.transfer_address) for m in msg.members] == [
        ("a", "1.2.3.4:7400", "active", "1.2.3.4:7401"), ("b", "x:1", "draining", "")]


def test_drain_status_from_pb() -> None:
    st = drain_status_from_pb(pb.DrainStatus(state="running", moved_objects=3, moved_bytes=30, dropped_objects=1,
                                             dropped_bytes=10, remaining_objects=2, deadline_unix_ms=99, epoch=4))
    assert st.counters() == {"movedObjects": 3, "movedBytes": 30, "droppedObjects": 1, "droppedBytes": 10,
                             "remainingObjects": 2}
    assert (st.state, st.epoch, st.deadline_unix_ms) == ("running", 4, 99)
    assert drain_status_from_pb(pb.DrainStatus()).state == "idle"


def test_warm_request_carries_the_removed_members(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[Any] = []

    def call(address: str, method: str, request: Any, token: str) -> Any:
        sent.append((method, request))
        return pb.WarmStatus(state="running", epoch=5)

    nodes = Nodes()
    monkeypatch.setattr(nodes, "_call", call)
    st = nodes.warm("x:1", "t", Ring(5, (Member("a", "x:1"),), 2), [], 99, 10, 0.0, ["b"])
    assert (st.state, st.epoch) == ("running", 5)
    method, req = sent[0]
    assert method == "Warm" and list(req.removed) == ["b"] and list(req.added) == []
    assert (req.deadline_unix_ms, req.max_bytes_per_second, req.ring.replicas) == (99, 10, 2)
