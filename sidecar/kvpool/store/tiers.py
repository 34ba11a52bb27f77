"""Storage tiers of a store node: the DRAM arena, an SSD slot file, a shared-filesystem directory.

Only this module and the transfer engine touch files and memory on the data path.  Every tier is
one preallocated region (or a directory) addressed by locations the index keeps; bytes move with
``os.pwritev``/``os.preadv`` between the arena and files, never through Python objects.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import mmap
import os
import struct
import tempfile
import time
from dataclasses import dataclass

import xxhash

from .allocator import ExtentAllocator


def checksum(view: memoryview | bytes) -> int:
    """XXH3-64 of a buffer (the checksum carried by every blob)."""
    return int(xxhash.xxh3_64_intdigest(view))


class FaultDelay:
    """Test hook (fault injection): while the file at ``path`` exists, each SSD or shared-fs read,
    write, stat and removal first sleeps the seconds it holds (a float; unreadable or empty: none).

    Set by the store's ``--fault-tier-delay-file`` (or ``faultTierDelayFile``) only: it stands in
    for a slow or hung disk in tests, where no throttled device (dm-delay) or FUSE mount is at
    hand.  Unset, it costs one attribute test per I/O.
    """

    def __init__(self, path: str = "") -> None:
        self.path = path

    def __call__(self) -> None:
        if not self.path:
            return
        try:
            with open(self.path) as f:
                delay = float(f.read().strip() or 0)
        except (OSError, ValueError):
            return
        if delay > 0:
            time.sleep(delay)


class DramTier:
    """One preallocated shared-memory arena (a file in ``shm_dir``).

    With ``keep_path`` the file stays so same-host peers can map it by path (the sidecar's arena,
    which its clients map); otherwise it is unlinked as soon as it is mapped, so a node killed by
    SIGKILL leaves nothing behind in /dev/shm.  Kept files carry the creator's pid, and files of
    dead creators in the same directory are swept at start.
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


class SsdTier:
    """A preallocated file divided into extents; created empty at start, so a restarted node
    never serves bytes of a previous life (its index is gone, its slots are unreachable)."""

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

    def write(self, offset: int, src: memoryview) -> None:
        self.fault()
        done = 0
        while done < len(src):
            done += os.pwritev(self._fd, [src[done:]], offset + done)

    def read_into(self, offset: int, dst: memoryview) -> None:
        self.fault()
        done = 0
        while done < len(dst):
            n = os.preadv(self._fd, [dst[done:]], offset + done)
            if n == 0:
                raise OSError(f"short read from {self.path} at {offset + done}")
            done += n

    def close(self) -> None:
        try:
            os.unlink(self.path)  # while still locked: a successor never sees a half-closed file
        except FileNotFoundError:
            pass
        os.close(self._fd)


def _advance(bufs: list[bytes | memoryview], n: int) -> list[bytes | memoryview]:
    """Drop the first ``n`` bytes written by writev from a buffer list."""
    out: list[bytes | memoryview] = []
    for b in bufs:
        if n >= len(b):
            n -= len(b)
            continue
        out.append(memoryview(b)[n:] if n else b)
        n = 0
    return out


_SFS_MAGIC = b"KVPF"
_SFS_HEADER = struct.Struct("<4sHHQQ")  # magic, version, kind, size, checksum (v1) | generation (v2)
SFS_PLAIN, SFS_SEALED = 1, 2


@dataclass(frozen=True)
class SharedFsHeader:
    kind: int
    size: int
    """Bytes of the object (of its plaintext, for a sealed file)."""
    checksum: int
    sealed: bool = False
    """Version 2: the payload is sealed (``kvpool.store.atrest``) and ``checksum`` is 0 — a hash of
    the plaintext on disk would let anyone confirm a guess of the content."""
    generation: int = 0
    """The generation the payload was sealed under (part of its associated data)."""


def _parse_header(raw: bytes) -> SharedFsHeader | None:
    if len(raw) != _SFS_HEADER.size:
        return None
    magic, version, kind, size, last = _SFS_HEADER.unpack(raw)
    if magic != _SFS_MAGIC:
        return None
    if version == SFS_PLAIN:
        return SharedFsHeader(kind, size, last)
    if version == SFS_SEALED:
        return SharedFsHeader(kind, size, 0, sealed=True, generation=last)
    return None


class SharedFsTier:
    """A directory every node can read (3FS, NFS, Lustre mounts); one file per object.

    File names are keyed hashes of (tenant salt, key) so the directory reveals nothing; files are
    written to a temporary name and renamed, so a reader never sees a partial object.
    """

    name = "sharedfs"

    def __init__(self, directory: str, capacity: int = 0, fault: FaultDelay | None = None) -> None:
        self.fault = fault or FaultDelay()
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.capacity = capacity

    def path_for(self, salt: bytes, key: bytes) -> str:
        name = hmac.new(salt, key, hashlib.sha256).hexdigest()
        return os.path.join(self.directory, name[:2], name)

    def write(self, salt: bytes, key: bytes, kind: int, src: memoryview, csum: int, *,
              sealed_size: int | None = None, generation: int = 0) -> str:
        """Write an object's file; with ``sealed_size`` (its plaintext size), ``src`` is sealed."""
        self.fault()
        path = self.path_for(salt, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
        try:
            try:
                if sealed_size is None:
                    header = _SFS_HEADER.pack(_SFS_MAGIC, SFS_PLAIN, kind, len(src), csum)
                else:
                    header = _SFS_HEADER.pack(_SFS_MAGIC, SFS_SEALED, kind, sealed_size, generation)
                data: list[bytes | memoryview] = [header, src]
                while data:
                    n = os.writev(fd, data)
                    data = _advance(data, n)
            finally:
                os.close(fd)
            os.rename(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        return path

    def stat(self, salt: bytes, key: bytes) -> SharedFsHeader | None:
        self.fault()
        try:
            with open(self.path_for(salt, key), "rb") as f:
                raw = f.read(_SFS_HEADER.size)
        except FileNotFoundError:
            return None
        return _parse_header(raw)

    def read_into(self, salt: bytes, key: bytes, dst: memoryview) -> SharedFsHeader | None:
        """Read the object's payload into ``dst`` (its size from :meth:`stat`, plus the sealing
        overhead for a sealed file); None if gone, damaged or not exactly that long."""
        self.fault()
        try:
            fd = os.open(self.path_for(salt, key), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            hdr = _parse_header(os.pread(fd, _SFS_HEADER.size, 0))
            if hdr is None or (hdr.size if not hdr.sealed else os.fstat(fd).st_size - _SFS_HEADER.size) != len(dst):
                return None
            done = 0
            while done < len(dst):
                n = os.preadv(fd, [dst[done:]], _SFS_HEADER.size + done)
                if n == 0:
                    return None
                done += n
            return hdr
        finally:
            os.close(fd)

    def remove(self, salt: bytes, key: bytes) -> None:
        self.fault()
        try:
            os.unlink(self.path_for(salt, key))
        except FileNotFoundError:
            pass

    def close(self) -> None:
        pass
