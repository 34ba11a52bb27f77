"""Sparse reads (GET_RANGES) against real store nodes: byte-exact ranges, only the ranges on the
wire (the node's ``range_bytes_sent``), per-key INVALID for every broken rule with the stream
still in sync, malformed frames, tenants, a removal during the send, and a node without the
data session."""

from __future__ import annotations

import base64
import random
import socket
from typing import Any

import numpy as np
import pytest

from kvpool.core import errors, ranges
from kvpool.core.checksum import checksum
from kvpool.transfer.testing import RawConnection, tcp_socket
from kvpool.wire import store_frames as dp
from kvpool.wire.counters import StoreCounter
from kvpool.wire.proto import store_pb2 as pb

KiB, MiB = 1 << 10, 1 << 20
TENANTS = [
    {"tenantId": "alpha", "token": "tok-alpha", "salt": base64.b64encode(b"a").decode()},
    {"tenantId": "beta", "token": "tok-beta", "salt": base64.b64encode(b"b").decode()},
]


@pytest.fixture(scope="module")
def nodes(module_stores: Any) -> Any:
    return module_stores.start_many({
        "open": {"dram": "40MiB"},
        "limited": {"dram": "8MiB", "config": {"maxRangesPerKey": 8, "maxRangeBytes": 1 * MiB}},
        "tenants": {"dram": "8MiB", "tenants": TENANTS, "closed": True},
    })


class Raw(RawConnection):
    """A hand-driven data-session connection."""

    def __init__(self, node: Any) -> None:
        super().__init__(tcp_socket(node.transfer_address))

    def get_ranges(self, keys: list[bytes], per_key: list[Any], token: bytes = b"",
                   flags: int = 0) -> tuple[dp.Response, str, dp.RangeTable | None, bytes]:
        """One GET_RANGES exchange: header, message, table and payload."""
        self.rid += 1
        pairs = [np.asarray(p, np.uint64).reshape(-1, 2) for p in per_key]
        counts, blob = ranges.encode(pairs)
        self.send(b"".join(dp.encode_request(dp.OP_GET_RANGES, self.rid, token, b"".join(keys), flags=flags,
                                             ranges=(counts, blob))))
        resp = dp.decode_response(self.recv(dp.RESPONSE_SIZE))
        assert resp.request_id == self.rid and resp.op == dp.OP_GET_RANGES
        msg = self.recv(resp.msg_len).decode() if resp.msg_len else ""
        if resp.status:
            return resp, msg, None, b""
        body = self.recv(resp.body_bytes())
        flat = np.concatenate(pairs) if pairs else np.zeros((0, 2), np.uint64)
        sums = self.recv(8 * len(flat))
        table = dp.decode_range_table(resp, body, sums, counts, flat)
        return resp, msg, table, self.recv(resp.payload_len)

    def hello_ok(self) -> bool:
        self.rid += 1
        self.send(b"".join(dp.encode_request(dp.OP_HELLO, self.rid, dp.HELLO_PADDING, b"")))
        return dp.decode_response(self.recv(dp.RESPONSE_SIZE)).status == 0



def expected(value: bytes, pairs: Any) -> bytes:
    return b"".join(value[o:o + n] for o, n in pairs)


def sent(c: Any) -> int:
    return int(c.stats().counters[StoreCounter.RANGE_BYTES_SENT])


def test_ranges_are_byte_exact_and_only_they_move(nodes: Any, h: Any, rng: random.Random) -> None:
    c = nodes["open"].client()
    keys = h.rand_keys(rng, 3)
    vals = h.rand_values(rng, [4 * MiB, 100_001, 1])
    assert c.put(keys, vals) == [pb.OK] * 3
    big = vals[0]
    # Scattered top-k entries, unordered and overlapping, the last byte, the whole object.
    cases = [
        [(0, 16 * KiB)],
        [(3 * MiB, 16 * KiB), (17, 5), (1 * MiB + 3, 64 * KiB), (17, 5)],
        [(len(big) - 1, 1)],
        [(0, len(big))],
        [(k * 256 * KiB, 16 * KiB) for k in rng.sample(range(16), 8)],
    ]
    for pairs in cases:
        before = sent(c)
        got = c.get_ranges(keys[0], pairs)
        assert got is not None and bytes(got) == expected(big, pairs)
        assert sent(c) - before == sum(n for _, n in pairs)
    # A batch: several keys, each with its ranges, a miss and an INVALID among them.
    missing = h.rand_keys(rng, 1)[0]
    per_key = [[(10, 100), (0, 10)], [(100_000, 1), (0, 1)], [(0, 1)], [(0, 1)], [(0, 2)]]
    bufs = [bytearray(110), bytearray(2), bytearray(1), bytearray(1), bytearray(2)]
    before = sent(c)
    r = c.read_ranges(keys + [missing, keys[2]], per_key, [memoryview(b) for b in bufs])
    assert r.codes == [pb.OK, pb.OK, pb.OK, pb.NOT_FOUND, pb.INVALID]  # 2 bytes of a 1-byte object
    assert r.sizes[:3] == [len(v) for v in vals] and r.sizes[3] == 0 and r.sizes[4] == 1
    assert bytes(bufs[0]) == expected(big, per_key[0]) and bytes(bufs[1]) == expected(vals[1], per_key[1])
    assert bytes(bufs[2]) == vals[2]
    assert sent(c) - before == 110 + 2 + 1
    c.remove(keys)


