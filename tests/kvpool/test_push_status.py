"""The push jobs' statuses and their messages: one definition, converted field for field (pure)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvpool.core.push_status import DrainStatus, WarmStatus
from kvpool.wire.convert import drain_status_from_pb, drain_status_to_pb, warm_status_from_pb, warm_status_to_pb
from kvpool.wire.proto import store_pb2 as pb

CASES = [(DrainStatus, pb.DrainStatus, drain_status_to_pb, drain_status_from_pb),
         (WarmStatus, pb.WarmStatus, warm_status_to_pb, warm_status_from_pb)]


@pytest.mark.parametrize(("cls", "msg", "to_pb", "from_pb"), CASES, ids=["drain", "warm"])
def test_the_status_has_the_messages_fields(cls: Any, msg: Any, to_pb: Any, from_pb: Any) -> None:
    """A field added to the message without the dataclass (or the other way) fails here."""
    assert [f.name for f in dataclasses.fields(cls)] == [f.name for f in msg.DESCRIPTOR.fields]


@pytest.mark.parametrize(("cls", "msg", "to_pb", "from_pb"), CASES, ids=["drain", "warm"])
def test_round_trip_and_an_unset_state_is_idle(cls: Any, msg: Any, to_pb: Any, from_pb: Any) -> None:
    values = {f.name: (f"state-{i}" if f.name == "state" else 1000 + i) for i, f in enumerate(dataclasses.fields(cls))}
    status = cls(**values)
    assert from_pb(to_pb(status)) == status
    assert from_pb(msg()) == cls(state="idle")
