"""RDMA transport: pure parts everywhere, the device path only where a device exists."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from kvpool.transfer import TransferCode, TransferEngine, TransferRequest, rdma_devices, rdma_status
from kvpool.transfer import rdma as rdma_module
from kvpool.transfer.rdma import (
    RdmaEndpoint,
    RdmaSegmentKey,
    RdmaUnavailable,
    build_send_wr,
    gid_bytes,
    make_gid,
    plan_work_requests,
    waves,
)
from kvpool.transfer.testing import MakeRemote, SimulatedQueuePair, SimulatedRdmaContext, random_bytes


def test_status_is_consistent_with_devices() -> None:
    devices, reason = rdma_status()
    assert devices == rdma_devices()
    assert bool(devices) != bool(reason)  # a reason exactly when there is nothing


def test_segment_key_round_trip() -> None:
    key = RdmaSegmentKey("arena-0", 0x7F00_1234_5000, 1 << 34, 0xDEADBEEF)
    data = key.encode()
    assert RdmaSegmentKey.decode(data) == key
    assert len(data) == len(RdmaSegmentKey("x", 0, 0, 0).encode())  # fixed size


@pytest.mark.parametrize(
    "mutate",
    [lambda b: b[:-1], lambda b: bytes([9]) + b[1:], lambda b: b[:2] + bytes([0, 0]) + b[4:], lambda b: b + b"x"],
)
def test_segment_key_rejects_malformed(mutate) -> None:  # type: ignore[no-untyped-def]
    data = RdmaSegmentKey("arena", 4096, 8192, 7).encode()
    with pytest.raises(ValueError):
        RdmaSegmentKey.decode(mutate(data))


def test_segment_key_validates_fields() -> None:
    with pytest.raises(ValueError):
        RdmaSegmentKey("arena", 0, 0, 1 << 32)
    with pytest.raises(ValueError):
        RdmaSegmentKey("", 0, 0, 0)


def test_endpoint_round_trip_and_validation() -> None:
    ep = RdmaEndpoint(qp_num=0x12345, psn=0xABCDE, lid=3, gid=bytes(range(16)), port=1, mtu=3)
    assert RdmaEndpoint.decode(ep.encode()) == ep
    with pytest.raises(ValueError):
        RdmaEndpoint(qp_num=1 << 24, psn=0, lid=0, gid=bytes(16))
    with pytest.raises(ValueError):
        RdmaEndpoint(qp_num=1, psn=0, lid=0, gid=bytes(15))
    with pytest.raises(ValueError):
        RdmaEndpoint.decode(ep.encode()[:-2])


def test_plan_work_requests_slices_and_checks_bounds() -> None:
    key = RdmaSegmentKey("arena", addr=1_000_000, length=10_000, rkey=42)
    requests = [
        (True, 500, 0, 2500),  # sliced into 1000 + 1000 + 500
        (False, 9000, 9000, 1000),  # exactly the tail
        (True, 0, 9500, 1000),  # runs past the end
        (True, 0, 20_000, 1),  # starts past the end
        (False, 0, 100, 0),  # empty: nothing to post
    ]
    plans, errors = plan_work_requests(requests, key, max_message_bytes=1000, first_wr_id=10)
    assert set(errors) == {2, 3}
    assert all(e.code is TransferCode.OUT_OF_BOUNDS for e in errors.values())
    assert [(p.wr_id, p.index, p.local_addr, p.remote_addr, p.length) for p in plans] == [
        (10, 0, 500, 1_000_000, 1000),
        (11, 0, 1500, 1_001_000, 1000),
        (12, 0, 2500, 1_002_000, 500),
        (13, 1, 9000, 1_009_000, 1000),
    ]
    assert [p.is_read for p in plans] == [True, True, True, False]
    assert {p.rkey for p in plans} == {42}


def test_waves_respect_queue_depth() -> None:
    key = RdmaSegmentKey("arena", 0, 1 << 20, 1)
    plans, _ = plan_work_requests([(True, 0, i * 4096, 4096) for i in range(10)], key)
    grouped = waves(plans, 4)
    assert [len(w) for w in grouped] == [4, 4, 2]
    assert [p for w in grouped for p in w] == plans
    with pytest.raises(ValueError):
        waves(plans, 0)


def _pyverbs_or_skip() -> None:
    rdma_status()  # applies KVPOOL_PYVERBS_PATH
    pytest.importorskip("pyverbs.wr", reason="pyverbs is not importable")


def test_gid_conversion_with_pyverbs() -> None:
    _pyverbs_or_skip()
    raw = bytes.fromhex("fe800000000000000202b3fffe1e8329")
    gid = make_gid(raw)
    assert str(gid) == "fe80:0000:0000:0000:0202:b3ff:fe1e:8329"
    assert gid_bytes(gid) == raw


def test_build_send_wr_with_pyverbs() -> None:
    _pyverbs_or_skip()
    import pyverbs.enums as e

    key = RdmaSegmentKey("arena", addr=1 << 20, length=1 << 20, rkey=77)
    plans, _ = plan_work_requests([(True, 4096, 0, 512), (False, 8192, 512, 64)], key)
    read_wr, write_wr = (build_send_wr(p, lkey=5) for p in plans)
    assert (read_wr.wr_id, read_wr.opcode, read_wr.num_sge) == (plans[0].wr_id, e.IBV_WR_RDMA_READ, 1)
    assert write_wr.opcode == e.IBV_WR_RDMA_WRITE
    assert read_wr.send_flags & e.IBV_SEND_SIGNALED


def test_engine_refuses_rdma_without_devices() -> None:
    devices, reason = rdma_status()
    if devices:
        pytest.skip("this host has RDMA devices")
    with TransferEngine() as engine:
        assert not engine.rdma_available
        with pytest.raises(RdmaUnavailable, match="no RDMA devices"):
            engine.attach_rdma("127.0.0.1:1", None, [])  # type: ignore[arg-type]


def test_rdma_loopback_read_write() -> None:
    devices, reason = rdma_status()
    if not devices:
        pytest.skip(f"no RDMA devices: {reason}")
    from kvpool.transfer.rdma import RdmaContext

    ctx = RdmaContext(devices[0])
    try:
        remote = memoryview(mmap.mmap(-1, 1 << 20))
        local = memoryview(mmap.mmap(-1, 1 << 20))
        remote[:] = bytes(range(256)) * 4096
        key = ctx.register("arena", remote)
        ctx.register("local", local)
        a, b = ctx.create_queue_pair(), ctx.create_queue_pair()
        a.connect(b.endpoint)
        b.connect(a.endpoint)
        with TransferEngine() as engine:
            engine.attach_rdma("peer:1", a, [key])
            statuses = engine.submit("peer:1", [TransferRequest("read", local, "arena", 0, 1 << 20)]).wait(10)
            assert statuses[0].ok and bytes(local) == bytes(remote)
        b.close()
    finally:
        ctx.close()


def test_engine_routes_to_rdma_and_maps_statuses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rdma_module, "rdma_status", lambda refresh=False: (["sim0"], ""))
    remote_mem = mmap.mmap(-1, 1 << 20)
    local_mem = mmap.mmap(-1, 1 << 20)
    remote, local = memoryview(remote_mem), memoryview(local_mem)
    remote[:] = random_bytes(1 << 20, 3).tobytes()
    ctx = SimulatedRdmaContext()
    key = ctx.register("arena", remote)
    ctx.register("local", local)
    qp = SimulatedQueuePair(ctx, fail_wr={3})
    unregistered = bytearray(16)
    with TransferEngine() as engine:
        engine.attach_rdma("store-0:7000", qp, [key])
        reqs = [
            TransferRequest("read", local[0:4096], "arena", 8192, 4096),
            TransferRequest("write", local[4096:8192], "arena", 0, 4096),
            TransferRequest("read", local[8192:8200], "arena", (1 << 20) - 4, 8),  # out of bounds
            TransferRequest("read", local[8200:8300], "arena", 0, 100),  # wr 3: injected failure
            TransferRequest("read", memoryview(unregistered), "arena", 16, 16),  # registered for the batch
        ]
        statuses = engine.submit("store-0:7000", reqs).wait(10)
    assert [s.code for s in statuses] == [
        TransferCode.OK,
        TransferCode.OK,
        TransferCode.OUT_OF_BOUNDS,
        TransferCode.CONNECTION,
        TransferCode.OK,
    ]
    assert bytes(local[0:4096]) == bytes(remote[8192:12288])
    assert bytes(remote[0:4096]) == bytes(local[4096:8192])
    assert bytes(unregistered) == bytes(remote[16:32])
    assert len(ctx.temporary) == 1 and ctx.temporary[0].closed
    assert {p.rkey for p in qp.posted} == {key.rkey}
    assert qp.closed  # the engine owns the attached queue pair
    local.release()
    remote.release()


def test_wrong_rkey_is_a_remote_access_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rdma_module, "rdma_status", lambda refresh=False: (["sim0"], ""))
    ctx = SimulatedRdmaContext()
    remote = memoryview(bytearray(8192))
    key = ctx.register("arena", remote)
    forged = RdmaSegmentKey("arena", key.addr, key.length, key.rkey + 1)
    with TransferEngine() as engine:
        engine.attach_rdma("p:1", ctx.create_queue_pair(), [forged])
        statuses = engine.submit("p:1", [TransferRequest("read", memoryview(bytearray(64)), "arena", 0, 64)]).wait(10)
    assert statuses[0].code is TransferCode.CONNECTION and "access" in statuses[0].message


def test_simulated_rdma_path_is_really_taken_and_falls_back_to_tcp_when_broken(make_remote: MakeRemote) -> None:
    remote = make_remote("rdma-sim")
    seg = remote.segment("arena", 1 << 20)
    np.frombuffer(seg.view, np.uint8)[:] = random_bytes(1 << 20, 4)
    buf = bytearray(1 << 20)
    req = TransferRequest("read", memoryview(buf), "arena", 0, 1 << 20)
    assert remote.engine.submit(remote.address, [req]).wait(10)[0].ok
    assert bytes(buf) == bytes(seg.view)
    qp = remote.queue_pair
    assert qp is not None and len(qp.posted) == 1
    assert remote.engine.stats().get("bytes_read", 0) == 0  # nothing went over TCP
    assert remote.rdma is not None and all(r.closed for r in remote.rdma.temporary)  # per-batch MRs released

    qp.fail_wr = {1}  # the next batch's first work request completes in error
    statuses = remote.engine.submit(remote.address, [req]).wait(10)
    assert statuses[0].code is TransferCode.CONNECTION
    buf[:] = bytes(len(buf))
    assert remote.engine.submit(remote.address, [req]).wait(10)[0].ok  # the broken QP is bypassed: TCP
    assert bytes(buf) == bytes(seg.view)
    assert remote.engine.stats()["bytes_read"] == 1 << 20
