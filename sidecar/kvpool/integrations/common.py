"""What the engine integrations share: the sidecar address, settings parsing and block framing.

Framing: every object an integration stores starts with a 32-byte header::

    b"KVPB" | u16 version | u16 reserved | u64 layout fingerprint | u64 xxh3_64(payload) | u64 payload bytes

(little-endian).  The fingerprint names the engine's per-block layout (layer names, shapes, dtypes),
so an engine configured differently never loads bytes packed for another layout; the checksum is
verified by the engine side on every load, end to end, on top of the pool's own checks.  Pure
Python (no torch): the engine modules pass byte views in.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Iterable, Mapping
from typing import Any

import xxhash

from kvpool.core import errors

HEADER = struct.Struct("<4sHHQQQ")
HEADER_BYTES = 32  # HEADER.size is 32: payloads start 32-byte aligned when the object is
MAGIC = b"KVPB"
VERSION = 1
DEFAULT_ADDRESS = "unix:///run/kvpool/kvpool.sock"
ADDRESS_ENV = "KVPOOL_ADDRESS"
ADDRESS_HELP = f"the sidecar's unix:// address (default ${ADDRESS_ENV}, then {DEFAULT_ADDRESS})"
"""The description of the ``address`` setting every integration takes."""


class IntegrationConfigError(errors.InvalidArgument):
    """An engine handed kvpool a configuration it cannot use (named key, what was wrong)."""


def sidecar_address(config: Mapping[str, Any]) -> str:
    """``address`` from the engine's configuration, else ``$KVPOOL_ADDRESS`` (set by injection)."""
    addr = str(config.get("address") or os.environ.get(ADDRESS_ENV) or DEFAULT_ADDRESS)
    if not addr.startswith("unix://"):
        raise IntegrationConfigError(f"kvpool address must be unix:///path/to/kvpool.sock, got {addr!r}")
    return addr


def check_keys(config: Mapping[str, Any], allowed: Iterable[str], where: str) -> None:
    """Fail fast on a misspelt setting instead of silently running with the default."""
    allowed = set(allowed)
    unknown = sorted(set(config) - allowed)
    if unknown:
        raise IntegrationConfigError(f"{where}: unknown kvpool setting(s) {', '.join(unknown)}; "
                                     f"known: {', '.join(sorted(allowed))}")


def positive(config: Mapping[str, Any], name: str, default: float, where: str, integer: bool = False) -> float:
    """Setting ``name`` of ``config`` (else ``default``), checked to be a positive number (an
    integer when ``integer``; never a bool)."""
    v = config.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)) or not v > 0:
        raise IntegrationConfigError(f"{where}.{name} must be a positive {'integer' if integer else 'number'}, "
                                     f"got {v!r}")
    return float(v)


def fingerprint(parts: Iterable[object]) -> int:
    """A stable 64-bit name of a layout description (never Python's ``hash()``)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\x00")
    return int.from_bytes(h.digest()[:8], "little")


def write_header(buf: memoryview, layout: int) -> None:
    """Fill the first 32 bytes of ``buf`` (a writable byte view) for the payload that follows."""
    payload = buf[HEADER_BYTES:]
    HEADER.pack_into(buf, 0, MAGIC, VERSION, 0, layout, xxhash.xxh3_64_intdigest(payload), len(payload))


def check_object(obj: memoryview, layout: int, object_bytes: int | None = None) -> str | None:
    """Why ``obj`` cannot be loaded into ``layout`` (None when it can): its size (``object_bytes``,
    header included) where the engine's objects have one, framing, layout, checksum."""
    if object_bytes is not None and len(obj) != object_bytes:
        return f"object of {len(obj)} bytes, this layout's are {object_bytes}"
    if len(obj) < HEADER_BYTES:
        return f"object of {len(obj)} bytes is shorter than its header"
    magic, version, _, lay, digest, size = HEADER.unpack_from(obj, 0)
    if magic != MAGIC or version != VERSION:
        return f"not a kvpool engine block (magic {magic!r}, version {version})"
    if lay != layout:
        return f"packed for layout {lay:016x}, this engine's is {layout:016x}"
    if size != len(obj) - HEADER_BYTES:
        return f"payload of {len(obj) - HEADER_BYTES} bytes, header says {size}"
    if xxhash.xxh3_64_intdigest(obj[HEADER_BYTES:]) != digest:
        return "checksum mismatch"
    return None
