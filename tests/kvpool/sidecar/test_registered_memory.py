"""Registered client memory (``Client.alloc_buffer`` + ``get_into``) on real sidecar and store
processes: pool objects land in the caller's buffers byte-exact without entering the local tier,
local hits are copied in by the sidecar, and every bad registration or span is refused without
harm to the sidecar or other connections."""

from __future__ import annotations

import fcntl
import os
import random
import tempfile
from typing import Any

import numpy as np
import pytest

import kvpool
from kvpool.client.client import Client
from kvpool.core import errors
from kvpool.transfer import memfd
from kvpool.transfer._sockio import send_with_fd
from kvpool.transfer.testing import RawConnection, unix_socket
from kvpool.wire import sidecar_frames as fp
from kvpool.wire.counters import SidecarCounter
from kvpool.wire.proto import store_pb2 as pb

MiB = 1 << 20
CLUSTER = {"stores": 2, "sidecars": 2, "store_bytes": 128 * MiB, "local_bytes": 48 * MiB}
SIZES = (1, 4097, MiB, 5 * MiB + 3)  # the last is over the sidecar's parallel-copy size


def _written(cluster: Any, rng: random.Random, h: Any,
             sizes: tuple[int, ...] = SIZES) -> tuple[list[bytes], list[bytes]]:
    """Objects put through sidecar A and present in the pool (B matches all of them)."""
    keys, values = h.keys(rng, len(sizes)), h.values(rng, sizes)
    with kvpool.connect(cluster.sidecars[0]) as a:
        assert a.put(keys, values) == [pb.OK] * len(keys)
    with kvpool.connect(cluster.sidecars[1]) as b:
        h.wait_for(lambda: b.match(keys) == len(keys), what="the writes to reach the pool")
    return keys, values


def _spans(buf: np.ndarray, sizes: list[int], slack: int = 0) -> list[np.ndarray]:
    out, at = [], 0
    for s in sizes:
        out.append(buf[at:at + s + slack])
        at += s + slack
    return out


def test_pool_objects_land_in_registered_buffers_without_entering_the_local_tier(
        module_cluster: Any, rng: random.Random, h: Any) -> None:
    keys, values = _written(module_cluster, rng, h)
    with kvpool.connect(module_cluster.sidecars[1]) as b:
        buf = b.alloc_buffer(sum(len(v) for v in values) + 4 * len(values))
        outs = _spans(buf, [len(v) for v in values], slack=4)
        before = h.counters(b)
        for _ in range(2):
            buf[:] = 0xEE
            assert b.get_into(keys, outs) == [len(v) for v in values]
            assert all(bytes(o[:len(v)]) == v for o, v in zip(outs, values, strict=True))
            assert all(bytes(o[len(v):]) == b"\xee" * 4 for o, v in zip(outs, values, strict=True))
        after = h.counters(b)
        # Both reads came from the pool: a read-through leaves the local tier as it was.
        assert after[SidecarCounter.READ_HITS_POOL] - before.get(SidecarCounter.READ_HITS_POOL, 0) == 2 * len(keys)
        assert after.get(SidecarCounter.READ_HITS_LOCAL, 0) == before.get(SidecarCounter.READ_HITS_LOCAL, 0)
        assert b.match_lease(keys, lease_ms=1000)[0] == len(keys)


def test_local_hits_duplicates_and_misses_in_one_registered_read(module_cluster: Any, rng: random.Random,
                                                                  h: Any) -> None:
    pooled, pooled_values = _written(module_cluster, rng, h, (3000, 2 * MiB))
    with kvpool.connect(module_cluster.sidecars[1]) as b:
        local, local_values = h.keys(rng, 2), h.values(rng, (10, 6 * MiB))
        assert b.put(local, local_values) == [pb.OK, pb.OK]
        absent = h.keys(rng, 1)
        keys = [local[0], pooled[0], absent[0], pooled[0], local[1], pooled[1], local[0]]
        want = [local_values[0], pooled_values[0], None, pooled_values[0], local_values[1], pooled_values[1],
                local_values[0]]
        sizes = [len(v) if v is not None else 64 for v in want]
        buf = b.alloc_buffer(sum(sizes))
        before = h.counters(b)
        got = b.get_into(keys, _spans(buf, sizes))
        assert got == [len(v) if v is not None else -1 for v in want]
        for o, v in zip(_spans(buf, sizes), want, strict=True):
            if v is not None:
                assert bytes(o[:len(v)]) == v
        after = h.counters(b)
        def grew(name: str) -> int:
            return int(after[name] - before.get(name, 0))
        assert grew(SidecarCounter.READ_HITS_LOCAL) == 3  # L0 twice, L1
        assert grew(SidecarCounter.READ_HITS_POOL) == 3  # P0 twice (fetched once), P1
        assert grew(SidecarCounter.READ_MISSES) == 1


