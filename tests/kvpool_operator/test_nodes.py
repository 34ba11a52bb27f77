"""Conversions between the store admin protocol and the planners' types (no sockets)."""

from kvpool.proto import store_pb2 as pb
from kvpool.ring import Member, Ring
from kvpool_operator.nodes import drain_status_from_pb, ring_to_pb


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
