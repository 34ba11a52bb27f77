"""Handoff records and the decode side's plan (kvpool.core.handoff_record): pure, no I/O."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest

from kvpool.core import handoff_record as ho
from kvpool.core.errors import HandoffInvalid
from kvpool.core.planning import plan_hit
from kvpool.wire.proto import store_pb2 as pb

KEY = ho.handoff_key(b"tenant-secret", "acme")
NOW = 1_700_000_000_000


def keys(n: int) -> tuple[bytes, ...]:
    return tuple(hashlib.sha256(i.to_bytes(4, "little")).digest() for i in range(n))


def record(n: int = 8, prompt: int = 8 * 128 + 40, state: bool = True, peer: bool = True,
           **kw: object) -> ho.HandoffRecord:
    flags = (ho.FLAG_STATE if state else 0) | (ho.FLAG_PEER if state and peer else 0)
    fields: dict[str, object] = dict(
        tenant="acme", prompt_tokens=prompt, block_tokens=128, keys=keys(n), created_unix_ms=NOW,
        expires_unix_ms=NOW + 600_000, state_position=((prompt - 1) // 128) * 128 if state else 0,
        state_size=1_415_040 if state else 0, state_checksum=0x1234 if state else 0,
        peer="10.0.0.7:7070" if peer else "", segment="arena" if peer else "", state_offset=4096,
        export_id=0xDEADBEEF if peer else 0, state_expires_unix_ms=NOW + 30_000, instance="abcd", flags=flags)
    fields.update(kw)
    return ho.HandoffRecord(**fields).signed(KEY)  # type: ignore[arg-type]


def test_round_trip_bytes_and_json() -> None:
    rec = record()
    blob = rec.to_bytes()
    assert len(blob) < 8 * 32 + 200  # small: 32 bytes a block plus a fixed header
    back = ho.from_bytes(blob)
    assert back == rec and back.tag == rec.tag
    assert ho.from_json(rec.to_json()) == rec
    assert json.loads(rec.to_json())["kvpoolHandoff"] == ho.VERSION
    assert ho.parse(blob) == ho.parse(rec.to_json()) == ho.parse(rec) == rec
    assert back.state_key == rec.keys[8 - 1]
    assert ho.check(back, KEY, "acme", NOW) == (pb.OK, "")


def test_every_altered_byte_is_refused() -> None:
    blob = bytearray(record().to_bytes())
    for i in range(len(blob)):
        bad = bytearray(blob)
        bad[i] ^= 0x01
        try:
            rec = ho.from_bytes(bytes(bad))
        except HandoffInvalid:
            continue  # malformed is refused too
        code, _ = ho.check(rec, KEY, "acme", NOW)
        assert code in (pb.HANDOFF_INVALID, pb.WRONG_TENANT), f"byte {i} altered and accepted"


def test_forged_record_another_key_and_another_tenant() -> None:
    rec = record()
    forged = dataclasses.replace(rec, export_id=42).signed(ho.handoff_key(b"guess", "acme"))
    assert ho.check(forged, KEY, "acme", NOW)[0] == pb.HANDOFF_INVALID
    # A tenant's key never verifies another tenant's record, and the tenant is checked first.
    other = record(tenant="globex")
    assert ho.check(other, KEY, "acme", NOW)[0] == pb.WRONG_TENANT
    assert ho.handoff_key(b"s", "acme") != ho.handoff_key(b"s", "globex")
    unsigned = dataclasses.replace(rec, tag=b"")
    assert ho.check(unsigned, KEY, "acme", NOW)[0] == pb.HANDOFF_INVALID
    with pytest.raises(HandoffInvalid):
        unsigned.to_bytes()


def test_expiry_of_record_and_of_state_export() -> None:
    rec = record()
    assert ho.check(rec, KEY, "acme", rec.expires_unix_ms - 1)[0] == pb.OK
    assert ho.check(rec, KEY, "acme", rec.expires_unix_ms)[0] == pb.HANDOFF_EXPIRED
    src, fail = ho.state_sources(rec, NOW, "other")
    assert src == ["local", "peer", "pool"] and fail == ho.StateOutcome.GONE
    src, fail = ho.state_sources(rec, rec.state_expires_unix_ms, "other")
    assert src == ["local", "pool"] and fail == ho.StateOutcome.EXPIRED
    # The prefill sidecar itself never asks itself; a record without state asks nowhere.
    assert ho.state_sources(rec, NOW, "abcd")[0] == ["local", "pool"]
    assert ho.state_sources(record(state=False), NOW, "x") == ([], ho.StateOutcome.NONE)
    assert ho.state_sources(record(peer=False), NOW, "x")[0] == ["local", "pool"]


@pytest.mark.parametrize("blob", [b"", b"KVHO", b"XXXX" + bytes(200)])
def test_malformed_bytes(blob: bytes) -> None:
    with pytest.raises(HandoffInvalid):
        ho.from_bytes(blob)


def test_malformed_fields() -> None:
    good = record().to_bytes()
    with pytest.raises(HandoffInvalid, match="version"):
        ho.from_bytes(good[:4] + b"\x02" + good[5:])
    with pytest.raises(HandoffInvalid):
        ho.from_bytes(good[:-1])  # truncated
    with pytest.raises(HandoffInvalid):
        ho.from_bytes(good + b"\x00")  # trailing
    with pytest.raises(HandoffInvalid, match="state position"):
        ho.validate(dataclasses.replace(record(), state_position=100))
    with pytest.raises(HandoffInvalid, match="exceed"):
        ho.validate(dataclasses.replace(record(), prompt_tokens=100))
    with pytest.raises(HandoffInvalid):
        ho.from_json("{}")
    with pytest.raises(HandoffInvalid):
        ho.from_json(json.dumps({"kvpoolHandoff": 9, "record": ""}))


def test_plan_with_state_continues_from_the_attach_position() -> None:
    rec = record(n=1024, prompt=131072)
    assert rec.state_position == 130944
    plan = ho.plan_handoff(rec, 1024, state_ok=True)
    assert (plan.hit_tokens, plan.state_position, plan.compute_tokens) == (130944, 130944, 128)


def test_plan_without_state_is_the_bounded_replay_of_the_hit_rule() -> None:
    rec = record(n=1024, prompt=131072)
    plan = ho.plan_handoff(rec, 1024, state_ok=False)
    assert plan == plan_hit(131072, 1024 * 128, (), 128, 128, 6)
    assert (plan.hit_tokens, plan.compute_tokens) == (130688, 384)  # DESIGN §5's example
    assert plan.state_position is None


def test_plan_with_missing_blocks_covers_the_local_prefix_only() -> None:
    rec = record(n=8, prompt=8 * 128 + 40)
    plan = ho.plan_handoff(rec, 3, state_ok=True)  # state useless: blocks up to it are missing
    assert plan == plan_hit(rec.prompt_tokens, 3 * 128, (), 128, 128, 6)
    assert plan.hit_tokens == 2 * 128
    assert ho.plan_handoff(rec, 0, state_ok=True).hit_tokens == 0
    # No window state at all: the hit is the local prefix (within L - 1).
    nostate = record(state=False)
    assert ho.plan_handoff(nostate, 8, state_ok=False, window_tokens=0).hit_tokens == 8 * 128
