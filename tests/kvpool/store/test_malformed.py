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
        (s.Remove, pb.RemoveRequest(keys=b"z" * 1)),
        (s.Remove, pb.RemoveRequest(keys=b"x" * 33)),
        (s.Remove, pb.RemoveRequest(keys=k2, kind=7)),  # type: ignore[arg-type]
        (shared_store.admin_stub().SetRing,
         pb.Ring(epoch=1, members=[pb.RingMember(id="x", address="a:1", state="zombie")])),
    ]
    for fn, req in cases:
        assert _code(fn, req) == BAD, (fn, req)
    # Garbage lease ids are ignored; an empty batch is an empty answer.
    s.Release(pb.ReleaseRequest(lease_ids=[0, 1, 2**64 - 1]), timeout=10)
    assert list(s.Remove(pb.RemoveRequest(keys=b""), timeout=10).codes) == []
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
    """The transfer port serves the data session only: a transfer-engine request for the node's
    memory names no segment it exposes, whatever its offset and token, and is refused."""
    addr = shared_store.transfer_address
    c = shared_store.client()
    key, val = rng.randbytes(32), rng.randbytes(8 * KiB)
    assert c.put([key], [val]) == [pb.OK]
    seg, off, tok = b"dram", 0, rng.getrandbits(64)
    # Per-request refusals keep the connection: no such segment, out of bounds, huge offsets.
    sock = _raw(addr)
    with sock:
        for op, segname, o, n, t in [(OP_READ, seg, off, 8 * KiB, tok),
                                     (OP_READ, seg, 2**63, 10, tok),
                                     (OP_READ, b"nope", 0, 10, tok),
                                     (OP_READ, seg, off, 64 * KiB * 1024, tok),
                                     (OP_WRITE, seg, off, 4, tok)]:
            sock.sendall(encode_request(op, 1, segname, o, n, t) + (b"abcd" if op == OP_WRITE else b""))
            assert _response_code(sock) != 0
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
    assert c.get([key]) == [bytearray(val)]
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
