"""The store's data session: one-round-trip binary frames for get, put, exists and ranged get.

A data session is a TCP connection to a store node's transfer port whose first bytes are the
request magic below (the transfer server hands such connections to the node's session handler,
:mod:`kvpool.store.data_session`).  It carries the hot calls, each in one round trip: the one
data wire of the sidecar ↔ store hop; gRPC stays for the cold and admin calls.  Nothing here does
I/O, so every frame is unit-tested without sockets.  All integers are little-endian.

Request header (40 bytes), then ``token_len`` bytes of tenant token (UTF-8), ``class_len`` bytes
of traffic class (PUT only), ``count`` × 32 key bytes, and for PUT ``count`` × u64 sizes::

    magic "KVDQ" | version u8 | op u8 | kind u8 | flags u8 | request_id u32 | count u32 |
    lease_ms u32 (GET/EXISTS lease, PUT reservation timeout) | token_len u16 | class_len u16 |
    lease_id u64 (GET, EXISTS: a lease of the tenant to drop first; PUT: the order ticket) | epoch u64

Response header (48 bytes), then ``msg_len`` bytes of UTF-8 message, then the body::

    magic "KVDS" | version u8 | op u8 | status u8 | flags u8 | request_id u32 | count u32 |
    msg_len u32 | prefix u32 | lease_id u64 | epoch u64 | payload_len u64

``status`` is the whole call (``kvpool.core.errors.SESSION_STATUS``; 0 = OK, then the body follows);
per-item results are ``kvpool.wire.proto.store_pb2.Code`` bytes.  Bodies when the status is OK:

* HELLO: none (the session is supported).  With ``FLAG_TICKET`` the token is a ticket: an OK
  status binds the connection to its tenant (a node whose session is plaintext serves no other).
  A HELLO request carries ``HELLO_PADDING`` zero bytes as its token, so that it is as long as a
  transfer-protocol header: a node without the session reads one whole header, finds a bad magic
  and closes the connection instead of waiting.
* GET: codes u8 × n, sizes u64 × n, checksums u64 × n, then ``payload_len`` bytes: the objects
  whose code is OK, in order, back to back.
* GET_RANGES (sparse reads, :mod:`kvpool.core.ranges`): the request's keys are followed by counts
  u32 × n (ranges per key) and then the ranges, (offset u64, length u64) × sum(counts); the
  reply is codes u8 × n, object sizes u64 × n, one checksum u64 per requested range (0 for the
  ranges of keys whose code is not OK), then ``payload_len`` bytes: the OK keys' ranges in
  order, back to back, sent straight from the arena.  A key whose ranges break a rule (empty,
  zero length, out of bounds, too many, over the byte budget) is INVALID on its own; the frame
  stays in sync.  Integrity: the whole-object checksum cannot vouch for a part, so the node hashes
  each range it sends (XXH3-64, as for objects; a range that is the whole object carries the
  writer's checksum instead) and the client verifies each range it received (a mismatch is the
  key's CHECKSUM); that covers the wire and the landing.  The object itself is
  held in flight for the send, as for GET, so its extent cannot be recycled under the reply; with
  ``FLAG_VERIFY_OBJECT`` the node also checks the whole object against the writer's checksum
  before sending any part of it (a key that fails is CHECKSUM), at the cost of hashing it all.
* EXISTS: ``prefix`` in the header, presence bitmap ``ceil(n / 8)`` bytes (bit i of byte i // 8,
  least significant first), ``lease_id`` when the prefix was pinned.  A request ``lease_id`` is
  dropped first (a lease of the frame's tenant only): an EXISTS of no keys is the release.
* PUT is two frames: PUT_READY with codes u8 × n (OK: send this object's bytes; anything else,
  e.g. ALREADY_EXISTS or QUOTA_EXCEEDED: do not), then the client sends the OK objects' bytes
  back to back and after them the checksums of all n objects (u64 × n), then PUT_DONE with the
  final codes u8 × n.  A duplicate costs no bytes.  A PUT_READY without any OK code (or with an
  error status) is final: no payload, no checksums, no PUT_DONE.  The checksums trail the
  payload so that the writer hashes while PUT_READY is on its way, not before asking.
  A batch cut into parts over several connections is ordered by each PUT's ``lease_id``, its
  order ticket (:func:`order_ticket`: the batch's random 48-bit number, the number of parts and
  the part's index; 0 for an unordered put): the node reserves part k once parts 0..k-1 of the
  same tenant and batch have reserved (:mod:`kvpool.core.put_order`), so the parts' frames and
  bytes travel at once while quota and space still go to the earliest items.

A frame that does not parse (magic, version, op, limits) means the stream can no longer be
trusted: the receiver raises :class:`ProtocolError` and closes that connection only.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import numpy as np
import numpy.typing as npt

from kvpool.core import ranges as _ranges
from kvpool.core.keys import KEY_BYTES
from kvpool.wire.frames import TRANSFER_REQUEST_BYTES, ProtocolError, unpack_header

__all__ = ["ProtocolError"]

VERSION = 1
REQUEST_MAGIC = b"KVDQ"
RESPONSE_MAGIC = b"KVDS"

OP_HELLO = 1
OP_GET = 2
OP_PUT = 3
OP_EXISTS = 4
OP_GET_RANGES = 6
REQUEST_OPS = (OP_HELLO, OP_GET, OP_PUT, OP_EXISTS, OP_GET_RANGES)
OP_PUT_READY = 3
OP_PUT_DONE = 5
RESPONSE_OPS = (OP_HELLO, OP_GET, OP_PUT_READY, OP_EXISTS, OP_PUT_DONE, OP_GET_RANGES)

FLAG_PREFIX_ONLY = 1
FLAG_PIN = 2
FLAG_VERIFY_OBJECT = 4
"""GET_RANGES: verify the whole object against its stored checksum before sending parts."""
FLAG_TICKET = 8
"""HELLO: the token is a data-session ticket (base64, :mod:`kvpool.core.tickets`) binding this
connection to its tenant; the frames after it carry no token (a plaintext data session)."""

REQUEST = struct.Struct("<4sBBBBIIIHHQQ")
RESPONSE = struct.Struct("<4sBBBBIIIIQQQ")
REQUEST_SIZE = REQUEST.size
RESPONSE_SIZE = RESPONSE.size

MAX_KEYS = 1 << 16
"""Keys per frame: a matcher's 8192 with room to spare; more is a broken or hostile peer."""
MAX_TOKEN_BYTES = 4096
MAX_CLASS_BYTES = 255
MAX_MESSAGE_BYTES = 1024
MAX_OBJECT_BYTES = 1 << 40

