"""Protobuf messages to and from the domain's types (one conversion per type, used by every side)."""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any, TypeVar

from kvpool.core import errors
from kvpool.core.push_status import DrainStatus, WarmStatus
from kvpool.core.ring import Member, Ring
from kvpool.wire.proto import store_pb2 as pb

S = TypeVar("S", DrainStatus, WarmStatus)


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


def drain_status_to_pb(status: DrainStatus) -> pb.DrainStatus:
    return pb.DrainStatus(**asdict(status))  # the same fields, name for name (tested)


def warm_status_to_pb(status: WarmStatus) -> pb.WarmStatus:
    return pb.WarmStatus(**asdict(status))


def drain_status_from_pb(msg: pb.DrainStatus) -> DrainStatus:
    return _status_from_pb(DrainStatus, msg)


def warm_status_from_pb(msg: pb.WarmStatus) -> WarmStatus:
    return _status_from_pb(WarmStatus, msg)


def _status_from_pb(cls: type[S], msg: Any) -> S:
    values = {f.name: getattr(msg, f.name) for f in fields(cls)}
    values["state"] = values["state"] or "idle"  # an unset state is a node that has no job
    return cls(**values)