def test_a_registered_buffer_smaller_than_its_object_is_refused(module_cluster: Any, rng: random.Random,
                                                                 h: Any) -> None:
    keys, values = _written(module_cluster, rng, h, (5000,))
    with kvpool.connect(module_cluster.sidecars[1]) as b:
        buf = b.alloc_buffer(8192)
        with pytest.raises(errors.InvalidArgument, match="4999 bytes for an object of 5000"):
            b.get_into(keys, [buf[:4999]])
        local = h.keys(rng, 1)
        assert b.put(local, [b"x" * 300]) == [pb.OK]
        with pytest.raises(errors.InvalidArgument, match="299 bytes for an object of 300"):
            b.get_into(local, [buf[:299]])
        assert b.get_into(keys, [buf[:5000]]) == [5000] and bytes(buf[:5000]) == values[0]


def test_buffers_outside_registered_memory_still_read_through_the_arena(module_cluster: Any, rng: random.Random,
                                                                        h: Any) -> None:
    keys, values = _written(module_cluster, rng, h, (100, 200))
    with kvpool.connect(module_cluster.sidecars[1]) as b:
        buf = b.alloc_buffer(4096)
        plain = bytearray(200)
        assert b.get_into(keys, [buf[:100], plain]) == [100, 200]
        assert bytes(buf[:100]) == values[0] and bytes(plain) == values[1]
        readonly = memoryview(bytes(100))
        with pytest.raises(ValueError, match="read-only"):
            b.get_into(keys[:1], [readonly])  # not writable: never handed to the sidecar either


def _sidecar_maps_client_memory(cluster: Any, i: int) -> bool:
    with open(f"/proc/{cluster.sidecar_pids[i]}/maps") as f:
        return "memfd:kvpool-client-buffer" in f.read()


def test_freed_and_closed_buffers_are_unmapped_by_the_sidecar(module_cluster: Any, rng: random.Random,
                                                              h: Any) -> None:
    keys, values = _written(module_cluster, rng, h, (1000,))
    with kvpool.connect(module_cluster.sidecars[1]) as b:
        assert not _sidecar_maps_client_memory(module_cluster, 1)  # a test before left nothing mapped
        buf = b.alloc_buffer(1 << 16)
        assert b.get_into(keys, [buf[:1000]]) == [1000]
        assert _sidecar_maps_client_memory(module_cluster, 1)
        b.free_buffer(buf)
        h.wait_for(lambda: not _sidecar_maps_client_memory(module_cluster, 1), what="the sidecar to unmap")
        with pytest.raises(errors.InvalidArgument, match="alloc_buffer"):
            b.free_buffer(bytearray(10))
        out = bytearray(1000)
        assert b.get_into(keys, [out]) == [1000] and bytes(out) == values[0]
        buf2 = b.alloc_buffer(4096)
        assert b.get_into(keys, [buf2[:1000]]) == [1000] and bytes(buf2[:1000]) == values[0]
    h.wait_for(lambda: not _sidecar_maps_client_memory(module_cluster, 1), what="close to unmap")


class Raw(RawConnection):
    """A hand-driven fast-session connection to sidecar B."""

    def __init__(self, cluster: Any) -> None:
        super().__init__(unix_socket(fp.socket_path(cluster.sidecars[1][len("unix://"):])))

    def call(self, op: int, fd: int | None = None, **kw: Any) -> tuple[fp.Response, str, bytes]:
        self.rid += 1
        frame = fp.encode_request(op, self.rid, **kw)
        if fd is None:
            self.send(frame)
        else:
            send_with_fd(self.sock, frame, fd)
        resp = fp.decode_response(self.recv(fp.RESPONSE_SIZE))
        msg = self.recv(resp.msg_len).decode() if resp.msg_len else ""
        return resp, msg, self.recv(resp.body_bytes()) if resp.body_bytes() else b""


def _status(exc: type[errors.KvpoolError]) -> int:
    return errors.SESSION_STATUS[exc]


def test_bad_registrations_and_spans_are_refused_and_keep_the_connection(module_cluster: Any,
                                                                         rng: random.Random, h: Any) -> None:
    keys, values = _written(module_cluster, rng, h, (512,))
    raw = Raw(module_cluster)
    region = memfd.create(4096)
    try:
        assert region.fd is not None
        resp, msg, _ = raw.call(fp.OP_REGISTER, fd=region.fd, ref=1)
        assert resp.status == _status(errors.Unauthenticated)  # HELLO first, even for memory
        assert raw.call(fp.OP_HELLO)[0].status == 0
        resp, msg, _ = raw.call(fp.OP_REGISTER, ref=1)
        assert resp.status == _status(errors.InvalidArgument) and "descriptor" in msg
        unsealed = os.memfd_create("unsealed")
        os.ftruncate(unsealed, 4096)
        resp, msg, _ = raw.call(fp.OP_REGISTER, fd=unsealed, ref=2)
        os.close(unsealed)
        assert resp.status == _status(errors.InvalidArgument) and "F_SEAL_SHRINK" in msg
        with tempfile.TemporaryFile(dir=os.getcwd()) as f:
            f.truncate(4096)
            resp, msg, _ = raw.call(fp.OP_REGISTER, fd=f.fileno(), ref=3)
        assert resp.status == _status(errors.InvalidArgument) and "memfd" in msg
        assert raw.call(fp.OP_REGISTER, fd=region.fd, ref=1)[0].status == 0
        for targets, why in (([9, 0, 512], "not registered"), ([1, 4000, 512], "outside region"),
                             ([1, 1 << 63, 1 << 63], "outside region"), ([3, 0, 512], "not registered")):
            resp, msg, _ = raw.call(fp.OP_READ_INTO, keys=keys[0], values=targets)
            assert resp.status == _status(errors.InvalidArgument) and why in msg, (targets, msg)
        resp, _, body = raw.call(fp.OP_READ_INTO, keys=keys[0], values=[1, 100, 512])
        assert resp.status == 0 and fp.decode_sizes(resp, body) == ([pb.OK], [512])
        assert bytes(region.view[100:612]) == values[0]
    finally:
        raw.close()
        region.close()