def test_the_table_checksums_are_those_of_the_bytes_sent(nodes: Any, h: Any, rng: random.Random) -> None:
    node = nodes["open"]
    c = node.client()
    [key] = h.rand_keys(rng, 1)
    value = rng.randbytes(300_000)
    assert c.put([key], [value]) == [pb.OK]
    raw = Raw(node)
    try:
        pairs = [(5, 1000), (200_000, 99_999), (0, 1), (0, len(value))]  # the last: the writer's checksum
        resp, _, table, payload = raw.get_ranges([key], [pairs])
        assert table is not None and list(table.codes) == [pb.OK] and list(table.sizes) == [len(value)]
        assert payload == expected(value, pairs)
        assert table.checksums.tolist() == [checksum(value[o:o + n]) for o, n in pairs]
        # FLAG_VERIFY_OBJECT: the node checks the whole object first (intact here: OK).
        resp, _, table, payload = raw.get_ranges([key], [pairs], flags=dp.FLAG_VERIFY_OBJECT)
        assert table is not None and list(table.codes) == [pb.OK] and payload == expected(value, pairs)
    finally:
        raw.close()
    c.remove([key])


def test_every_broken_rule_is_invalid_per_key_and_the_stream_stays_in_sync(nodes: Any, h: Any,
                                                                          rng: random.Random) -> None:
    node = nodes["limited"]  # maxRangesPerKey 8, maxRangeBytes 1 MiB
    c = node.client()
    keys = h.rand_keys(rng, 2)
    vals = h.rand_values(rng, [1000, 700 * KiB])
    assert c.put(keys, vals) == [pb.OK, pb.OK]
    top = (1 << 64) - 1
    bad = {
        "no ranges": [],
        "zero length": [(0, 10), (5, 0)],
        "past the end": [(990, 11)],
        "offset past the end": [(1001, 1)],
        "wrapping u64": [(top, 2)],
        "huge length": [(1, top)],
        "too many ranges": [(i, 1) for i in range(9)],
    }
    raw = Raw(node)
    try:
        before = sent(c)
        for name, pairs in bad.items():
            resp, _, table, payload = raw.get_ranges([keys[0], keys[0]], [pairs, [(0, 4)]])
            assert table is not None, name
            assert list(table.codes) == [pb.INVALID, pb.OK], name
            assert payload == vals[0][:4], name
            assert table.checksums[:len(pairs)].tolist() == [0] * len(pairs), name
        # The byte budget: keys are admitted in order while they fit 1 MiB; a later small one still fits.
        resp, _, table, payload = raw.get_ranges(keys[1:] * 2 + keys[:1],
                                                 [[(0, 700 * KiB)], [(0, 700 * KiB)], [(0, 8)]])
        assert table is not None and list(table.codes) == [pb.OK, pb.INVALID, pb.OK]
        assert payload == vals[1] + vals[0][:8]
        assert sent(c) - before == 4 * len(bad) + 700 * KiB + 8
        assert raw.hello_ok()  # the same connection, still in sync
    finally:
        raw.close()
    # Through the client: ranges refused before sending, and buffers that are too small.
    refused: list[Any] = [[(-1, 4)], [(0, -4)], [(0, 1.5)], [[1, 2, 3]], "junk"]
    for given in refused:
        with pytest.raises(errors.InvalidArgument):
            c.get_ranges(keys[0], given)
    asked = int(c.stats().counters[StoreCounter.RANGE_READS])
    r = c.read_ranges([keys[0], keys[0], keys[0]], [[(0, 10)], [(-5, 1)], [(0, 10)]],
                      [memoryview(bytearray(9)), memoryview(bytearray(1)), None])
    assert r.codes == [pb.INVALID] * 3
    assert int(c.stats().counters[StoreCounter.RANGE_READS]) == asked  # none of them was asked for
    with pytest.raises(errors.InvalidArgument, match="1000 bytes"):
        c.get_ranges(keys[0], [(999, 2)])
    assert c.get_ranges(h.rand_keys(rng, 1)[0], [(0, 1)]) is None  # a miss
    c.remove(keys)


