"""The client↔sidecar fast-session frames, without sockets: round trips and every refusal."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from kvpool.wire import sidecar_frames as fp
from kvpool.wire.store_frames import MAX_OBJECT_BYTES

KEYS = bytes(range(32)) + bytes(range(32, 64))


def _request(frame: list[bytes]) -> tuple[fp.Request, fp.RequestBody]:
    blob = b"".join(frame)
    req = fp.decode_request(blob[:fp.REQUEST_SIZE])
    return req, fp.decode_request_body(req, blob[fp.REQUEST_SIZE:])


def test_requests_round_trip() -> None:
    req, body = _request(fp.encode_request(fp.OP_READ, 7, keys=KEYS, kind=1, lease_ms=500, ref=99,
                                           releases=[3, 4]))
    assert (req.op, req.request_id, req.items, req.kind, req.lease_ms, req.ref) == (fp.OP_READ, 7, 2, 1, 500, 99)
    assert body.keys == KEYS and body.releases == [3, 4] and body.values is None
    req, body = _request(fp.encode_request(fp.OP_WRITE_START, 8, keys=KEYS, text=b"batch", values=[10, 1 << 33]))
    assert body.text == "batch" and body.values is not None and body.values.tolist() == [10, 1 << 33]
    req, body = _request(fp.encode_request(fp.OP_WRITE_COMMIT, 9, ref=5, values=[1, 2, 3]))
    assert req.items == 3 and req.ref == 5 and body.keys == b"" and body.values.tolist() == [1, 2, 3]
    # Put with wait: the commit carries how long to wait for the pool.
    req, body = _request(fp.encode_request(fp.OP_WRITE_COMMIT, 9, ref=5, values=[1], flags=fp.FLAG_POOL_WAIT,
                                           lease_ms=2500))
    assert req.flags == fp.FLAG_POOL_WAIT and req.lease_ms == 2500 and body.values.tolist() == [1]
    req, body = _request(fp.encode_request(fp.OP_RELEASE, 10, releases=[1, 2], flags=fp.FLAG_NO_REPLY))
    assert req.items == 0 and body.releases == [1, 2]
    req, body = _request(fp.encode_request(fp.OP_HELLO, 11, text="tenant-é".encode()))
    assert body.text == "tenant-é"


def test_responses_and_tables_round_trip() -> None:
    head = fp.encode_response(fp.OP_READ, 3, 2, prefix=1, local=1, ref=77)
    resp = fp.decode_response(head)
    assert (resp.op, resp.request_id, resp.items, resp.prefix, resp.local, resp.ref) == (fp.OP_READ, 3, 2, 1, 1, 77)
    table = fp.decode_table(resp, fp.encode_table([0, 5], [4096, 0], [100, 0]), arena_bytes=1 << 20)
    assert table == fp.Table([0, 5], [4096, 0], [100, 0])
    resp = fp.decode_response(fp.encode_response(fp.OP_WRITE_COMMIT, 4, 2))
    assert fp.decode_table(resp, fp.encode_table([0, 6]), 1).codes == [0, 6]
    err = fp.encode_response(fp.OP_MATCH, 5, 2, status=3, message="no")
    resp = fp.decode_response(err[:fp.RESPONSE_SIZE])
    assert resp.status == 3 and resp.msg_len == 2 and resp.body_bytes() == 0 and err[fp.RESPONSE_SIZE:] == b"no"


def _header(**over: int) -> bytes:
    f = {"magic": fp.REQUEST_MAGIC, "version": fp.VERSION, "op": fp.OP_READ, "kind": 0, "flags": 0, "rid": 1,
         "count": 1, "lease_ms": 0, "tlen": 0, "nrel": 0, "ref": 0}
    f.update(over)
    return fp.REQUEST.pack(*f.values())


@pytest.mark.parametrize("over, why", [
    ({"magic": b"KVDQ"}, "magic"), ({"version": 9}, "version"), ({"op": 0}, "unknown"), ({"op": 200}, "unknown"),
    ({"count": fp.MAX_KEYS + 1}, "at most"), ({"tlen": fp.MAX_TEXT_BYTES + 1}, "limit"),
    ({"nrel": fp.MAX_RELEASES + 1}, "limit"), ({"op": fp.OP_HELLO, "count": 1}, "no items"),
    ({"op": fp.OP_RELEASE, "count": 2}, "no items"), ({"flags": fp.FLAG_NO_REPLY}, "without a reply"),
    ({"flags": fp.FLAG_POOL_WAIT}, "wait for the pool"),
])
def test_malformed_request_headers_are_refused(over: dict[str, int], why: str) -> None:
    with pytest.raises(fp.ProtocolError, match=why):
        fp.decode_request(_header(**over))
    with pytest.raises(fp.ProtocolError):
        fp.decode_request(_header(**over)[:-1])  # and a short header, whatever it says


def test_malformed_bodies_are_refused() -> None:
    req = fp.decode_request(_header(count=2))
    with pytest.raises(fp.ProtocolError, match="expected 64"):
        fp.decode_request_body(req, b"\0" * 63)
    req = fp.decode_request(_header(op=fp.OP_HELLO, count=0, tlen=2))
    with pytest.raises(fp.ProtocolError, match="UTF-8"):
        fp.decode_request_body(req, b"\xff\xfe")
    req = fp.decode_request(_header(op=fp.OP_WRITE_START, count=1))
    with pytest.raises(fp.ProtocolError, match="size over"):
        fp.decode_request_body(req, b"\0" * 32 + struct.pack("<Q", (1 << 40) + 1))


def test_malformed_responses_and_tables_are_refused() -> None:
    good = fp.encode_response(fp.OP_READ, 1, 1)
    for bad in (b"KVFQ" + good[4:], good[:4] + b"\x09" + good[5:], good[:5] + b"\x63" + good[6:], good[:-1]):
        with pytest.raises(fp.ProtocolError):
            fp.decode_response(bad)
    resp = fp.decode_response(good)
    with pytest.raises(fp.ProtocolError, match="table"):
        fp.decode_table(resp, b"\0" * 16, 1 << 20)
    # An extent past the end of the arena would make the client read bytes of no object.
    with pytest.raises(fp.ProtocolError, match="outside the arena"):
        fp.decode_table(resp, fp.encode_table([0], [1 << 20], [1]), arena_bytes=1 << 20)
    with pytest.raises(fp.ProtocolError, match="outside the arena"):
        fp.decode_table(resp, fp.encode_table([0], [0], [np.uint64(1 << 63)]), arena_bytes=1 << 20)


def test_encoder_refuses_what_the_decoder_would() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        fp.encode_request(fp.OP_MATCH, 1, keys=b"\0" * 33)
    with pytest.raises(ValueError, match="one size"):
        fp.encode_request(fp.OP_WRITE_START, 1, keys=KEYS, values=[1])
    with pytest.raises(ValueError, match="too long"):
        fp.encode_request(fp.OP_RELEASE, 1, releases=list(range(fp.MAX_RELEASES + 1)))


def test_registered_memory_frames_round_trip() -> None:
    req, body = _request(fp.encode_request(fp.OP_REGISTER, 12, ref=1 << 40))
    assert (req.op, req.items, req.ref, req.body_bytes()) == (fp.OP_REGISTER, 0, 1 << 40, 0)
    targets = [3, 4, 0, 1 << 33, 100, 7]  # region ids, offsets, lengths of two keys
    req, body = _request(fp.encode_request(fp.OP_READ_INTO, 13, keys=KEYS, kind=1, ref=55, values=targets))
    assert (req.items, req.ref, req.body_bytes()) == (2, 55, 2 * (32 + 24))
    assert body.keys == KEYS and body.values is not None and body.values.tolist() == targets
    resp = fp.decode_response(fp.encode_response(fp.OP_READ_INTO, 13, 2, prefix=1, local=1))
    assert resp.body_bytes() == 18
    assert fp.decode_sizes(resp, fp.encode_table([0, 5], [1 << 20, 0])) == ([0, 5], [1 << 20, 0])
    with pytest.raises(fp.ProtocolError, match="table"):
        fp.decode_sizes(resp, b"\0" * 17)


def test_registered_memory_frames_are_refused_when_malformed() -> None:
    with pytest.raises(fp.ProtocolError, match="no items"):
        fp.decode_request(_header(op=fp.OP_REGISTER, count=1))
    req = fp.decode_request(_header(op=fp.OP_READ_INTO, count=2))
    with pytest.raises(fp.ProtocolError, match="expected 112"):
        fp.decode_request_body(req, b"\0" * (2 * 32 + 2 * 8))  # keys and one column, not three
    with pytest.raises(ValueError, match="READ_INTO one"):
        fp.encode_request(fp.OP_READ_INTO, 1, keys=KEYS, values=[1, 2, 3])  # one key's targets for two


def test_hello_names_the_sidecar_life_and_its_arena() -> None:
    blob = fp.encode_hello(3, incarnation=(1 << 62) + 5, generation=77, arena_bytes=1 << 30)
    resp = fp.decode_response(blob[:fp.RESPONSE_SIZE])
    assert resp.flags & fp.FLAG_IDENTITY and resp.body_bytes() == fp.IDENTITY.size
    assert fp.decode_hello(resp, blob[fp.RESPONSE_SIZE:]) == ((1 << 62) + 5, 77, 1 << 30)
    # A reply that does not name them is no sidecar's (every one does): the stream is not trusted.
    anonymous = fp.decode_response(fp.encode_response(fp.OP_HELLO, 3))
    with pytest.raises(fp.ProtocolError, match="identity"):
        fp.decode_hello(anonymous, b"")
    # A refused HELLO has no body whatever its flags.
    refused = fp.decode_response(fp.encode_response(fp.OP_HELLO, 3, status=4, flags=fp.FLAG_IDENTITY))
    assert refused.body_bytes() == 0


def test_no_space_rows_carry_sizes_not_extents() -> None:
    """A READ's NO_SPACE row names no extent, only the size of an object the arena had no room
    for (it may be larger than the arena); an OK row is still bounded by the arena, and no size
    passes the protocol's object limit."""
    resp = fp.decode_response(fp.encode_response(fp.OP_READ, 1, 2))
    table = fp.decode_table(resp, fp.encode_table([0, 3], [0, 0], [4096, 3 << 20]), arena_bytes=1 << 20)
    assert table == fp.Table([0, 3], [0, 0], [4096, 3 << 20])
    with pytest.raises(fp.ProtocolError, match="outside the arena"):
        fp.decode_table(resp, fp.encode_table([0, 3], [0, 0], [3 << 20, 4096]), arena_bytes=1 << 20)
    with pytest.raises(fp.ProtocolError, match="object size"):
        fp.decode_table(resp, fp.encode_table([0, 3], [0, 0], [1, MAX_OBJECT_BYTES + 1]), arena_bytes=1 << 20)
    req, _ = _request(fp.encode_request(fp.OP_READ_INTO, 2, keys=KEYS, values=[1, 1, 0, 64, 8, 8],
                                        flags=fp.FLAG_TRANSIENT))
    assert req.flags == fp.FLAG_TRANSIENT


def test_write_from_frames_round_trip() -> None:
    targets = [3, 4, 0, 1 << 33, 100, 7]  # region ids, offsets, lengths of two keys
    req, body = _request(fp.encode_request(fp.OP_WRITE_FROM, 14, keys=KEYS, text=b"batch",
                                           values=targets + [11, 12], flags=fp.FLAG_TRANSIENT))
    assert (req.items, req.body_bytes()) == (2, 5 + 2 * (32 + 32))
    assert body.text == "batch" and body.values is not None and body.values.tolist() == targets + [11, 12]
    resp = fp.decode_response(fp.encode_response(fp.OP_WRITE_FROM, 14, 2))
    assert fp.decode_table(resp, fp.encode_table([0, 2]), 1).codes == [0, 2]
    with pytest.raises(ValueError, match="WRITE_FROM"):
        fp.encode_request(fp.OP_WRITE_FROM, 1, keys=KEYS, values=targets)  # no checksums
