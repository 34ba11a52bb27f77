"""Range rules of sparse reads (kvpool.core.ranges) and the GET_RANGES frames, without sockets."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvpool.core import errors, ranges
from kvpool.wire import grpc_status
from kvpool.wire import store_frames as dp
from kvpool.wire.proto import store_pb2 as pb

TOP = (1 << 64) - 1


def _pairs(*p: tuple[int, int]) -> ranges.Pairs:
    return np.array(p, np.uint64).reshape(-1, 2)


@pytest.mark.parametrize("given", [[(0, 1)], ((5, 6), (0, 1)), np.array([[1, 2]], np.int32),
                                   np.array([[TOP, TOP]], np.uint64)])
def test_normalize_accepts_integer_pairs(given: object) -> None:
    arr, why = ranges.normalize(given)
    assert why == "" and arr.dtype == np.uint64 and arr.shape == (len(np.asarray(given)), 2)
    assert arr.tolist() == np.asarray(given).astype(np.uint64).tolist()


@pytest.mark.parametrize("given,reason", [
    ([], "no ranges"), ([(-1, 4)], "negative"), ([(0, -1)], "negative"), ([(0, 1.5)], "integers"),
    ([(1, 2, 3)], "pairs"), ([1, 2], "pairs"), ("junk", "pairs"), ([(0, 1), (2,)], "pairs"),
    ([("a", "b")], "integers"),
])
def test_normalize_refuses_what_cannot_be_sent(given: object, reason: str) -> None:
    arr, why = ranges.normalize(given)
    assert reason in why and len(arr) == 0


@pytest.mark.parametrize("pairs,size,reason", [
    (_pairs(), 10, "no ranges"),
    (_pairs((0, 0)), 10, "zero-length"),
    (_pairs((0, 10), (10, 1)), 10, "outside"),
    (_pairs((11, 0)), 10, "zero-length"),
    (_pairs((11, 1)), 10, "outside"),
    (_pairs((TOP, 2)), 10, "outside"),
    (_pairs((1, TOP)), 10, "outside"),
    (_pairs((TOP, TOP)), TOP, "outside"),
    (_pairs(*[(0, 1)] * 5), 10, "5 ranges"),
])
def test_check_names_the_broken_rule(pairs: ranges.Pairs, size: int, reason: str) -> None:
    assert reason in ranges.check(pairs, size, max_ranges=4)


@pytest.mark.parametrize("pairs,size", [
    (_pairs((0, 10)), 10), (_pairs((9, 1)), 10), (_pairs((3, 4), (0, 1), (3, 4)), 10),
    (_pairs((TOP - 1, 1)), TOP), (_pairs(*[(0, 1)] * 4), 1),
])
def test_check_accepts_ranges_inside_the_object(pairs: ranges.Pairs, size: int) -> None:
    assert ranges.check(pairs, size, max_ranges=4) == ""


def test_check_agrees_with_python_integers() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        size = rng.choice([0, 1, 100, 1 << 40, TOP])
        pairs = [(rng.choice([0, 1, size, size - 1 if size else 0, rng.randrange(TOP)]),
                  rng.choice([0, 1, size, rng.randrange(TOP)])) for _ in range(rng.randint(1, 3))]
        ok = all(n >= 1 and o + n <= size for o, n in pairs)
        assert (ranges.check(_pairs(*pairs), size) == "") == ok, (pairs, size)


def test_plan_keeps_lookup_codes_and_admits_bytes_in_order() -> None:
    per_key = [_pairs((0, 60)), _pairs((0, 50)), _pairs((0, 40)), _pairs((0, 0)), _pairs((0, 5)), _pairs((0, 1))]
    codes = ranges.plan([pb.OK, pb.OK, pb.OK, pb.OK, pb.NOT_FOUND, pb.OK], [100, 100, 100, 100, 0, 100], per_key,
                        max_bytes=100)
    # 60 fits, 50 would exceed the budget (INVALID), 40 still fits, zero length is INVALID on its
    # own, the miss stays a miss, and the budget is spent: 1 more byte is INVALID.
    assert codes == [pb.OK, pb.INVALID, pb.OK, pb.INVALID, pb.NOT_FOUND, pb.INVALID]
    assert ranges.plan([pb.OK], [10], [_pairs(*[(0, 1)] * 3)], max_ranges=2) == [pb.INVALID]


def test_layout_helpers() -> None:
    p = _pairs((10, 3), (0, 5), (7, 1))
    assert ranges.starts(p).tolist() == [0, 3, 8] and ranges.total_bytes(p) == 9
    assert ranges.starts(_pairs()).tolist() == [] and ranges.total_bytes(_pairs()) == 0
    flat = np.concatenate([p, _pairs((1, 1))])
    parts = ranges.split([3, 0, 1], flat)
    assert [x.tolist() for x in parts] == [p.tolist(), [], [[1, 1]]]
    with pytest.raises(ValueError):
        ranges.split([2], flat)
    counts, blob = ranges.encode([p, _pairs(), _pairs((1, 1))])
    assert counts.tolist() == [3, 0, 1] and ranges.decode(counts, blob).tolist() == flat.tolist()
    with pytest.raises(ValueError):
        ranges.decode(counts, blob[:-1])


def _frame(keys: bytes, per_key: list[ranges.Pairs], **kw: object) -> list[bytes]:
    return dp.encode_request(dp.OP_GET_RANGES, 5, b"tok", keys, ranges=ranges.encode(per_key), **kw)  # type: ignore[arg-type]


def test_get_ranges_request_round_trips() -> None:
    keys = random.Random(1).randbytes(64)
    per_key = [_pairs((1, 2), (TOP, 4)), _pairs((0, 9))]
    blob = b"".join(_frame(keys, per_key, flags=dp.FLAG_VERIFY_OBJECT, lease_id=7, kind=pb.STATE))
    req = dp.decode_request(blob[:dp.REQUEST_SIZE])
    assert (req.op, req.items, req.flags, req.lease_id, req.kind) == (dp.OP_GET_RANGES, 2, dp.FLAG_VERIFY_OBJECT,
                                                                      7, pb.STATE)
    end = dp.REQUEST_SIZE + req.body_bytes()
    body = dp.decode_request_body(req, blob[dp.REQUEST_SIZE:end])
    assert body.token == "tok" and body.keys == keys and body.counts is not None
    assert body.counts.tolist() == [2, 1] and dp.ranges_bytes(body) == 48 == len(blob) - end
    assert ranges.decode(body.counts, blob[end:]).tolist() == np.concatenate(per_key).tolist()


def test_get_ranges_frame_limits() -> None:
    with pytest.raises(ValueError):
        dp.encode_request(dp.OP_GET_RANGES, 1, b"", bytes(32))  # no counts
    with pytest.raises(ValueError):
        dp.encode_request(dp.OP_GET_RANGES, 1, b"", bytes(32), ranges=(np.array([2], np.uint32), bytes(16)))
    head = dp.REQUEST.pack(dp.REQUEST_MAGIC, dp.VERSION, dp.OP_GET_RANGES, 0, 0, 1, 1, 0, 0, 0, 0, 0)
    req = dp.decode_request(head)
    body = dp.decode_request_body(req, bytes(32) + np.array([dp.MAX_RANGES_PER_FRAME + 1], "<u4").tobytes())
    with pytest.raises(dp.ProtocolError, match="ranges in one frame"):
        dp.ranges_bytes(body)
    with pytest.raises(dp.ProtocolError, match="traffic class"):
        dp.decode_request(dp.REQUEST.pack(dp.REQUEST_MAGIC, dp.VERSION, dp.OP_GET_RANGES, 0, 0, 1, 1, 0, 0, 2, 0, 0))


def test_range_table_round_trips_and_must_match_the_request() -> None:
    counts = np.array([2, 1, 1], np.uint32)
    flat = np.concatenate([_pairs((0, 10), (5, 5)), _pairs((0, 3)), _pairs((1, 7))])
    codes, sizes, sums = [pb.OK, pb.NOT_FOUND, pb.OK], [100, 0, 8], [11, 12, 0, 14]
    table = dp.encode_range_table(codes, sizes, sums)
    head = dp.encode_response(dp.OP_GET_RANGES, 3, 3, payload_len=22)
    resp = dp.decode_response(head)
    assert resp.body_bytes() == 27 and len(table) == 27 + 32
    t = dp.decode_range_table(resp, table[:27], table[27:], counts, flat)
    assert (t.codes.tolist(), t.sizes.tolist(), t.checksums.tolist()) == (codes, sizes, sums)
    for bad_len in (21, 25):  # a payload that is not the OK keys' ranges is a broken stream
        with pytest.raises(dp.ProtocolError, match="payload"):
            dp.decode_range_table(dp.decode_response(dp.encode_response(dp.OP_GET_RANGES, 3, 3, payload_len=bad_len)),
                                  table[:27], table[27:], counts, flat)
    with pytest.raises(dp.ProtocolError):
        dp.decode_range_table(resp, table[:27], table[27:-8], counts, flat)
    with pytest.raises(dp.ProtocolError):
        dp.decode_range_table(resp, table[:26], table[27:], counts, flat)
    with pytest.raises(dp.ProtocolError):  # payload on an error status
        dp.decode_response(dp.encode_response(dp.OP_GET_RANGES, 3, 3, status=2, payload_len=1))


def test_unsupported_maps_through_every_form() -> None:
    exc = errors.error_for_code(pb.UNSUPPORTED)
    assert isinstance(exc, errors.Unsupported)
    assert isinstance(errors.from_session_status(errors.session_status_for(exc)), errors.Unsupported)
    assert grpc_status.grpc_status_for(exc).name == "UNIMPLEMENTED"


def test_coalesce_merges_abutting_runs_and_keeps_the_layout() -> None:
    rng = random.Random(3)
    value = bytes(rng.randrange(256) for _ in range(4096))
    for _ in range(300):
        pairs: list[tuple[int, int]] = []
        for _ in range(rng.randint(1, 12)):
            if pairs and rng.random() < 0.6:  # abut the previous one
                o, n = pairs[-1]
                pairs.append((o + n, rng.randint(1, 64)))
            else:
                pairs.append((rng.randrange(3000), rng.randint(1, 64)))
        arr = _pairs(*pairs)
        merged, group = ranges.coalesce(arr)
        flat = b"".join(value[o:o + n] for o, n in pairs)
        assert b"".join(value[o:o + n] for o, n in merged.tolist()) == flat
        assert len(group) == len(pairs) and group[0] == 0 and (np.diff(group) >= 0).all()
        assert ranges.total_bytes(merged) == ranges.total_bytes(arr)
        for j, (o, n) in enumerate(pairs):  # each asked range lies inside its merged range
            mo, mn = merged[group[j]].tolist()
            assert mo <= o and o + n <= mo + mn
        # No two merged ranges abut any more.
        assert all(int(merged[k, 0] + merged[k, 1]) != int(merged[k + 1, 0]) for k in range(len(merged) - 1))
    full = _pairs(*[(k * 16, 16) for k in range(256)])
    merged, group = ranges.coalesce(full)
    assert merged.tolist() == [[0, 4096]] and group.tolist() == [0] * 256


@pytest.mark.parametrize("pairs", [_pairs((0, 10), (10, 0)), _pairs((TOP - 1, 1), (TOP, 1)),
                                   _pairs((0, 1 << 41), (1 << 41, 1))])
def test_coalesce_leaves_what_the_node_must_refuse(pairs: ranges.Pairs) -> None:
    merged, group = ranges.coalesce(pairs)
    assert merged.tolist() == pairs.tolist() and group.tolist() == list(range(len(pairs)))