MALFORMED = {
    "ranges over the frame limit": dp.REQUEST.pack(dp.REQUEST_MAGIC, dp.VERSION, dp.OP_GET_RANGES, 0, 0, 1, 1, 0,
                                                   0, 0, 0, 0) + bytes(32)
    + np.array([dp.MAX_RANGES_PER_FRAME + 1], "<u4").tobytes(),
    "traffic class on a ranged read": dp.REQUEST.pack(dp.REQUEST_MAGIC, dp.VERSION, dp.OP_GET_RANGES, 0, 0, 1, 1,
                                                      0, 0, 3, 0, 0) + b"abc",
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_ranged_frames_close_only_their_connection(nodes: Any, h: Any, rng: random.Random,
                                                             case: str) -> None:
    node = nodes["open"]
    c = node.client()
    [key] = h.rand_keys(rng, 1)
    assert c.put([key], [b"still here"]) == [pb.OK]
    other, bad = Raw(node), Raw(node)
    try:
        assert other.hello_ok()
        bad.send(MALFORMED[case])
        assert bad.closed_by_peer()
        assert other.hello_ok()
    finally:
        bad.close()
        other.close()
    assert bytes(c.get_ranges(key, [(6, 4)]) or b"") == b"here"
    assert node.alive()
    c.remove([key])


def test_truncated_ranged_frames_never_wedge_the_node(nodes: Any, h: Any, rng: random.Random) -> None:
    node = nodes["open"]
    keys = h.rand_keys(rng, 2)
    counts, blob = ranges.encode([np.array([[0, 1], [2, 3]], np.uint64), np.array([[0, 1]], np.uint64)])
    frame = b"".join(dp.encode_request(dp.OP_GET_RANGES, 1, b"", b"".join(keys), ranges=(counts, blob)))
    for cut in sorted({1, dp.REQUEST_SIZE, dp.REQUEST_SIZE + 64, dp.REQUEST_SIZE + 66, len(frame) - 17,
                       len(frame) - 1}):
        raw = Raw(node)
        raw.send(frame[:cut])
        raw.sock.shutdown(socket.SHUT_WR)
        assert raw.closed_by_peer()
        raw.close()
    c = node.client()
    assert c.put(keys[:1], [b"ok!"]) == [pb.OK] and bytes(c.get_ranges(keys[0], [(1, 2)]) or b"") == b"k!"
    c.remove(keys[:1])


def test_tenants_see_only_their_own_objects(nodes: Any, h: Any, rng: random.Random) -> None:
    node = nodes["tenants"]
    a, b = node.client("tok-alpha"), node.client("tok-beta")
    [key] = h.rand_keys(rng, 1)
    assert a.put([key], [b"alpha bytes"]) == [pb.OK]
    assert bytes(a.get_ranges(key, [(6, 5)]) or b"") == b"bytes"
    assert b.get_ranges(key, [(0, 5)]) is None  # another tenant's key is a miss
    raw = Raw(node)
    try:
        resp, msg, table, _ = raw.get_ranges([key], [[(0, 5)]], token=b"wrong")
        assert resp.status == errors.SESSION_STATUS[errors.Unauthenticated] and table is None
        assert "token" in msg
        resp, _, table, payload = raw.get_ranges([key], [[(0, 5)]], token=b"tok-alpha")  # still in sync
        assert table is not None and payload == b"alpha"
    finally:
        raw.close()
    a.remove([key])


def test_a_removal_during_the_send_succeeds_and_the_ranges_stay_whole(nodes: Any, h: Any,
                                                                     rng: random.Random) -> None:
    """As for GET: the object is in flight, not pinned, while its ranges are on the wire."""
    node = nodes["open"]
    c = node.client()
    [key] = h.rand_keys(rng, 1)
    value = rng.randbytes(16 * MiB)
    used0 = h.stats_tier(c.stats(), "dram").used_bytes
    assert c.put([key], [value]) == [pb.OK]
    pairs = [(1 * MiB, 6 * MiB), (9 * MiB, 6 * MiB)]
    raw = Raw(node)
    try:
        counts, blob = ranges.encode([np.array(pairs, np.uint64)])
        raw.send(b"".join(dp.encode_request(dp.OP_GET_RANGES, 1, b"", key, ranges=(counts, blob))))
        head = raw.recv(dp.RESPONSE_SIZE)  # 12 MiB cannot sit in the socket buffers: still sending
        assert c.remove([key]) == [pb.OK]
        assert c.get_ranges(key, [(0, 1)]) is None
        resp = dp.decode_response(head)
        body, sums = raw.recv(resp.body_bytes()), raw.recv(16)
        table = dp.decode_range_table(resp, body, sums, counts, np.array(pairs, np.uint64))
        assert list(table.codes) == [pb.OK]
        assert raw.recv(resp.payload_len) == expected(value, pairs)
    finally:
        raw.close()
    h.wait_for(lambda: h.stats_tier(c.stats(), "dram").used_bytes == used0, what="the extent to be freed")