_U64 = np.dtype("<u8")
_U32 = np.dtype("<u4")
MAX_RANGES_PER_FRAME = _ranges.MAX_RANGES_PER_FRAME

HELLO_PADDING = bytes(max(0, TRANSFER_REQUEST_BYTES - REQUEST_SIZE))


class Request(NamedTuple):
    op: int
    kind: int
    flags: int
    request_id: int
    items: int
    lease_ms: int
    token_len: int
    class_len: int
    lease_id: int
    epoch: int

    def body_bytes(self) -> int:
        """Bytes that follow the header (token, class, keys, and sizes for PUT, range counts for
        GET_RANGES; the ranges themselves follow, :func:`ranges_bytes`)."""
        per_key = KEY_BYTES + (8 if self.op == OP_PUT else 4 if self.op == OP_GET_RANGES else 0)
        return self.token_len + self.class_len + self.items * per_key


class Response(NamedTuple):
    op: int
    status: int
    flags: int
    request_id: int
    items: int
    msg_len: int
    prefix: int
    lease_id: int
    epoch: int
    payload_len: int

    def body_bytes(self) -> int:
        """Bytes of the fixed-size body after the message (not the GET payload)."""
        if self.status:
            return 0
        if self.op == OP_GET:
            return self.items * 17
        if self.op == OP_GET_RANGES:
            return self.items * 9  # then the range checksums, 8 × the ranges asked
        if self.op in (OP_PUT_READY, OP_PUT_DONE):
            return self.items
        if self.op == OP_EXISTS:
            return (self.items + 7) // 8
        return 0


