"""Pure parts of the transfer engine: wire format, slicing, addresses, batch bookkeeping, segments."""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from kvpool.transfer import BatchHandle, Segment, SegmentRegistry, TransferCode, TransferRequest, TransferStatus
from kvpool.transfer.batch import Slice
from kvpool.transfer.plan import PAGE, plan_slices, slice_size
from kvpool.transfer.protocol import (
    OP_READ,
    OP_WRITE,
    REQUEST_SIZE,
    RESPONSE_SIZE,
    ProtocolError,
    check_bounds,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
)
from kvpool.transfer.tcp import parse_address

# -- wire format --------------------------------------------------------------------------------


def test_request_round_trip() -> None:
    data = encode_request(OP_WRITE, 7, "arena-é".encode(), 1 << 40, 12345, (1 << 64) - 1)
    assert len(data) == REQUEST_SIZE
    req = decode_request(data)
    assert (req.op, req.request_id, req.segment, req.offset, req.length, req.token) == (
        OP_WRITE,
        7,
        "arena-é",
        1 << 40,
        12345,
        (1 << 64) - 1,
    )


@pytest.mark.parametrize(
    ("index", "value"),
    [(0, 0x00), (4, 2), (5, 0), (5, 9), (6, 0), (6, 65)],  # magic, version, op ×2, name_len ×2
)
def test_request_rejects_malformed_fields(index: int, value: int) -> None:
    data = bytearray(encode_request(OP_READ, 1, b"arena", 0, 16, 0))
    data[index] = value
    with pytest.raises(ProtocolError):
        decode_request(bytes(data))


def test_request_rejects_dirty_name_padding_and_bad_utf8() -> None:
    data = bytearray(encode_request(OP_READ, 1, b"arena", 0, 16, 0))
    data[REQUEST_SIZE - 1] = 1
    with pytest.raises(ProtocolError, match="padding"):
        decode_request(bytes(data))
    data = bytearray(encode_request(OP_READ, 1, b"\xff\xfe", 0, 16, 0))
    with pytest.raises(ProtocolError, match="UTF-8"):
        decode_request(bytes(data))
    with pytest.raises(ProtocolError):
        decode_request(b"short")


def test_response_round_trip_and_message_cap() -> None:
    data = encode_response(TransferCode.OUT_OF_BOUNDS, 9, 0, "x" * 2000)
    resp = decode_response(data[:RESPONSE_SIZE])
    assert resp.code is TransferCode.OUT_OF_BOUNDS and resp.request_id == 9
    assert resp.msg_len == 512 and len(data) == RESPONSE_SIZE + 512
    ok = decode_response(encode_response(TransferCode.OK, 3, 4096))
    assert ok.payload_len == 4096 and ok.msg_len == 0


@pytest.mark.parametrize(("index", "value"), [(0, 0x41), (4, 7), (5, 200)])
def test_response_rejects_malformed(index: int, value: int) -> None:
    data = bytearray(encode_response(TransferCode.OK, 1, 0))
    data[index] = value
    with pytest.raises(ProtocolError):
        decode_response(bytes(data))


def test_status_codes_are_stable_wire_values() -> None:
    assert [(c.name, c.value) for c in TransferCode] == [
        ("OK", 0),
        ("LEASE_INVALID", 1),
        ("OUT_OF_BOUNDS", 2),
        ("NO_SEGMENT", 3),
        ("CONNECTION", 4),
        ("TIMEOUT", 5),
        ("PROTOCOL", 6),
    ]
    assert TransferStatus(TransferCode.OK).ok and not TransferStatus(TransferCode.TIMEOUT, "x").ok


@pytest.mark.parametrize(
    ("offset", "length", "size", "fits"),
    [(0, 0, 0, True), (0, 10, 10, True), (10, 0, 10, True), (11, 0, 10, False), (5, 6, 10, False),
     ((1 << 64) - 1, 2, 10, False), (-1, 1, 10, False), (0, -1, 10, False)],
)  # fmt: skip
def test_check_bounds(offset: int, length: int, size: int, fits: bool) -> None:
    assert (check_bounds(offset, length, size) is None) is fits