def test_a_descriptor_on_another_frame_closes_only_that_connection(module_cluster: Any, rng: random.Random,
                                                                   h: Any) -> None:
    keys, values = _written(module_cluster, rng, h, (700,))
    other = Raw(module_cluster)
    raw = Raw(module_cluster)
    region = memfd.create(4096)
    try:
        assert other.call(fp.OP_HELLO)[0].status == 0 and raw.call(fp.OP_HELLO)[0].status == 0
        assert region.fd is not None
        send_with_fd(raw.sock, fp.encode_request(fp.OP_MATCH, 9, keys=keys[0]), region.fd)
        assert raw.closed_by_peer()
        assert other.call(fp.OP_MATCH, keys=keys[0])[0].status == 0  # unaffected
    finally:
        other.close()
        raw.close()
        region.close()
    with kvpool.connect(module_cluster.sidecars[1]) as b:
        buf = b.alloc_buffer(4096)
        assert b.get_into(keys, [buf[:700]]) == [700] and bytes(buf[:700]) == values[0]


def test_a_registration_over_the_sidecars_limit_falls_back_to_the_arena(module_cluster: Any,
                                                                         rng: random.Random, h: Any) -> None:
    keys, values = _written(module_cluster, rng, h, (3000,))
    small = module_cluster.add_sidecar(extra_args=["--max-registered-bytes", "64KiB"])
    at = module_cluster.sidecars.index(small)
    c = Client(small)
    try:
        ok, too_big = c.alloc_buffer(1 << 16), c.alloc_buffer(1 << 17)
        assert c.get_into(keys, [ok[:3000]]) == [3000] and bytes(ok[:3000]) == values[0]
        assert _sidecar_maps_client_memory(module_cluster, at)
        # Refused by the sidecar: read through the arena instead, the same bytes.
        assert c.get_into(keys, [too_big[:3000]]) == [3000] and bytes(too_big[:3000]) == values[0]
        assert c.get_into(keys, [too_big[:3000]]) == [3000]  # not asked again (it would be refused)
        c.free_buffer(ok)
        h.wait_for(lambda: not _sidecar_maps_client_memory(module_cluster, at), what="the sidecar to unmap")
        # The room freed by the first is there again.
        again = c.alloc_buffer(1 << 16)
        assert c.get_into(keys, [again[:3000]]) == [3000] and bytes(again[:3000]) == values[0]
        assert _sidecar_maps_client_memory(module_cluster, at)
    finally:
        c.close()


def _sidecar_holds_memfd(cluster: Any, i: int, name: str) -> bool:
    """Whether sidecar ``i`` holds a descriptor (or a mapping) of the memfd called ``name``."""
    pid = cluster.sidecar_pids[i]
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            if os.readlink(f"{fd_dir}/{fd}").startswith(f"/memfd:{name}"):
                return True
        except OSError:
            continue  # closed meanwhile
    with open(f"/proc/{pid}/maps") as f:
        return f"memfd:{name}" in f.read()


def test_a_refused_or_broken_registration_keeps_no_client_memory(module_cluster: Any, rng: random.Random,
                                                                  h: Any) -> None:
    """Every descriptor a client passes is either mapped and tracked or closed at once: a
    REGISTER refused (before HELLO), or whose frame breaks after its header (a body that does
    not parse), must not leave the client's memory held by the sidecar."""
    name = f"kvpool-test-leak-{rng.randrange(1 << 30)}"
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 1 << 20)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, memfd.SEALS)
        raw = Raw(module_cluster)
        try:
            resp, _, _ = raw.call(fp.OP_REGISTER, fd=fd, ref=1)  # before HELLO: refused
            assert resp.status == _status(errors.Unauthenticated)
        finally:
            raw.close()
        raw = Raw(module_cluster)
        try:
            assert raw.call(fp.OP_HELLO)[0].status == 0
            frame = b"".join(fp.encode_request(fp.OP_REGISTER, 2, ref=1, text=b"ab"))
            send_with_fd(raw.sock, [frame[:-2] + b"\xff\xfe"], fd)  # its text is not UTF-8
            assert raw.closed_by_peer()
        finally:
            raw.close()
        h.wait_for(lambda: not _sidecar_holds_memfd(module_cluster, 1, name), 10, what="the descriptor closed")
    finally:
        os.close(fd)