# -- requests ------------------------------------------------------------------------------

def encode_request(op: int, request_id: int, token: bytes, keys: bytes, *, kind: int = 0, flags: int = 0,
                   lease_ms: int = 0, lease_id: int = 0, epoch: int = 0, traffic_class: bytes = b"",
                   sizes: npt.NDArray[np.uint64] | None = None,
                   ranges: tuple[npt.NDArray[np.uint32], bytes] | None = None) -> list[bytes]:
    """The buffers of one request frame (header first); ``keys`` is the packed 32-byte keys;
    ``ranges``: GET_RANGES counts per key and packed pairs (:func:`kvpool.core.ranges.encode`)."""
    if len(keys) % KEY_BYTES:
        raise ValueError(f"key blob of {len(keys)} bytes is not a multiple of {KEY_BYTES}")
    count = len(keys) // KEY_BYTES
    if count > MAX_KEYS:
        raise ValueError(f"{count} keys in one frame (at most {MAX_KEYS})")
    if len(token) > MAX_TOKEN_BYTES or len(traffic_class) > MAX_CLASS_BYTES:
        raise ValueError("token or traffic class too long")
    header = REQUEST.pack(REQUEST_MAGIC, VERSION, op, kind, flags, request_id, count, lease_ms, len(token),
                          len(traffic_class), lease_id, epoch)
    out = [header, token, traffic_class, keys]
    if op == OP_PUT:
        if sizes is None or len(sizes) != count:
            raise ValueError("a PUT needs one size per key")
        out.append(np.ascontiguousarray(sizes, _U64).tobytes())
    if op == OP_GET_RANGES:
        if ranges is None or len(ranges[0]) != count:
            raise ValueError("a GET_RANGES needs one range count per key")
        counts, blob = ranges
        if int(counts.sum()) > MAX_RANGES_PER_FRAME or len(blob) != 16 * int(counts.sum()):
            raise ValueError("GET_RANGES ranges over the frame limit or not matching their counts")
        out += [np.ascontiguousarray(counts, _U32).tobytes(), blob]
    return [b for b in out if b]


def order_ticket(batch: int, part: int, parts: int) -> int:
    """The PUT order ticket of part ``part`` of ``parts`` of batch ``batch`` (48 bits)."""
    if not 0 <= part < parts <= 0xFF or not 0 < batch < 1 << 48:
        raise ValueError(f"no order ticket for part {part} of {parts} of batch {batch}")
    return batch << 16 | parts << 8 | part


def split_ticket(ticket: int) -> tuple[int, int, int] | None:
    """(batch, part, parts) of a PUT order ticket; None for 0 or a ticket that makes no sense
    (the put is then served unordered: the ticket never refuses a write)."""
    batch, parts, part = ticket >> 16, ticket >> 8 & 0xFF, ticket & 0xFF
    if not batch or batch >= 1 << 48 or part >= parts:
        return None
    return batch, part, parts


def with_request_id(header: bytes, request_id: int) -> bytes:
    """The same request header under another request id (a frame built before its connection)."""
    return header[:8] + struct.pack("<I", request_id) + header[12:]


def decode_request(data: bytes | bytearray | memoryview) -> Request:
    """Unpack and validate a request header (:class:`ProtocolError` if it is not one)."""
    _, _, op, kind, flags, rid, count, lease_ms, tlen, clen, lease_id, epoch = unpack_header(
        REQUEST, data, REQUEST_MAGIC, VERSION, REQUEST_OPS, "data request")
    if count > MAX_KEYS:
        raise ProtocolError(f"{count} keys in one frame (at most {MAX_KEYS})")
    if tlen > MAX_TOKEN_BYTES or clen > MAX_CLASS_BYTES:
        raise ProtocolError("token or traffic class length over the limit")
    if op == OP_HELLO and (count or clen):
        raise ProtocolError("HELLO carries no keys")
    if op == OP_GET_RANGES and clen:
        raise ProtocolError("GET_RANGES carries no traffic class")
    return Request(op, kind, flags, rid, count, lease_ms, tlen, clen, lease_id, epoch)


