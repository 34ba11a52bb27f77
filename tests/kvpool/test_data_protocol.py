"""The data-session frames (kvpool.wire.store_frames) and their error statuses, without sockets."""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest

from kvpool.core import errors
from kvpool.pool.data_client import split_parts
from kvpool.transfer import protocol as transfer_protocol
from kvpool.wire import store_frames as dp
from kvpool.wire.proto import store_pb2 as pb


def _keys(n: int, seed: int = 1) -> bytes:
    return random.Random(seed).randbytes(32 * n)


def _decode_whole(frame: list[bytes]) -> tuple[dp.Request, dp.RequestBody]:
    blob = b"".join(frame)
    req = dp.decode_request(blob[:dp.REQUEST_SIZE])
    return req, dp.decode_request_body(req, blob[dp.REQUEST_SIZE:])


def test_request_round_trips() -> None:
    keys = _keys(3)
    sizes = np.array([1, 2 << 20, 77], np.uint64)
    frame = dp.encode_request(dp.OP_PUT, 9, b"tok", keys, kind=pb.STATE, flags=0, lease_ms=1500, lease_id=2**63,
                              epoch=4, traffic_class=b"agent", sizes=sizes)
    req, body = _decode_whole(frame)
    assert (req.op, req.request_id, req.kind, req.items, req.lease_ms, req.lease_id, req.epoch) == (
        dp.OP_PUT, 9, pb.STATE, 3, 1500, 2**63, 4)
    assert (body.token, body.traffic_class, body.keys) == ("tok", "agent", keys)
    assert body.sizes is not None and body.sizes.tolist() == sizes.tolist()
    sums = [2**64 - 1, 0, 12345]
    assert dp.decode_checksums(dp.encode_checksums(sums), 3) == sums  # the PUT trailer
    with pytest.raises(dp.ProtocolError):
        dp.decode_checksums(dp.encode_checksums(sums), 2)
    req, body = _decode_whole(dp.encode_request(dp.OP_EXISTS, 1, b"", _keys(8192),
                                                flags=dp.FLAG_PIN | dp.FLAG_PREFIX_ONLY))
    assert req.items == 8192 and req.flags == 3 and body.sizes is None and len(body.keys) == 8192 * 32
    req, body = _decode_whole(dp.encode_request(dp.OP_GET, 2, b"", b""))
    assert req.items == 0 and body.keys == b""
    moved = dp.with_request_id(b"".join(dp.encode_request(dp.OP_GET, 5, b"t", keys))[:dp.REQUEST_SIZE], 77)
    assert dp.decode_request(moved).request_id == 77


def test_hello_is_as_long_as_a_transfer_header() -> None:
    """So that a node without the session reads a whole transfer header and closes at once."""
    frame = b"".join(dp.encode_request(dp.OP_HELLO, 1, dp.HELLO_PADDING, b""))
    assert len(frame) >= transfer_protocol.REQUEST_SIZE
    with pytest.raises(transfer_protocol.ProtocolError):
        transfer_protocol.decode_request(frame[:transfer_protocol.REQUEST_SIZE])


def _header(**over: int) -> bytes:
    f = {"version": dp.VERSION, "op": dp.OP_GET, "kind": 0, "flags": 0, "rid": 1, "count": 1, "lease_ms": 0,
         "tlen": 0, "clen": 0, "lease_id": 0, "epoch": 0, **over}
    return dp.REQUEST.pack(dp.REQUEST_MAGIC, f["version"], f["op"], f["kind"], f["flags"], f["rid"], f["count"],
                           f["lease_ms"], f["tlen"], f["clen"], f["lease_id"], f["epoch"])


@pytest.mark.parametrize("bad", [
    b"XXXX" + _header()[4:], _header(version=2), _header(op=0), _header(op=9), _header(count=dp.MAX_KEYS + 1),
    _header(tlen=dp.MAX_TOKEN_BYTES + 1), _header(clen=dp.MAX_CLASS_BYTES + 1), _header(op=dp.OP_HELLO, count=1),
    _header()[:-1], _header() + b"x",
])
def test_malformed_request_headers_are_protocol_errors(bad: bytes) -> None:
    with pytest.raises(dp.ProtocolError):
        dp.decode_request(bad)


def test_malformed_request_bodies_are_protocol_errors() -> None:
    req = dp.decode_request(_header(tlen=2))
    with pytest.raises(dp.ProtocolError):
        dp.decode_request_body(req, b"\xff\xfe" + bytes(32))  # token not UTF-8
    with pytest.raises(dp.ProtocolError):
        dp.decode_request_body(req, bytes(33))  # one byte short
    put = dp.decode_request(_header(op=dp.OP_PUT))
    with pytest.raises(dp.ProtocolError):
        dp.decode_request_body(put, bytes(32) + struct.pack("<Q", dp.MAX_OBJECT_BYTES + 1))


def test_encoder_refuses_what_the_decoder_would() -> None:
    with pytest.raises(ValueError):
        dp.encode_request(dp.OP_GET, 1, b"", b"x" * 33)
    with pytest.raises(ValueError):
        dp.encode_request(dp.OP_PUT, 1, b"", _keys(2), sizes=np.zeros(1, np.uint64))
    with pytest.raises(ValueError):
        dp.encode_request(dp.OP_GET, 1, b"t" * (dp.MAX_TOKEN_BYTES + 1), b"")


