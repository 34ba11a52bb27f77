"""Protobuf messages to and from the domain's types (one conversion per type, used by every side)."""

from __future__ import annotations

from kvpool.core import errors
from kvpool.core.ring import Member, Ring
from kvpool.wire.proto import store_pb2 as pb


def ring_to_pb(ring: Ring) -> pb.Ring:
    return pb.Ring(epoch=ring.epoch, replicas=ring.replicas, members=[
        pb.RingMember(id=m.id, address=m.address, state=m.state, transfer_address=m.transfer_address)
        for m in ring.members])


def ring_from_pb(msg: pb.Ring) -> Ring:
    members = []
    for m in msg.members:
        if m.state not in ("active", "draining", ""):
            raise errors.InvalidArgument(f"member {m.id}: state must be active or draining")
        members.append(Member(m.id, m.address, m.state or "active", m.transfer_address))
    return Ring(epoch=msg.epoch, members=tuple(members), replicas=msg.replicas or 1)