class RequestBody(NamedTuple):
    token: str
    traffic_class: str
    keys: bytes
    sizes: npt.NDArray[np.uint64] | None
    counts: npt.NDArray[np.uint32] | None = None
    """GET_RANGES: ranges per key (the ranges follow the body, :func:`ranges_bytes`)."""


def decode_request_body(req: Request, body: bytes | bytearray | memoryview) -> RequestBody:
    """Split the bytes after a request header (exactly ``req.body_bytes()`` of them)."""
    if len(body) != req.body_bytes():
        raise ProtocolError(f"request body of {len(body)} bytes, expected {req.body_bytes()}")
    mv = memoryview(body)
    at = req.token_len + req.class_len
    try:
        token = bytes(mv[:req.token_len]).decode("utf-8")
        tclass = bytes(mv[req.token_len:at]).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError("token or traffic class is not UTF-8") from exc
    end = at + req.items * KEY_BYTES
    keys = bytes(mv[at:end])
    sizes = None
    if req.op == OP_PUT:
        sizes = np.frombuffer(mv, _U64, req.items, end)
        if req.items and int(sizes.max()) > MAX_OBJECT_BYTES:
            raise ProtocolError("object size over the protocol limit")
    counts = None
    if req.op == OP_GET_RANGES:
        counts = np.frombuffer(mv, _U32, req.items, end)
    return RequestBody(token, tclass, keys, sizes, counts)


def ranges_bytes(body: RequestBody) -> int:
    """Bytes of (offset, length) pairs after a GET_RANGES body; :class:`ProtocolError` past the
    frame limit (a receiver never reads that much to find out)."""
    if body.counts is None:
        return 0
    total = int(body.counts.sum(dtype=np.uint64))
    if total > MAX_RANGES_PER_FRAME:
        raise ProtocolError(f"{total} ranges in one frame (at most {MAX_RANGES_PER_FRAME})")
    return 16 * total


def encode_checksums(checksums: npt.NDArray[np.uint64] | list[int]) -> bytes:
    """The PUT trailer: one u64 checksum per item of the request, after the payload."""
    return np.asarray(checksums, _U64).tobytes()


def decode_checksums(body: bytes | bytearray | memoryview, count: int) -> list[int]:
    if len(body) != 8 * count:
        raise ProtocolError(f"{len(body)} bytes of checksums for {count} items")
    return cast("list[int]", np.frombuffer(body, _U64, count).tolist())  # tolist() is typed Any


# -- responses -----------------------------------------------------------------------------

def encode_response(op: int, request_id: int, count: int = 0, *, status: int = 0, message: str = "",
                    prefix: int = 0, lease_id: int = 0, epoch: int = 0, payload_len: int = 0) -> bytes:
    """A response header (and its message); the body is sent after it."""
    msg = message.encode("utf-8", "replace")[:MAX_MESSAGE_BYTES]
    return RESPONSE.pack(RESPONSE_MAGIC, VERSION, op, status, 0, request_id, count, len(msg), prefix, lease_id,
                         epoch, payload_len) + msg


def decode_response(data: bytes | bytearray | memoryview) -> Response:
    """Unpack and validate a response header (:class:`ProtocolError` if it is not one)."""
    _, _, op, status, flags, rid, count, msg_len, prefix, lease_id, epoch, payload = unpack_header(
        RESPONSE, data, RESPONSE_MAGIC, VERSION, RESPONSE_OPS, "data response")
    if count > MAX_KEYS or msg_len > MAX_MESSAGE_BYTES or prefix > count:
        raise ProtocolError("data response header over its limits")
    if payload and (op not in (OP_GET, OP_GET_RANGES) or status):
        raise ProtocolError("payload on a response that carries none")
    return Response(op, status, flags, rid, count, msg_len, prefix, lease_id, epoch, payload)


def encode_get_table(codes: Sequence[int], sizes: Sequence[int], checksums: Sequence[int]) -> bytes:
    """The GET table: codes u8 × n, sizes u64 × n, checksums u64 × n (the GET_RANGES layout)."""
    n = len(codes)
    return bytes(codes) + struct.pack(f"<{n}Q{n}Q", *sizes, *checksums)


