"""The DRAM arena: one preallocated, file-backed memory region addressed by extents."""

from __future__ import annotations

import mmap
import os
import tempfile

from kvpool.arena.allocator import ExtentAllocator
from kvpool.arena.extents import ExtentTier


class DramTier(ExtentTier):
    """One preallocated shared-memory arena (a file in ``shm_dir``).

    With ``keep_path`` the file stays so same-host peers can map it by path (the sidecar's arena,
    which its clients map); otherwise it is unlinked as soon as it is mapped, so a node killed by
    SIGKILL leaves nothing behind in /dev/shm.  Kept files carry the creator's pid, and files of
    dead creators in the same directory are swept at start.

    It passes the ``kvpool.tiers.base.Tier`` conformance suite (``reserve``, ``write_batch``,
    ``read_batch``, ``free``: copies between the arena and caller buffers), but its owners — the
    store node and the sidecar — never copy through it: they carve it through their index
    (``alloc`` under the index lock) and hand out ``slice``/``view``, zero-copy views of its
    extents, to transfers, to clients that map the same pages, and to the tiers below (a tier
    move writes from and reads into the arena in place).  The two ways do not mix on one
    instance (the batch calls keep their own table).
    No encryption at rest: the arena lives as long as its process, unlinked or mode 0600 in
    /dev/shm, and is served by one-sided transfers straight from its pages.
    """

    name = "dram"

    def __init__(self, capacity: int, shm_dir: str = "/dev/shm", label: str = "store",
                 align: int = 4096, keep_path: bool = False) -> None:
        self.alloc = ExtentAllocator(capacity, align)
        self.capacity = self.alloc.capacity
        sweep_dead_arenas(shm_dir)
        fd, self.path = tempfile.mkstemp(prefix=f"kvpool-{label}-{os.getpid()}-", suffix=".arena", dir=shm_dir)
        try:
            os.ftruncate(fd, self.capacity)
            # MAP_POPULATE: the kernel allocates and maps every page now, so the first transfers
            # into the arena do not pay a page fault per 4 KiB (and a too-small /dev/shm or
            # memory limit fails here, at start, not in the middle of serving).
            self._mmap = mmap.mmap(fd, self.capacity, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                   mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        if not keep_path:
            os.unlink(self.path)
            self.path = ""
        self.view = memoryview(self._mmap)
        self._init_table()

    def _put(self, offset: int, src: memoryview) -> None:
        self.view[offset:offset + len(src)] = src

    def _get(self, offset: int, dst: memoryview) -> None:
        dst[:] = self.view[offset:offset + len(dst)]

    def slice(self, offset: int, size: int) -> memoryview:
        return self.view[offset:offset + size]

    def close(self) -> None:
        try:
            self.view.release()
            self._mmap.close()
        except (BufferError, ValueError):
            pass  # views still exported; the mapping goes with the process
        if self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def sweep_dead_arenas(directory: str) -> int:
    """Remove ``kvpool-<label>-<pid>-*.arena`` files whose creating process is gone."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if not (name.startswith("kvpool-") and name.endswith(".arena")):
            continue
        parts = name.split("-")
        pid = next((int(p) for p in reversed(parts[1:-1]) if p.isdigit()), 0)
        if pid <= 0 or os.path.exists(f"/proc/{pid}"):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed += 1
        except OSError:
            pass
    return removed