def test_get_response_and_table() -> None:
    codes = np.array([pb.OK, pb.NOT_FOUND, pb.OK], np.uint8)
    sizes = np.array([10, 0, 5], np.uint64)
    sums = np.array([1, 0, 2**64 - 2], np.uint64)
    head = dp.encode_response(dp.OP_GET, 3, 3, epoch=7, payload_len=15)
    resp = dp.decode_response(head)
    assert (resp.op, resp.request_id, resp.items, resp.epoch, resp.payload_len) == (dp.OP_GET, 3, 3, 7, 15)
    assert resp.body_bytes() == 3 * 17
    table = dp.decode_get_table(resp, dp.encode_get_table(codes, sizes, sums))
    assert table.codes.tolist() == codes.tolist() and table.sizes.tolist() == [10, 0, 5]
    assert table.checksums.tolist() == sums.tolist()
    # The payload length must be exactly the OK items' sizes, and misses carry no size.
    for lying in (dp.encode_response(dp.OP_GET, 3, 3, payload_len=14), dp.encode_response(dp.OP_GET, 3, 3)):
        with pytest.raises(dp.ProtocolError):
            dp.decode_get_table(dp.decode_response(lying), dp.encode_get_table(codes, sizes, sums))
    with pytest.raises(dp.ProtocolError):
        dp.decode_get_table(resp, dp.encode_get_table(codes, np.array([10, 1, 4], np.uint64), sums))


def test_error_response_has_a_message_and_no_body() -> None:
    status = errors.session_status_for(errors.Unauthenticated("bad token"))
    head = dp.encode_response(dp.OP_GET, 1, 4, status=status, message="bad token")
    resp = dp.decode_response(head[:dp.RESPONSE_SIZE])
    assert resp.status == status and head[dp.RESPONSE_SIZE:] == b"bad token" and resp.body_bytes() == 0
    long = dp.encode_response(dp.OP_GET, 1, status=1, message="x" * 5000)
    assert len(long) == dp.RESPONSE_SIZE + dp.MAX_MESSAGE_BYTES


@pytest.mark.parametrize("bad", [
    b"KVDX" + dp.encode_response(dp.OP_GET, 1)[4:],
    dp.RESPONSE.pack(dp.RESPONSE_MAGIC, 9, 2, 0, 0, 1, 0, 0, 0, 0, 0, 0),
    dp.RESPONSE.pack(dp.RESPONSE_MAGIC, dp.VERSION, 42, 0, 0, 1, 0, 0, 0, 0, 0, 0),
    dp.RESPONSE.pack(dp.RESPONSE_MAGIC, dp.VERSION, dp.OP_EXISTS, 0, 0, 1, 3, 0, 4, 0, 0, 0),  # prefix > count
    dp.RESPONSE.pack(dp.RESPONSE_MAGIC, dp.VERSION, dp.OP_EXISTS, 0, 0, 1, 3, 0, 0, 0, 0, 9),  # payload on EXISTS
    dp.RESPONSE.pack(dp.RESPONSE_MAGIC, dp.VERSION, dp.OP_GET, 1, 0, 1, 3, 0, 0, 0, 0, 9),  # payload on an error
    dp.RESPONSE.pack(dp.RESPONSE_MAGIC, dp.VERSION, dp.OP_GET, 0, 0, 1, 3, dp.MAX_MESSAGE_BYTES + 1, 0, 0, 0, 0),
])
def test_malformed_responses_are_protocol_errors(bad: bytes) -> None:
    with pytest.raises(dp.ProtocolError):
        dp.decode_response(bad)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 8192, 8193])
def test_bitmap_round_trip(n: int) -> None:
    rng = np.random.default_rng(n)
    present = rng.integers(0, 2, n).astype(np.uint8)
    blob = dp.encode_bitmap(present.tobytes())
    assert len(blob) == (n + 7) // 8
    assert dp.decode_bitmap(blob, n).tolist() == present.astype(bool).tolist()
    with pytest.raises(dp.ProtocolError):
        dp.decode_bitmap(blob + b"\x00", n)


def test_codes_body() -> None:
    resp = dp.decode_response(dp.encode_response(dp.OP_PUT_DONE, 1, 2))
    assert dp.decode_codes(resp, bytes([pb.OK, pb.QUOTA_EXCEEDED])) == [pb.OK, pb.QUOTA_EXCEEDED]
    with pytest.raises(dp.ProtocolError):
        dp.decode_codes(resp, b"\x00")


def test_session_statuses_map_onto_the_error_tree() -> None:
    assert errors.SESSION_OK == 0 and errors.SESSION_OK not in errors.SESSION_STATUS.values()
    for cls, status in errors.SESSION_STATUS.items():
        assert type(errors.from_session_status(status, "m")) is cls
        assert errors.session_status_for(cls("m")) == status
    # Subclasses that are not listed map to their nearest listed ancestor; unknown statuses
    # are the base error, never success.
    assert errors.session_status_for(errors.ChecksumMismatch()) == errors.SESSION_STATUS[errors.KvpoolError]
    assert type(errors.from_session_status(250)) is errors.KvpoolError


@pytest.mark.parametrize("n,parts", [(0, 2), (1, 2), (2, 2), (3, 2), (16, 2), (16, 3), (5, 8)])
def test_split_parts_cover_every_index_once(n: int, parts: int) -> None:
    got = split_parts(n, parts)
    assert [i for r in got for i in r] == list(range(n))
    assert all(len(r) for r in got) and len(got) <= max(1, parts)
    assert max(map(len, got), default=0) - min(map(len, got), default=0) <= 1