class GetTable(NamedTuple):
    codes: npt.NDArray[np.uint8]
    sizes: npt.NDArray[np.uint64]
    checksums: npt.NDArray[np.uint64]


def decode_get_table(resp: Response, body: bytes | bytearray | memoryview) -> GetTable:
    """Per-item codes, sizes and checksums of a GET reply; the payload length must be the sum of
    the OK items' sizes (anything else is a broken stream)."""
    n = resp.items
    if len(body) != 17 * n:
        raise ProtocolError(f"GET table of {len(body)} bytes for {n} items")
    codes = np.frombuffer(body, np.uint8, n, 0)
    sizes = np.frombuffer(body, _U64, n, n)
    sums = np.frombuffer(body, _U64, n, 9 * n)
    ok = codes == 0
    if n and int(sizes.max()) > MAX_OBJECT_BYTES:
        raise ProtocolError("object size over the protocol limit")
    if int(sizes[ok].sum()) != resp.payload_len or (sizes[~ok] != 0).any():
        raise ProtocolError("GET payload length does not match its table")
    return GetTable(codes, sizes, sums)


def encode_range_table(codes: npt.NDArray[np.uint8] | Sequence[int], sizes: npt.NDArray[np.uint64] | Sequence[int],
                       checksums: npt.NDArray[np.uint64] | Sequence[int]) -> bytes:
    """The GET_RANGES table: codes u8 × n, object sizes u64 × n, checksums u64 × ranges."""
    return (np.asarray(codes, np.uint8).tobytes() + np.asarray(sizes, _U64).tobytes()
            + np.asarray(checksums, _U64).tobytes())


class RangeTable(NamedTuple):
    codes: npt.NDArray[np.uint8]
    sizes: npt.NDArray[np.uint64]
    checksums: npt.NDArray[np.uint64]


def decode_range_table(resp: Response, body: bytes | bytearray | memoryview, sums: bytes | bytearray | memoryview,
                       counts: npt.NDArray[Any], pairs: npt.NDArray[np.uint64]) -> RangeTable:
    """Codes, sizes and range checksums of a GET_RANGES reply to the request of ``counts`` and
    ``pairs``; the payload must be exactly the OK keys' ranges (anything else is a broken stream)."""
    n = resp.items
    if len(body) != 9 * n or len(counts) != n:
        raise ProtocolError(f"GET_RANGES table of {len(body)} bytes for {n} items")
    m = len(pairs)
    if len(sums) != 8 * m:
        raise ProtocolError(f"{len(sums)} bytes of range checksums for {m} ranges")
    codes = np.frombuffer(body, np.uint8, n, 0)
    sizes = np.frombuffer(body, _U64, n, n)
    if n and int(sizes.max()) > MAX_OBJECT_BYTES:
        raise ProtocolError("object size over the protocol limit")
    per_range_ok = np.repeat(codes == 0, np.asarray(counts, np.int64))
    expected = int(pairs[per_range_ok, 1].sum(dtype=np.uint64)) if m else 0
    if expected != resp.payload_len:
        raise ProtocolError("GET_RANGES payload length does not match the ranges asked")
    return RangeTable(codes, sizes, np.frombuffer(sums, _U64, m))


def encode_bitmap(present: bytes | bytearray | npt.NDArray[np.uint8]) -> bytes:
    """One bit per key (least significant first) from one byte per key."""
    arr = np.frombuffer(present, np.uint8) if not isinstance(present, np.ndarray) else present
    return np.packbits(arr != 0, bitorder="little").tobytes()


def decode_bitmap(body: bytes | bytearray | memoryview, count: int) -> npt.NDArray[np.bool_]:
    if len(body) != (count + 7) // 8:
        raise ProtocolError(f"bitmap of {len(body)} bytes for {count} keys")
    bits = np.unpackbits(np.frombuffer(body, np.uint8), count=count, bitorder="little")
    return bits.astype(bool)


def decode_codes(resp: Response, body: bytes | bytearray | memoryview) -> list[int]:
    if len(body) != resp.items:
        raise ProtocolError(f"{len(body)} codes for {resp.items} items")
    return list(bytes(body))
