"""Registered memory segments and the registry a :class:`TransferServer` serves from.

A segment is a named, contiguous, writable byte region that the transfer engine reads from and
writes into directly (``recv_into``/``sendall`` on slices of its memoryview, or a numpy copy for
the shared-memory path) — payload never passes through an intermediate Python object.

A segment may carry a :class:`Guard`: the owner's hook that decides, per request, whether the
bytes may be touched (the store pins a slot and checks its generation/lease there), so a slot that
was recycled is never read over the wire.
"""

from __future__ import annotations

import mmap
import os
import re
import tempfile
import threading
import uuid
from typing import Any, Literal, Protocol, runtime_checkable

#: Segment names travel in a fixed-size field of the wire header.
MAX_SEGMENT_NAME_BYTES = 64

Op = Literal["read", "write"]


def validate_segment_name(name: str) -> bytes:
    """Return the wire encoding of ``name`` or raise ``ValueError`` if it cannot be sent."""
    if not isinstance(name, str) or not name:
        raise ValueError("segment name must be a non-empty string")
    encoded = name.encode("utf-8")
    if len(encoded) > MAX_SEGMENT_NAME_BYTES:
        raise ValueError(f"segment name longer than {MAX_SEGMENT_NAME_BYTES} bytes: {name!r}")
    if b"\x00" in encoded:
        raise ValueError("segment name must not contain NUL")
    return encoded


@runtime_checkable
class Guard(Protocol):
    """Per-request admission hook of a segment, called by the server around every byte move.

    ``acquire`` runs before any byte of the request is touched; returning ``None`` refuses the
    request (status ``LEASE_INVALID``; nothing moves; other requests are unaffected). Whatever it
    returns otherwise is passed to ``release`` once the bytes have moved, successfully or not.
    Large requests are sliced by the engine, so one logical request may be seen as several
    adjacent ``(offset, length)`` ranges with the same token.

    Both methods are called from server connection threads, possibly concurrently.
    The shared-memory transport cannot call a guard (the peer maps the memory directly); callers
    of that path must verify checksums themselves.
    """

    def acquire(self, op: Op, offset: int, length: int, token: int) -> object | None: ...

    def release(self, handle: object) -> None: ...


class Segment:
    """A named, contiguous, writable memory region.

    ``buffer`` is anything exposing a writable contiguous buffer (``mmap``, ``bytearray``,
    a C-contiguous numpy array); the segment keeps a flat ``uint8`` memoryview of it.
    """

    def __init__(self, name: str, buffer: Any) -> None:
        validate_segment_name(name)
        view = memoryview(buffer)
        if view.readonly:
            raise ValueError(f"segment {name!r}: buffer is read-only")
        if not view.c_contiguous:
            raise ValueError(f"segment {name!r}: buffer is not contiguous")
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        self.name = name
        self.path: str | None = None
        self._buffer: Any = buffer
        self._view: memoryview | None = view
        self._unlink_on_close = False

    # -- constructors ------------------------------------------------------------------------

    @classmethod
    def anonymous(cls, name: str, size: int) -> Segment:
        """A private anonymous mapping of ``size`` bytes (page-aligned, zero-filled)."""
        if size <= 0:
            raise ValueError("segment size must be positive")
        return cls(name, mmap.mmap(-1, size))

    @classmethod
    def shared(
        cls, name: str, size: int, path: str | os.PathLike[str] | None = None, *, unlink_on_close: bool = True
    ) -> Segment:
        """A file-backed shared mapping a process on the same host can map by ``.path``.

        ``path`` may be a file to create, a directory to create it in, or ``None`` for
        ``/dev/shm`` (falling back to the temp dir). The file is created exclusively (an existing
        file is never clobbered) with mode 0600 and removed by :meth:`close` unless
        ``unlink_on_close`` is false.
        """
        if size <= 0:
            raise ValueError("segment size must be positive")
        validate_segment_name(name)
        target = _shared_path(name, path)
        fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(target)
            raise
        os.close(fd)  # the mapping keeps the file alive
        seg = cls(name, mapping)
        seg.path = target
        seg._unlink_on_close = unlink_on_close
        return seg

    @classmethod
    def open_shared(cls, name: str, path: str | os.PathLike[str]) -> Segment:
        """Map an existing shared segment file (created by :meth:`shared`, maybe elsewhere)."""
        target = os.fspath(path)
        fd = os.open(target, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size <= 0:
                raise ValueError(f"shared segment file {target!r} is empty")
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        seg = cls(name, mapping)
        seg.path = target
        return seg

    # -- accessors ---------------------------------------------------------------------------

    @property
    def view(self) -> memoryview:
        if self._view is None:
            raise ValueError(f"segment {self.name!r} is closed")
        return self._view

    @property
    def size(self) -> int:
        return self.view.nbytes

    @property
    def closed(self) -> bool:
        return self._view is None

    def close(self) -> None:
        """Release the mapping (and remove the file of a shared segment this process created).

        If slices of :attr:`view` are still exported elsewhere the mapping stays alive until they
        are garbage-collected; closing never invalidates memory under someone's feet.
        """
        view, self._view = self._view, None
        if view is None:
            return
        try:
            view.release()
        except BufferError:
            pass  # a numpy array still wraps it; the memory stays valid until that goes
        if isinstance(self._buffer, mmap.mmap):
            try:
                self._buffer.close()
            except BufferError:
                pass  # exported slices still alive; the mapping dies with them
        if self._unlink_on_close and self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._view is None else f"{self._view.nbytes} bytes"
        return f"Segment({self.name!r}, {state}{', ' + self.path if self.path else ''})"


def _shared_path(name: str, path: str | os.PathLike[str] | None) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    if path is None:
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        return os.path.join(directory, f"kvpool-{safe}-{uuid.uuid4().hex[:12]}")
    target = os.fspath(path)
    if os.path.isdir(target):
        return os.path.join(target, f"kvpool-{safe}-{uuid.uuid4().hex[:12]}")
    return target


class SegmentRegistry:
    """Thread-safe name → (segment, guard) table served by a :class:`TransferServer`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[Segment, Guard | None]] = {}

    def register(self, segment: Segment, guard: Guard | None = None) -> None:
        with self._lock:
            if segment.name in self._entries:
                raise ValueError(f"segment {segment.name!r} already registered")
            self._entries[segment.name] = (segment, guard)

    def unregister(self, name: str) -> Segment | None:
        with self._lock:
            entry = self._entries.pop(name, None)
        return None if entry is None else entry[0]

    def lookup(self, name: str) -> tuple[Segment, Guard | None] | None:
        # A plain dict read is atomic; the lock only orders writers.
        return self._entries.get(name)

    def get(self, name: str) -> Segment | None:
        entry = self._entries.get(name)
        return None if entry is None else entry[0]

    def names(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)
