"""The one frame shape of kvpool's binary streams, and its header codec.

Three streams share it: the transfer engine's (:mod:`kvpool.transfer.protocol`, magics
``KVTQ``/``KVTS``), the store's data session (:mod:`kvpool.wire.store_frames`, ``KVDQ``/``KVDS``)
and the sidecar's fast session (:mod:`kvpool.wire.sidecar_frames`, ``KVFQ``/``KVFS``).  Every
frame starts with a fixed little-endian header whose first three fields are::

    magic (4 bytes) | version u8 | op u8 | ...

then fields of its own protocol, then a body whose length the header gives.  A header whose
magic, version or op is wrong means the stream can no longer be trusted: the receiver raises
:class:`ProtocolError` and closes that connection only (every other problem is a per-call or
per-item code).  Pure; nothing here does I/O.

The transfer port serves two of the streams: it peeks at a connection's first four bytes and
hands a data-session magic to the store's session handler, and reads anything else as
transfer requests of :data:`TRANSFER_REQUEST_BYTES` (so a data-session HELLO is padded to that
length: a node without the session reads one whole header, finds a bad magic and closes).
"""

from __future__ import annotations

import struct
from collections.abc import Container
from typing import Any

MAGIC_BYTES = 4
TRANSFER_REQUEST_BYTES = 104
"""The transfer engine's request header length (:data:`kvpool.transfer.protocol.REQUEST_SIZE`,
which asserts it), the shortest first read on a transfer port."""


class ProtocolError(Exception):
    """The byte stream is not a valid kvpool stream of its kind; the connection must be closed."""


def unpack_header(layout: struct.Struct, data: bytes | bytearray | memoryview, magic: bytes, version: int,
                  ops: Container[int], what: str) -> tuple[Any, ...]:
    """The fields of one header of ``layout`` (its first three: magic, version, op), after
    checking its length, magic, version and op; ``what`` names the frame in errors ("data
    request", "fast response", ...)."""
    if len(data) != layout.size:
        raise ProtocolError(f"{what} header must be {layout.size} bytes, got {len(data)}")
    fields = layout.unpack(data)
    if fields[0] != magic:
        raise ProtocolError(f"bad {what} magic {bytes(fields[0])!r}")
    if fields[1] != version:
        raise ProtocolError(f"unsupported {what} protocol version {fields[1]}")
    if fields[2] not in ops:
        raise ProtocolError(f"unknown {what} op {fields[2]}")
    return fields
