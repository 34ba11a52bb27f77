"""The client↔sidecar fast session: one-round-trip binary frames for the hot calls.

The client's gRPC channel to its sidecar costs 0.3–2 ms per unary call on this kind of machine
(protobuf, HTTP/2, the gRPC threads); the hot calls (match, read, write start/commit, release)
carry only keys, ids and small tables, so they go as fixed binary frames over a second unix
socket beside the gRPC one (``<socket>.fast``, served by :mod:`kvpool.sidecar.session_server`).
gRPC stays for everything else and as the fallback.  Bytes never travel here: they are in the
shared-memory arena both sides map.  The layout follows the store's data session
(:mod:`kvpool.wire.store_frames`), whose header check it reuses.  Nothing here does I/O, so
every frame is unit-tested without sockets.  All integers are little-endian.

Request header (32 bytes), then ``text_len`` bytes of UTF-8 text (HELLO: the tenant the client
expects; WRITE_START, WRITE_FROM: the traffic class), ``release_count`` × u64 lease ids to drop
before the call, then per op: MATCH/READ/WRITE_START/READ_INTO/WRITE_FROM ``count`` × 32 key
bytes (WRITE_START then ``count`` × u64 sizes; READ_INTO then the targets: region ids u64 × n,
offsets u64 × n, lengths u64 × n; WRITE_FROM the targets, then checksums u64 × n), WRITE_COMMIT
``count`` × u64 checksums, RELEASE and REGISTER nothing more::

    magic "KVFQ" | version u8 | op u8 | kind u8 | flags u8 | request_id u32 | count u32 |
    lease_ms u32 | text_len u16 | release_count u16 |
    ref u64 (READ, READ_INTO: a match lease to drop; WRITE_COMMIT: the reservation id;
             REGISTER: the region id)

Response header (40 bytes), then ``msg_len`` bytes of UTF-8 message, then the body::

    magic "KVFS" | version u8 | op u8 | status u8 | flags u8 | request_id u32 | count u32 |
    msg_len u32 | prefix u32 | local u32 | ref u64 | pad u32

``status`` is the whole call (``kvpool.core.errors.SESSION_STATUS``; 0 = OK and the body follows);
per-item results are ``kvpool.wire.proto.store_pb2.Code`` bytes.  Bodies when the status is OK:

* HELLO: with ``FLAG_IDENTITY`` set in the response flags, the arena generation u64 and the
  arena size u64 (``ref`` = the sidecar's incarnation); a sidecar older than incarnations sets
  neither.  A client compares the incarnation with the one its leases and mapping belong to
  before it uses the connection (:mod:`kvpool.sidecar.journal`): a restarted sidecar is a new
  process, so every connection of the old life broke with it.
* RELEASE: none.  MATCH: none (``prefix``, ``local`` = local prefix, ``ref`` = lease).
* READ: codes u8 × n, offsets u64 × n, sizes u64 × n (arena extents; ``ref`` = the read lease,
  ``prefix`` = local hits, ``local`` = pool hits).
* WRITE_START: codes u8 × n, offsets u64 × n (``ref`` = the reservation id).
* WRITE_COMMIT: codes u8 × n (with ``FLAG_POOL_WAIT``: the pool's codes, see the flag).
* WRITE_FROM: codes u8 × n, the pool's per object (an owner that could not be reached: NO_SPACE).
* REGISTER: none.  READ_INTO: codes u8 × n, sizes u64 × n (``prefix`` = local hits, ``local`` =
  pool hits); OK means the object's bytes are in the caller's buffer.

A READ row with code NO_SPACE is an object the pool holds that the arena had no room for (every
extent pinned, or larger than the tier); its size column is the object's size, its offset 0.
The client reads such objects with a READ_INTO into a region of its own made for that call
(``FLAG_TRANSIENT``: the sidecar unmaps the region once it has answered).  WRITE_FROM is the
other direction: objects a put could not place in a local tier pinned full go to the pool
straight from spans of the client's registered memory (its ``alloc_buffer`` memory, zero copy,
or a transient region it copied them into), never through the arena.

Registered memory (REGISTER, READ_INTO): the one place bytes land outside the arena.  A client
allocates a memfd sealed against shrinking (``F_SEAL_SHRINK``: the sidecar writes into its
mapping, and a file shrunk under it would kill the sidecar with SIGBUS) and passes its descriptor
with the REGISTER header (``SCM_RIGHTS``); the region lives as long as the connection.  A
READ_INTO names, per key, a span of a region of that connection; the sidecar copies local hits
there and lands pool fetches there directly (:class:`kvpool.sidecar.landing.BufferLanding`).
A descriptor that arrives with any other header, or more than one, breaks the stream.

A request with ``FLAG_NO_REPLY`` (RELEASE only) gets no response: a release after a finished
copy costs one ``send`` instead of a round trip.  A frame that does not parse (magic, version,
op, limits) means the stream can no longer be trusted: the receiver raises
:class:`ProtocolError` and closes that connection only.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from kvpool.core.keys import KEY_BYTES
from kvpool.wire.frames import ProtocolError, unpack_header
from kvpool.wire.store_frames import MAX_KEYS, MAX_MESSAGE_BYTES, MAX_OBJECT_BYTES

__all__ = ["ProtocolError"]

VERSION = 1
REQUEST_MAGIC = b"KVFQ"
RESPONSE_MAGIC = b"KVFS"

OP_HELLO = 1
OP_MATCH = 2
OP_READ = 3
OP_WRITE_START = 4
OP_WRITE_COMMIT = 5
OP_RELEASE = 6
OP_REGISTER = 7
OP_READ_INTO = 8
OP_WRITE_FROM = 9
OPS = (OP_HELLO, OP_MATCH, OP_READ, OP_WRITE_START, OP_WRITE_COMMIT, OP_RELEASE, OP_REGISTER, OP_READ_INTO,
       OP_WRITE_FROM)

FLAG_NO_REPLY = 1
FLAG_LOCAL_ONLY = 2
"""MATCH, READ: look at the local tier only (a READ fetches nothing from the pool: the rest are NOT_FOUND)."""
FLAG_IDENTITY = 4
"""Response to HELLO: the body carries the arena generation and size (``ref``: the incarnation)."""
IDENTITY = struct.Struct("<QQ")
FLAG_TRANSIENT = 8
"""READ_INTO, WRITE_FROM: the regions it names are unmapped once it is answered (one-call
memory: the client's read of objects its sidecar's arena had no room for, a READ's NO_SPACE
rows; a put's objects copied for the pool)."""
FLAG_POOL_WAIT = 16
"""WRITE_COMMIT: write the objects to the pool before answering, waiting at most ``lease_ms``
milliseconds; the codes are then the pool's verdict (``Client.put(..., wait=True)``)."""

REQUEST = struct.Struct("<4sBBBBIIIHHQ")
RESPONSE = struct.Struct("<4sBBBBIIIIIQI")
REQUEST_SIZE = REQUEST.size
RESPONSE_SIZE = RESPONSE.size

MAX_TEXT_BYTES = 255
MAX_RELEASES = 1024
"""Lease ids piggybacked on one frame; more is a broken or hostile peer."""
SOCKET_SUFFIX = ".fast"

_U64 = np.dtype("<u8")
_KEYED = (OP_MATCH, OP_READ, OP_WRITE_START, OP_READ_INTO, OP_WRITE_FROM)
_TARGET_COLUMNS = 3
"""READ_INTO: region ids, offsets, lengths."""
_COLUMNS = {OP_WRITE_START: 1, OP_WRITE_COMMIT: 1, OP_READ_INTO: _TARGET_COLUMNS, OP_WRITE_FROM: _TARGET_COLUMNS + 1}
"""u64 values per item after the keys: sizes; checksums; targets; targets then checksums."""


def socket_path(grpc_socket: str) -> str:
    """Where the fast session of the sidecar serving ``grpc_socket`` listens."""
    return grpc_socket + SOCKET_SUFFIX


class Request(NamedTuple):
    op: int
    kind: int
    flags: int
    request_id: int
    items: int
    lease_ms: int
    text_len: int
    release_count: int
    ref: int

    def body_bytes(self) -> int:
        """Bytes that follow the header."""
        per_item = (KEY_BYTES if self.op in _KEYED else 0) + 8 * _COLUMNS.get(self.op, 0)
        return self.text_len + 8 * self.release_count + self.items * per_item


class RequestBody(NamedTuple):
    text: str
    releases: list[int]
    keys: bytes
    values: npt.NDArray[np.uint64] | None
    """WRITE_START: sizes; WRITE_COMMIT: checksums; READ_INTO: region ids, offsets, lengths (3 × n);
    WRITE_FROM: those, then checksums (4 × n)."""


class Response(NamedTuple):
    op: int
    status: int
    flags: int
    request_id: int
    items: int
    msg_len: int
    prefix: int
    local: int
    ref: int

    def body_bytes(self) -> int:
        if self.status:
            return 0
        if self.op == OP_HELLO:
            return IDENTITY.size if self.flags & FLAG_IDENTITY else 0
        return {OP_READ: 17, OP_WRITE_START: 9, OP_WRITE_COMMIT: 1, OP_READ_INTO: 9,
                OP_WRITE_FROM: 1}.get(self.op, 0) * self.items


# -- requests ------------------------------------------------------------------------------

def encode_request(op: int, request_id: int, *, keys: bytes = b"", kind: int = 0, flags: int = 0,
                   lease_ms: int = 0, ref: int = 0, text: bytes = b"", releases: list[int] | None = None,
                   values: npt.NDArray[np.uint64] | list[int] | None = None) -> list[bytes]:
    """The buffers of one request frame (header first); ``keys`` is the packed 32-byte keys,
    ``values`` the sizes (WRITE_START), checksums (WRITE_COMMIT) or targets (READ_INTO: region
    ids, then offsets, then lengths)."""
    if len(keys) % KEY_BYTES:
        raise ValueError(f"key blob of {len(keys)} bytes is not a multiple of {KEY_BYTES}")
    releases = releases or []
    if op in _KEYED:
        count = len(keys) // KEY_BYTES
    elif op == OP_WRITE_COMMIT:
        count = len(values) if values is not None else 0
    else:
        count = 0
    if count > MAX_KEYS:
        raise ValueError(f"{count} items in one frame (at most {MAX_KEYS})")
    if len(text) > MAX_TEXT_BYTES or len(releases) > MAX_RELEASES:
        raise ValueError("text or release list too long")
    header = REQUEST.pack(REQUEST_MAGIC, VERSION, op, kind, flags, request_id, count, lease_ms, len(text),
                          len(releases), ref)
    out = [header, text, np.asarray(releases, _U64).tobytes() if releases else b""]
    if op in _KEYED:
        out.append(keys)
    if op in _COLUMNS:
        if values is None or len(values) != count * _COLUMNS[op]:
            raise ValueError("WRITE_START needs one size, WRITE_COMMIT one checksum, READ_INTO one "
                             "(region, offset, length) and WRITE_FROM those and a checksum per item")
        out.append(np.asarray(values, _U64).tobytes())
    return [b for b in out if b]


def decode_request(data: bytes | bytearray | memoryview) -> Request:
    """Unpack and validate a request header (:class:`ProtocolError` if it is not one)."""
    _, _, op, kind, flags, rid, count, lease_ms, tlen, nrel, ref = unpack_header(
        REQUEST, data, REQUEST_MAGIC, VERSION, OPS, "fast request")
    if count > MAX_KEYS:
        raise ProtocolError(f"{count} items in one frame (at most {MAX_KEYS})")
    if tlen > MAX_TEXT_BYTES or nrel > MAX_RELEASES:
        raise ProtocolError("text or release list over the limit")
    if count and op in (OP_HELLO, OP_RELEASE, OP_REGISTER):
        raise ProtocolError("HELLO, RELEASE and REGISTER carry no items")
    if flags & FLAG_NO_REPLY and op != OP_RELEASE:
        raise ProtocolError("only RELEASE may go without a reply")
    if flags & FLAG_POOL_WAIT and op != OP_WRITE_COMMIT:
        raise ProtocolError("only WRITE_COMMIT may wait for the pool")
    return Request(op, kind, flags, rid, count, lease_ms, tlen, nrel, ref)


def decode_request_body(req: Request, body: bytes | bytearray | memoryview) -> RequestBody:
    """Split the bytes after a request header (exactly ``req.body_bytes()`` of them)."""
    if len(body) != req.body_bytes():
        raise ProtocolError(f"request body of {len(body)} bytes, expected {req.body_bytes()}")
    mv = memoryview(body)
    try:
        text = bytes(mv[:req.text_len]).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError("text is not UTF-8") from exc
    at = req.text_len
    releases = np.frombuffer(mv, _U64, req.release_count, at).tolist()
    at += 8 * req.release_count
    keys = b""
    if req.op in _KEYED:
        keys = bytes(mv[at:at + req.items * KEY_BYTES])
        at += req.items * KEY_BYTES
    values = None
    if req.op in _COLUMNS:
        values = np.frombuffer(mv, _U64, _COLUMNS[req.op] * req.items, at)
        if req.op == OP_WRITE_START and req.items and int(values.max()) > MAX_OBJECT_BYTES:
            raise ProtocolError("object size over the protocol limit")
    return RequestBody(text, releases, keys, values)


# -- responses -----------------------------------------------------------------------------

def encode_response(op: int, request_id: int, count: int = 0, *, status: int = 0, message: str = "",
                    prefix: int = 0, local: int = 0, ref: int = 0, flags: int = 0) -> bytes:
    """A response header (and its message); the body is sent after it."""
    msg = message.encode("utf-8", "replace")[:MAX_MESSAGE_BYTES]
    return RESPONSE.pack(RESPONSE_MAGIC, VERSION, op, status, flags, request_id, count, len(msg), prefix, local,
                         ref, 0) + msg


def encode_hello(request_id: int, incarnation: int, generation: int, arena_bytes: int) -> bytes:
    """A HELLO reply that names the sidecar's life and arena."""
    return encode_response(OP_HELLO, request_id, ref=incarnation, flags=FLAG_IDENTITY) + \
        IDENTITY.pack(generation, arena_bytes)


def decode_hello(resp: Response, body: bytes | bytearray | memoryview) -> tuple[int, int, int]:
    """(incarnation, arena generation, arena bytes) of a HELLO reply (:class:`ProtocolError`
    for a reply that does not name them)."""
    if not resp.flags & FLAG_IDENTITY or len(body) != IDENTITY.size:
        raise ProtocolError("HELLO reply without the sidecar's identity")
    generation, arena_bytes = IDENTITY.unpack(bytes(body))
    return resp.ref, generation, arena_bytes


def decode_response(data: bytes | bytearray | memoryview) -> Response:
    """Unpack and validate a response header (:class:`ProtocolError` if it is not one)."""
    _, _, op, status, flags, rid, count, msg_len, prefix, local, ref, _ = unpack_header(
        RESPONSE, data, RESPONSE_MAGIC, VERSION, OPS, "fast response")
    if count > MAX_KEYS or msg_len > MAX_MESSAGE_BYTES:
        raise ProtocolError("fast response header over its limits")
    return Response(op, status, flags, rid, count, msg_len, prefix, local, ref)


def encode_table(codes: Sequence[int] | npt.NDArray[np.uint8], *columns: list[int] | npt.NDArray[np.uint64]) -> bytes:
    """Codes u8 × n, then each u64 column (offsets, sizes) × n."""
    return np.asarray(codes, np.uint8).tobytes() + b"".join(np.asarray(c, _U64).tobytes() for c in columns)


class Table(NamedTuple):
    codes: list[int]
    offsets: list[int]
    sizes: list[int]


def decode_table(resp: Response, body: bytes | bytearray | memoryview, arena_bytes: int) -> Table:
    """The per-item table of a READ, WRITE_START or WRITE_COMMIT reply; an extent outside the
    arena is a broken stream (a client must never read another object's bytes)."""
    n = resp.items
    if len(body) != resp.body_bytes():
        raise ProtocolError(f"table of {len(body)} bytes for {n} items of op {resp.op}")
    codes = bytes(body[:n])
    if resp.op in (OP_WRITE_COMMIT, OP_WRITE_FROM):
        return Table(list(codes), [], [])
    offsets = np.frombuffer(body, _U64, n, n)
    sizes = np.frombuffer(body, _U64, n, 9 * n) if resp.op == OP_READ else np.zeros(n, _U64)
    # Only an OK row names an extent: a NO_SPACE row of a READ carries the size of an object the
    # arena had no room for (it may be larger than the arena), to read into the caller's memory.
    ok = np.frombuffer(codes, np.uint8) == 0
    off_ok, size_ok = offsets[ok], sizes[ok]
    # Each bound alone first: the u64 sum of two huge values could wrap below the arena size.
    if len(off_ok) and (int(off_ok.max()) > arena_bytes or int(size_ok.max()) > arena_bytes
                        or int((off_ok + size_ok).max()) > arena_bytes):
        raise ProtocolError("extent outside the arena")
    if n and int(sizes.max()) > MAX_OBJECT_BYTES:
        raise ProtocolError("object size over the protocol limit")
    return Table(list(codes), offsets.tolist(), sizes.tolist())


def decode_sizes(resp: Response, body: bytes | bytearray | memoryview) -> tuple[list[int], list[int]]:
    """The (codes, sizes) of a READ_INTO reply."""
    n = resp.items
    if len(body) != resp.body_bytes():
        raise ProtocolError(f"table of {len(body)} bytes for {n} items of op {resp.op}")
    return list(bytes(body[:n])), np.frombuffer(body, _U64, n, n).tolist()
