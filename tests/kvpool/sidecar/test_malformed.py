"""Malformed client requests get a clear error and leave the sidecar serving."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from kvpool.core import errors
from kvpool.wire.counters import SidecarCounter
from kvpool.wire.proto import sidecar_pb2 as spb
from kvpool.wire.proto import sidecar_pb2_grpc as spbg
from kvpool.wire.proto import store_pb2 as pb


@pytest.fixture
def stub(shared: Any) -> Iterator[spbg.SidecarStub]:
    with grpc.insecure_channel(shared.sidecars[0]) as ch:
        yield spbg.SidecarStub(ch)


def _still_serving(shared: Any, h: Any, rng: random.Random) -> None:
    assert shared.sidecar_procs[0].popen.poll() is None
    with shared.connect(0) as c:
        keys = h.keys(rng, 2)
        values = h.values(rng, [100, 5000])
        assert c.put(keys, values) == [pb.OK, pb.OK]
        with c.get(keys) as got:
            assert [bytes(v) for v in got] == values


def _invalid(call: Any) -> str:
    with pytest.raises(grpc.RpcError) as ei:
        call()
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value
    return str(ei.value.details())


@pytest.mark.parametrize("nbytes", [1, 31, 33, 65])
def test_keys_blob_not_a_multiple_of_32(shared: Any, h: Any, rng: random.Random, stub: Any, nbytes: int) -> None:
    blob = rng.randbytes(nbytes)
    for call in (lambda: stub.Probe(spb.ProbeRequest(keys=blob, kind=pb.STATE), timeout=10),
                 lambda: stub.Remove(pb.RemoveRequest(keys=blob), timeout=10)):
        detail = _invalid(call)
        assert f"{nbytes} bytes" in detail and "multiple of 32" in detail
    _still_serving(shared, h, rng)


def test_bad_items_are_refused_per_item(shared: Any, h: Any, rng: random.Random, stub: Any) -> None:
    """Over the fast session (the write's only wire; its whole-call refusals, such as a checksum
    count that does not match, are in test_fast_session.py)."""
    k = h.keys(rng, 4)
    with shared.connect(0) as c:
        capacity = c.stats().local_capacity_bytes
        codes, _, rid, inc = c._fast.write_start(b"".join([k[0], k[1], k[2], k[2], k[3]]),
                                                 [0, capacity * 2, 10, 10, 1 << 40], pb.BLOCK, "chatbot")
        assert codes == [pb.INVALID, pb.TOO_LARGE, pb.OK, pb.INVALID, pb.TOO_LARGE]
        assert c._fast.write_commit(rid, [0] * 5, inc)[2] == pb.OK
        # Committing twice is a per-item failure, not a crash.
        assert c._fast.write_commit(rid, [0] * 5, inc) == [pb.LEASE_EXPIRED] * 5
        assert c.put([k[2]], [b"x" * 10]) == [pb.ALREADY_EXISTS]
        assert c.put([k[0], k[3]], [b"y", b"z"]) == [pb.OK, pb.OK]  # refused items held nothing
    assert stub.Probe(spb.ProbeRequest(keys=b""), timeout=10).present == b""  # probing nothing: harmless
    _still_serving(shared, h, rng)


def test_unknown_kind_is_refused_at_the_sidecar(shared: Any, h: Any, rng: random.Random, stub: Any) -> None:
    """Regression: a bad kind used to reach the store nodes, whose refusal marked them down, so
    the next writes silently skipped the pool."""
    key = h.keys(rng, 1)[0]
    for call in (lambda: stub.Probe(spb.ProbeRequest(keys=key, kind=7), timeout=10),
                 lambda: stub.Remove(pb.RemoveRequest(keys=key, kind=7), timeout=10)):
        assert "unknown object kind 7" in _invalid(call)
    with shared.connect(0) as a, shared.connect(1) as b:
        before = h.counters(a).get(SidecarCounter.POOL_ERRORS, 0)
        keys = h.keys(rng, 16)
        values = h.values(rng, [100] * 16)
        assert a.put(keys, values) == [pb.OK] * 16
        h.wait_for(lambda: a.stats().pending_pool_bytes == 0, what="write-through backlog")
        assert b.match(keys) == 16
        assert h.counters(a).get(SidecarCounter.POOL_ERRORS, 0) == before


def test_client_side_argument_errors(shared: Any, h: Any, rng: random.Random) -> None:
    with shared.connect(0) as c:
        keys = h.keys(rng, 2)
        with pytest.raises(errors.InvalidArgument, match="2 keys but 1 values"):
            c.put(keys, [b"x"])
        with pytest.raises(errors.InvalidArgument, match="multiple of 128"):
            c.put_state(keys[0], 100, b"state")
        with pytest.raises(errors.InvalidArgument, match="multiple of 128"):
            c.get_state(keys[0], 0)
        with pytest.raises(errors.InvalidArgument):
            c.match([b"short"])
        with pytest.raises(errors.InvalidArgument):
            c.put([b"k" * 31], [b"v"])
    with pytest.raises(errors.InvalidArgument, match="unix://"):
        __import__("kvpool").connect("127.0.0.1:1234")
    _still_serving(shared, h, rng)


def test_oversized_lease_is_capped(shared: Any, h: Any, rng: random.Random, stub: Any) -> None:
    """A client cannot pin the local tier for weeks: leases are capped by the sidecar."""
    import struct
    import time

    with shared.connect(0) as c:
        keys = h.keys(rng, 1)
        assert c.put(keys, [b"v" * 64]) == [pb.OK]
    r = stub.ReadRanges(spb.ReadRangesRequest(keys=keys[0], counts=[1], ranges=struct.pack("<QQ", 0, 64),
                                              lease_ms=2**32 - 1), timeout=10)
    assert list(r.codes) == [pb.OK]
    assert r.lease_id and r.lease_expires_unix_ms <= (time.time() + 120) * 1000
    stub.ReadRanges(spb.ReadRangesRequest(release_lease_ids=[r.lease_id]), timeout=10)
