"""Malformed gRPC requests and transfer frames: clear errors, and the node keeps serving."""

from __future__ import annotations

import random
import socket
from typing import Any

import grpc
import pytest

from kvpool.transfer.protocol import OP_READ, OP_WRITE, REQUEST_SIZE, RESPONSE, encode_request
from kvpool.wire.proto import store_pb2 as pb

KiB = 1 << 10


def _code(fn: Any, req: Any) -> grpc.StatusCode:
    try:
        fn(req, timeout=10)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def _round_trip(node: Any, rng: random.Random) -> None:
    c = node.client()
    assert c.health().ok
    key, val = rng.randbytes(32), rng.randbytes(5000)
    assert c.put([key], [val]) == [pb.OK]
    [got] = c.get([key])
    assert got is not None and bytes(got) == val


BAD = grpc.StatusCode.INVALID_ARGUMENT


def test_malformed_control_requests_are_invalid_argument(shared_store: Any, rng: random.Random) -> None:
    s = shared_store.stub()
    k2 = rng.randbytes(64)
    cases = [
        (s.Exists, pb.ExistsRequest(keys=b"x" * 33)),
        (s.Exists, pb.ExistsRequest(keys=b"x" * 31)),
        (s.Exists, pb.ExistsRequest(keys=k2, kind=7)),  # type: ignore[arg-type]
        (s.Get, pb.GetRequest(keys=b"y" * 65)),
        (s.Get, pb.GetRequest(keys=k2, kind=-3)),  # type: ignore[arg-type]
        (s.Remove, pb.RemoveRequest(keys=b"z" * 1)),
        (s.PutStart, pb.PutStartRequest(keys=b"k" * 40, sizes=[1])),
        (s.PutStart, pb.PutStartRequest(keys=k2, sizes=[1])),            # 2 keys, 1 size
        (s.PutStart, pb.PutStartRequest(keys=k2[:32], sizes=[1, 2, 3])),  # 1 key, 3 sizes
        (s.PutStart, pb.PutStartRequest(keys=k2, sizes=[10, 10], kind=9)),  # type: ignore[arg-type]
        (s.PutCommit, pb.PutCommitRequest(reservation_id=0, checksums=[1])),
        (s.PutCommit, pb.PutCommitRequest(reservation_id=2**64 - 1, checksums=[1])),
        (s.PutCommit, pb.PutCommitRequest(reservation_id=987654321, checksums=[])),
        (shared_store.admin_stub().SetRing,
         pb.Ring(epoch=1, members=[pb.RingMember(id="x", address="a:1", state="zombie")])),
    ]
    for fn, req in cases:
        assert _code(fn, req) == BAD, (fn, req)
    # A real reservation with wrong-length checksums or revoke map is refused without side effects.
    start = s.PutStart(pb.PutStartRequest(keys=k2, sizes=[4096, 4096]), timeout=10)
    assert list(start.codes) == [pb.OK, pb.OK]
    for req in (pb.PutCommitRequest(reservation_id=start.reservation_id, checksums=[1]),
                pb.PutCommitRequest(reservation_id=start.reservation_id, checksums=[1, 2, 3]),
                pb.PutCommitRequest(reservation_id=start.reservation_id, checksums=[1, 2], revoke=b"\x01"),
                pb.PutCommitRequest(reservation_id=start.reservation_id, checksums=[1, 2], revoke=b"\x00" * 5)):
        assert _code(s.PutCommit, req) == BAD, req
    # Still a live reservation: revoke it properly.
    s.PutRevoke(pb.PutRevokeRequest(reservation_id=start.reservation_id), timeout=10)
    # Per-item problems are per-item codes, not call failures.
    r = s.PutStart(pb.PutStartRequest(keys=k2, sizes=[0, 2**64 - 1]), timeout=10)
    assert list(r.codes) == [pb.INVALID, pb.TOO_LARGE]
    dup = k2[:32] * 2
    r = s.PutStart(pb.PutStartRequest(keys=dup, sizes=[10, 10], timeout_ms=100), timeout=10)
    assert list(r.codes) == [pb.OK, pb.INVALID]
    # Garbage lease ids are ignored; empty batches are empty answers.
    s.Release(pb.ReleaseRequest(lease_ids=[0, 1, 2**64 - 1]), timeout=10)
    assert list(s.Get(pb.GetRequest(keys=b"", lease_id=2**63), timeout=10).codes) == []
    assert s.Exists(pb.ExistsRequest(keys=b""), timeout=10).prefix == 0
    _round_trip(shared_store, rng)


