"""The client's mapping of its sidecar's shared-memory arena, for the offsets of one sidecar life."""

from __future__ import annotations

import mmap
import os

from kvpool.wire.proto import sidecar_pb2 as spb


class ArenaMap:
    """The client's mapping of the sidecar's arena, for the offsets of one sidecar life."""

    __slots__ = ("incarnation", "generation", "path", "nbytes", "mmap", "rw", "ro")

    def __init__(self, incarnation: int, generation: int, path: str, nbytes: int, mm: mmap.mmap,
                 rw: memoryview, ro: memoryview) -> None:
        self.incarnation, self.generation, self.path, self.nbytes = incarnation, generation, path, nbytes
        self.mmap, self.rw, self.ro = mm, rw, ro

    @classmethod
    def map(cls, hello: spb.HelloReply) -> ArenaMap:
        fd = os.open(hello.arena_path, os.O_RDWR)
        try:
            # MAP_POPULATE: map every page now instead of faulting 4 KiB at a time on first use.
            mm = mmap.mmap(fd, hello.arena_bytes, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                           mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        rw = memoryview(mm)
        return cls(hello.incarnation, hello.arena_generation, hello.arena_path, hello.arena_bytes, mm, rw,
                   rw.toreadonly())

    def same_arena(self, hello: spb.HelloReply) -> bool:
        """Whether ``hello`` names the arena this maps (a sidecar that adopted it)."""
        return bool(self.generation) and (hello.arena_generation, hello.arena_path, hello.arena_bytes) == \
            (self.generation, self.path, self.nbytes)

    def close(self) -> None:
        try:
            self.ro.release()
            self.rw.release()
            self.mmap.close()
        except BufferError:
            pass  # views handed out are still alive; the mapping goes with them
