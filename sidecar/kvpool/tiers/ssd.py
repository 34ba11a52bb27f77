"""The SSD tier: one preallocated slot file; bytes move with pwritev/preadv, never through Python objects."""

from __future__ import annotations

import fcntl
import os

from kvpool.arena.allocator import ExtentAllocator
from kvpool.arena.extents import ExtentTier
from kvpool.tiers.base import FaultDelay


class SsdTier(ExtentTier):
    """A preallocated file divided into extents; created empty at start, so a restarted node
    never serves bytes of a previous life (its index is gone, its slots are unreachable).

    A :class:`~kvpool.tiers.base.Tier`: the batch calls keep their own table of what is where
    (and its checksum, so a damaged slot is CHECKSUM, never served).
    """

    name = "ssd"

    def __init__(self, directory: str, capacity: int, node_id: str, align: int = 4096,
                 fault: FaultDelay | None = None) -> None:
        self.fault = fault or FaultDelay()
        os.makedirs(directory, exist_ok=True)
        self.alloc = ExtentAllocator(capacity, align)
        self.capacity = self.alloc.capacity
        self.path = os.path.join(directory, f"kvpool-{node_id}.slots")
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            # One live node per slot file: a second process on the same path would truncate the
            # first one's objects under its feet.  Lock first, then truncate.
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._fd)
            raise RuntimeError(f"SSD slot file {self.path} is in use by another store node") from None
        # Discard any previous life's content before serving (restart safety).
        os.ftruncate(self._fd, 0)
        try:
            os.posix_fallocate(self._fd, 0, self.capacity)
        except OSError:
            os.ftruncate(self._fd, self.capacity)
        self._init_table()

    def _put(self, offset: int, src: memoryview) -> None:
        self.fault()
        done = 0
        while done < len(src):
            done += os.pwritev(self._fd, [src[done:]], offset + done)

    def _get(self, offset: int, dst: memoryview) -> None:
        self.fault()
        done = 0
        while done < len(dst):
            n = os.preadv(self._fd, [dst[done:]], offset + done)
            if n == 0:
                raise OSError(f"short read from {self.path} at {offset + done}")
            done += n

    def close(self) -> None:
        fd, self._fd = self._fd, -1  # later I/O fails (EBADF), never on a recycled descriptor
        if fd < 0:
            return
        try:
            os.unlink(self.path)  # while still locked: a successor never sees a half-closed file
        except FileNotFoundError:
            pass
        os.close(fd)