def _raw(addr: str) -> socket.socket:
    host, _, port = addr.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def _response_code(sock: socket.socket) -> int:
    buf = b""
    while len(buf) < RESPONSE.size:
        chunk = sock.recv(RESPONSE.size - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    _, _, code, msg_len, _, payload_len = RESPONSE.unpack(buf)
    left = msg_len + payload_len
    while left:
        left -= len(sock.recv(min(left, 65536)))
    return int(code)


def test_malformed_transfer_frames(shared_store: Any, h: Any, rng: random.Random) -> None:
    addr = shared_store.transfer_address
    c = shared_store.client()
    key, val = rng.randbytes(32), rng.randbytes(8 * KiB)
    assert c.put([key], [val]) == [pb.OK]
    plan = h.get_plan(c, [key], lease_ms=30000)
    seg, off, tok = plan.location.segment.encode(), plan.offsets[0], plan.tokens[0]
    # Per-request refusals keep the connection: wrong token, out of bounds, unknown segment,
    # a write to a committed object (immutable), huge offsets.
    sock = _raw(addr)
    with sock:
        for op, segname, o, n, t in [(OP_READ, seg, off, 8 * KiB, tok ^ 0x5A5A),
                                     (OP_READ, seg, 2**63, 10, tok),
                                     (OP_READ, b"nope", 0, 10, tok),
                                     (OP_READ, seg, off, 64 * KiB * 1024, tok),
                                     (OP_WRITE, seg, off, 4, tok)]:
            sock.sendall(encode_request(op, 1, segname, o, n, t) + (b"abcd" if op == OP_WRITE else b""))
            assert _response_code(sock) != 0
        # And a valid read on the same connection still works.
        sock.sendall(encode_request(OP_READ, 2, seg, off, 8 * KiB, tok))
        assert _response_code(sock) == 0
    # Stream-level garbage closes only that connection.
    for junk in [b"\x00" * REQUEST_SIZE, rng.randbytes(REQUEST_SIZE * 3), b"KVTQ" + b"\xff" * 100,
                 encode_request(OP_READ, 1, seg, off, 10, tok)[:50], b"GET / HTTP/1.1\r\n\r\n"]:
        sock = _raw(addr)
        with sock:
            try:
                sock.sendall(junk)
                sock.shutdown(socket.SHUT_WR)
                sock.settimeout(10)
                while sock.recv(65536):
                    pass
            except (ConnectionError, OSError):
                pass  # the node hung up on the garbage: that is the expected outcome
    c.release([plan.lease_id])
    _round_trip(shared_store, rng)


def test_garbage_on_the_grpc_port(shared_store: Any, rng: random.Random) -> None:
    for junk in [rng.randbytes(1000), b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + rng.randbytes(300),
                 b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b""]:
        sock = _raw(shared_store.address)
        with sock:
            sock.sendall(junk)
            sock.settimeout(5)
            try:
                sock.recv(65536)
            except (TimeoutError, ConnectionError):
                pass
    _round_trip(shared_store, rng)


@pytest.mark.parametrize("n", [0, 1, 1024])
def test_big_and_empty_batches(shared_store: Any, rng: random.Random, n: int) -> None:
    c = shared_store.client()
    keys = [rng.randbytes(32) for _ in range(n)]
    assert c.put(keys, [b"v"] * n) == [pb.OK] * n
    assert c.exists(keys).prefix == n
    assert c.get(keys) == [bytearray(b"v")] * n
    assert c.remove(keys) == [pb.OK] * n