# -- slicing -----------------------------------------------------------------------------------


def test_plan_slices_tiles_every_request() -> None:
    lengths = [1, 4096, 128 * 1024, 1 << 20, (4 << 20) + 13, 0]
    plan = plan_slices(lengths, connections=2, slice_bytes=1 << 20)
    for index, length in enumerate(lengths):
        pieces = [p for p in plan if p.index == index]
        assert sum(p.length for p in pieces) == length
        starts = [p.start for p in pieces]
        assert starts == sorted(starts) and (not pieces or starts[0] == 0)
        assert all(a.start + a.length == b.start for a, b in zip(pieces, pieces[1:], strict=False))
        assert all(p.length <= 1 << 20 for p in pieces)
        assert all(p.start % PAGE == 0 for p in pieces)  # page-aligned cuts


def test_plan_slices_even_pieces_no_tiny_tail() -> None:
    plan = plan_slices([(4 << 20) + 13], connections=2, slice_bytes=1 << 20)
    assert len(plan) == 5
    assert min(p.length for p in plan) > 512 * 1024


def test_plan_slices_spreads_small_batches_over_connections() -> None:
    # one 1 MiB request with two connections → two pieces, so both streams work
    assert [p.length for p in plan_slices([1 << 20], 2, 1 << 20)] == [512 * 1024] * 2
    # but never below min_slice: 64 KiB stays one piece
    assert len(plan_slices([64 * 1024], 4, 1 << 20)) == 1
    # a big batch keeps slice_bytes pieces
    assert {p.length for p in plan_slices([1 << 20] * 16, 2, 1 << 20)} == {1 << 20}


def test_slice_size_validation() -> None:
    with pytest.raises(ValueError):
        slice_size(10, 0, 1 << 20, 4096)
    assert slice_size(0, 2, 1 << 20, 64 * 1024) == 64 * 1024


# -- requests and addresses ------------------------------------------------------------------------


def test_transfer_request_validation() -> None:
    buf = bytearray(16)
    with pytest.raises(ValueError, match="length"):
        TransferRequest("read", memoryview(buf), "arena", 0, 15)
    with pytest.raises(ValueError, match="writable"):
        TransferRequest("read", memoryview(bytes(16)), "arena", 0, 16)
    with pytest.raises(ValueError, match="op"):
        TransferRequest("copy", memoryview(buf), "arena", 0, 16)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        TransferRequest("read", memoryview(buf), "x" * 65, 0, 16)
    with pytest.raises(ValueError):
        TransferRequest("read", memoryview(buf), "arena", -1, 16)
    with pytest.raises(ValueError, match="token"):
        TransferRequest("read", memoryview(buf), "arena", 0, 16, token=1 << 64)
    with pytest.raises(ValueError, match="contiguous"):
        TransferRequest("read", memoryview(bytearray(16))[::2], "arena", 0, 8)
    # multi-byte and multi-dimensional buffers are flattened to bytes
    req = TransferRequest("write", np.zeros((4, 2), np.float32).data, "arena", 0, 32)
    assert req.local.format == "B" and req.local.nbytes == 32
    assert TransferRequest("write", memoryview(bytes(3)), "arena", 0, 3).local.readonly  # reads of it are fine


@pytest.mark.parametrize(
    ("text", "expected"),
    [("127.0.0.1:80", ("127.0.0.1", 80)), ("[::1]:9000", ("::1", 9000)), ("store-0.pool:7000", ("store-0.pool", 7000))],
)
def test_parse_address(text: str, expected: tuple[str, int]) -> None:
    assert parse_address(text) == expected


@pytest.mark.parametrize("text", ["", "host", ":80", "host:", "host:0", "host:70000", "host:x1"])
def test_parse_address_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_address(text)


# -- batch bookkeeping -----------------------------------------------------------------------------


