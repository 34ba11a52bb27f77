"""The one header codec (kvpool.wire.frames) that the three binary streams share."""

from __future__ import annotations

import struct

import pytest

from kvpool.transfer import protocol as transfer_protocol
from kvpool.wire import frames
from kvpool.wire import sidecar_frames as fp
from kvpool.wire import store_frames as dp


def test_the_three_streams_raise_the_one_protocol_error() -> None:
    assert transfer_protocol.ProtocolError is dp.ProtocolError is fp.ProtocolError is frames.ProtocolError


def test_a_transfer_port_reads_a_whole_transfer_header_first() -> None:
    assert transfer_protocol.REQUEST_SIZE == frames.TRANSFER_REQUEST_BYTES


@pytest.mark.parametrize(("data", "why"), [
    (b"ABCD\x01\x07" + bytes(2), "must be 9 bytes"),
    (b"ABCX\x01\x07" + bytes(3), "bad test request magic"),
    (b"ABCD\x02\x07" + bytes(3), "version 2"),
    (b"ABCD\x01\x08" + bytes(3), "unknown test request op 8"),
])
def test_unpack_header_checks_length_magic_version_and_op(data: bytes, why: str) -> None:
    layout = struct.Struct("<4sBBBH")
    with pytest.raises(frames.ProtocolError, match=why):
        frames.unpack_header(layout, data, b"ABCD", 1, (7,), "test request")
    assert frames.unpack_header(layout, b"ABCD\x01\x07\x05\x01\x00", b"ABCD", 1, (7,), "x") == (b"ABCD", 1, 7, 5, 1)


@pytest.mark.parametrize("magic", [dp.REQUEST_MAGIC, fp.REQUEST_MAGIC])
def test_a_session_magic_is_no_transfer_request(magic: bytes) -> None:
    """The transfer port tells the streams apart by their magic: each is refused by the others."""
    with pytest.raises(frames.ProtocolError, match="magic"):
        transfer_protocol.decode_request(magic + bytes(transfer_protocol.REQUEST_SIZE - 4))
