"""The TCP wire format of the transfer engine: fixed binary headers, pure encode/decode.

One connection carries a pipelined stream of requests; the server answers each in order.

Request (104 bytes, little-endian), followed by ``length`` payload bytes for a write::

    magic "KVTQ" | version u8 | op u8 (1 read, 2 write) | name_len u16 |
    request_id u64 | offset u64 | length u64 | token u64 | segment name (64 bytes, NUL padded)

Response (24 bytes), followed by ``msg_len`` bytes of UTF-8 message, then ``payload_len``
payload bytes (a successful read: exactly the requested length; otherwise 0)::

    magic "KVTS" | version u8 | code u8 | msg_len u16 | request_id u64 | payload_len u64

The header shape is the one of :mod:`kvpool.wire.frames`: a bad magic or version means the
stream can no longer be trusted, so the receiver closes the connection; every other problem
(unknown segment, bounds, refused guard) is a per-request code.
Nothing here does I/O, so all of it is unit-tested without sockets.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from kvpool.transfer.segment import MAX_SEGMENT_NAME_BYTES
from kvpool.transfer.status import TransferCode
from kvpool.wire.frames import TRANSFER_REQUEST_BYTES, ProtocolError, unpack_header

__all__ = ["ProtocolError"]

VERSION = 1
REQUEST_MAGIC = b"KVTQ"
RESPONSE_MAGIC = b"KVTS"
OP_READ = 1
OP_WRITE = 2
OPS = {"read": OP_READ, "write": OP_WRITE}
OP_NAMES = {OP_READ: "read", OP_WRITE: "write"}

REQUEST = struct.Struct(f"<4sBBHQQQQ{MAX_SEGMENT_NAME_BYTES}s")
RESPONSE = struct.Struct("<4sBBHQQ")
REQUEST_SIZE = REQUEST.size
RESPONSE_SIZE = RESPONSE.size
assert REQUEST_SIZE == TRANSFER_REQUEST_BYTES  # what a transfer port reads before it knows the stream
MAX_MESSAGE_BYTES = 512
U64_MAX = (1 << 64) - 1
_CODES = tuple(sorted(TransferCode, key=int))  # wire byte → code without an enum call
assert [int(c) for c in _CODES] == list(range(len(_CODES)))
_ANY_OP = range(256)
"""A response's third header byte is its code, checked on its own below (not an op)."""


# NamedTuples, not frozen dataclasses: one is built per request, and a frozen dataclass's
# __init__ costs several times more.
class RequestHeader(NamedTuple):
    op: int
    request_id: int
    segment: str
    offset: int
    length: int
    token: int


class ResponseHeader(NamedTuple):
    code: TransferCode
    request_id: int
    msg_len: int
    payload_len: int


def encode_request(op: int, request_id: int, segment: bytes, offset: int, length: int, token: int) -> bytes:
    """Pack a request header; ``segment`` is the already validated UTF-8 name."""
    return REQUEST.pack(REQUEST_MAGIC, VERSION, op, len(segment), request_id, offset, length, token, segment)


def decode_request(data: bytes | bytearray | memoryview) -> RequestHeader:
    """Unpack and validate a request header (raises :class:`ProtocolError` if malformed)."""
    _, _, op, name_len, request_id, offset, length, token, raw_name = unpack_header(
        REQUEST, data, REQUEST_MAGIC, VERSION, OP_NAMES, "transfer request")
    name = _NAME_CACHE.get((name_len, raw_name))
    if name is None:
        name = _decode_name(name_len, raw_name)
    return RequestHeader(op, request_id, name, offset, length, token)


# A server sees the same few segment names over and over: validating and decoding each one once
# keeps that work off the per-request path. Bounded, so hostile peers cannot grow it.
_NAME_CACHE: dict[tuple[int, bytes], str] = {}
_NAME_CACHE_MAX = 1024


def _decode_name(name_len: int, raw_name: bytes) -> str:
    if not 0 < name_len <= MAX_SEGMENT_NAME_BYTES:
        raise ProtocolError(f"bad segment name length {name_len}")
    if raw_name[name_len:].strip(b"\x00"):
        raise ProtocolError("segment name padding is not zero")
    try:
        name = raw_name[:name_len].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError("segment name is not UTF-8") from exc
    if len(_NAME_CACHE) >= _NAME_CACHE_MAX:
        _NAME_CACHE.clear()
    _NAME_CACHE[(name_len, raw_name)] = name
    return name


def encode_response(code: TransferCode, request_id: int, payload_len: int = 0, message: str = "") -> bytes:
    if not message:  # the common case: no message to encode and append
        return RESPONSE.pack(RESPONSE_MAGIC, VERSION, code, 0, request_id, payload_len)
    msg = message.encode("utf-8", "replace")[:MAX_MESSAGE_BYTES]
    return RESPONSE.pack(RESPONSE_MAGIC, VERSION, int(code), len(msg), request_id, payload_len) + msg


def decode_response(data: bytes | bytearray | memoryview) -> ResponseHeader:
    """Unpack and validate a response header (raises :class:`ProtocolError` if malformed)."""
    _, _, code, msg_len, request_id, payload_len = unpack_header(
        RESPONSE, data, RESPONSE_MAGIC, VERSION, _ANY_OP, "transfer response")
    if code >= len(_CODES):
        raise ProtocolError(f"unknown status code {code}")
    status = _CODES[code]
    if msg_len > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"response message too long ({msg_len})")
    return ResponseHeader(status, request_id, msg_len, payload_len)


def check_bounds(offset: int, length: int, size: int) -> str | None:
    """Why ``[offset, offset + length)`` does not fit in ``size`` bytes, or ``None`` if it does."""
    if offset < 0 or length < 0:
        return f"negative range ({offset}, {length})"
    if offset > size or length > size - offset:
        return f"range [{offset}, {offset + length}) outside segment of {size} bytes"
    return None
