"""Sealed memfd regions: memory one process allocates and another on the same host writes into.

The client of a sidecar allocates its registered buffers here and passes each region's
descriptor to the sidecar over the fast session's unix socket (``SCM_RIGHTS``); the sidecar maps
it and lands pool reads in it.  A region is sealed against shrinking (``F_SEAL_SHRINK``, and
against growing and further sealing) before it is shared: a file shrunk under a writer's
mapping would kill the writer with SIGBUS on its next store, so the receiving side refuses any
descriptor without that seal.  Linux only (memfd_create, file seals).
"""

from __future__ import annotations

import fcntl
import mmap
import os
from typing import Any

import numpy as np

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
"""What :func:`create` seals; :func:`adopt` requires ``F_SEAL_SHRINK`` of a received descriptor."""


class TooLarge(ValueError):
    """A received region is over the receiver's limit."""


class Region:
    """A mapped, sealed memfd: ``view`` is its bytes, ``fd`` the descriptor to pass on (None once
    the region no longer needs to be shared)."""

    def __init__(self, fd: int | None, mapping: mmap.mmap) -> None:
        self.fd = fd
        self.mapping = mapping
        self.view = memoryview(mapping)
        self.size = len(mapping)
        extent = writable_extent(self.view)
        assert extent is not None  # a shared read-write mapping
        self.address = extent[0]
        """Where the mapping starts in this process (finds the region of a caller's buffer)."""

    def close(self) -> None:
        """Unmap and close; views of it still alive keep the mapping (no error)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.view.release()
        try:
            self.mapping.close()
        except BufferError:
            pass  # arrays handed out still point into it; the mapping goes with the last of them


def writable_extent(buffer: Any) -> tuple[int, int] | None:
    """(address, bytes) of a writable contiguous buffer in this process, None for any other: how
    a caller's buffer is found inside a region."""
    if isinstance(buffer, np.ndarray):
        if not (buffer.flags.c_contiguous and buffer.flags.writeable):
            return None
        return int(buffer.__array_interface__["data"][0]), int(buffer.nbytes)
    view = memoryview(buffer)
    if view.readonly or not view.c_contiguous:
        return None
    if view.nbytes == 0:
        return 0, 0
    return int(np.frombuffer(view, np.uint8).__array_interface__["data"][0]), view.nbytes


def create(size: int, name: str = "kvpool-buffer") -> Region:
    """A new zero-filled region of ``size`` bytes, sealed, mapped here with its pages populated."""
    if size <= 0:
        raise ValueError("a region needs a positive size")
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                            mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return Region(fd, mapping)


def adopt(fd: int, max_bytes: int) -> Region:
    """Map a region received from another process; ``fd`` is closed in every case.  ValueError
    (with the reason) if it is not a memfd sealed against shrinking, is empty or over ``max_bytes``."""
    try:
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            raise ValueError("the descriptor is not a sealable memory file (memfd)") from None
        if not seals & fcntl.F_SEAL_SHRINK:
            raise ValueError("the memory file is not sealed against shrinking (F_SEAL_SHRINK)")
        size = os.fstat(fd).st_size
        if size <= 0:
            raise ValueError("the memory file is empty")
        if size > max_bytes:
            raise TooLarge(f"a region of {size} bytes is over the limit of {max_bytes}")
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                            mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return Region(None, mapping)