def _slice(handle: BatchHandle, index: int) -> Slice:
    return Slice(handle, index, True, memoryview(bytearray(1)), b"s", 0, 1, 0)


def test_batch_request_final_only_after_all_slices() -> None:
    handle = BatchHandle(2)
    handle._expect(0, 2)
    handle._expect(1, 1)
    handle._seal()
    _slice(handle, 0).fail(TransferCode.CONNECTION, "first slice lost")
    assert handle.poll() == [None, None]  # the other slice may still be writing into the buffer
    _slice(handle, 1).complete(TransferStatus(TransferCode.OK))
    assert not handle.done
    _slice(handle, 0).complete(TransferStatus(TransferCode.OK))
    assert handle.done
    statuses = handle.wait(0)
    assert statuses[0].code is TransferCode.CONNECTION and statuses[0].message == "first slice lost"
    assert statuses[1].ok


def test_batch_wait_timeout_and_callbacks() -> None:
    handle = BatchHandle(1)
    handle._expect(0, 1)
    handle._seal()
    with pytest.raises(TimeoutError):
        handle.wait(0.01)
    seen: list[BatchHandle] = []
    handle.add_done_callback(seen.append)
    threading.Thread(target=_slice(handle, 0).complete, args=(TransferStatus(TransferCode.OK),)).start()
    assert handle.wait(5)[0].ok
    assert seen == [handle]
    handle.add_done_callback(seen.append)  # already done: runs at once
    assert seen == [handle, handle]


def test_empty_batch_is_done() -> None:
    handle = BatchHandle(0)
    handle._seal()
    assert handle.done and handle.wait(0) == [] and handle.poll() == []


# -- segments ------------------------------------------------------------------------------------


def test_segment_from_buffers() -> None:
    for buffer in (bytearray(64), np.zeros(16, np.uint32), mmap.mmap(-1, 64)):
        seg = Segment("s", buffer)
        assert seg.size == 64 and seg.view.format == "B" and not seg.view.readonly
        seg.close()
        assert seg.closed
        with pytest.raises(ValueError):
            _ = seg.view
    with pytest.raises(ValueError, match="read-only"):
        Segment("s", b"immutable")
    with pytest.raises(ValueError):
        Segment.anonymous("s", 0)


def test_shared_segment_is_visible_by_path(tmp_path: Path) -> None:
    owner = Segment.shared("arena/0", 8192, tmp_path)
    assert owner.path is not None and owner.path.startswith(str(tmp_path))
    other = Segment.open_shared("arena/0", owner.path)
    owner.view[100:105] = b"hello"
    assert bytes(other.view[100:105]) == b"hello"
    other.view[0:3] = b"abc"
    assert bytes(owner.view[0:3]) == b"abc"
    with pytest.raises(FileExistsError):
        Segment.shared("x", 4096, owner.path)  # never clobbers an existing file
    other.close()
    path = owner.path
    owner.close()
    assert not os.path.exists(path)  # the creator removes it


def test_shared_segment_default_location() -> None:
    seg = Segment.shared("default", 4096)
    try:
        assert seg.path is not None and os.path.exists(seg.path)
        if os.path.isdir("/dev/shm"):
            assert seg.path.startswith("/dev/shm/")
    finally:
        seg.close()


def test_close_with_exported_views_keeps_memory_valid() -> None:
    seg = Segment.anonymous("s", 4096)
    array = np.frombuffer(seg.view, np.uint8)
    seg.close()
    array[:] = 7  # still mapped: closing never pulls memory from under a user
    assert int(array.sum()) == 7 * 4096


def test_registry() -> None:
    registry = SegmentRegistry()
    seg = Segment.anonymous("a", 4096)
    registry.register(seg)
    with pytest.raises(ValueError):
        registry.register(Segment.anonymous("a", 4096))
    assert "a" in registry and len(registry) == 1 and registry.get("a") is seg
    assert registry.lookup("a") == (seg, None) and registry.names() == ["a"]
    assert registry.unregister("a") is seg and registry.unregister("a") is None
    assert registry.lookup("a") is None
    seg.close()
