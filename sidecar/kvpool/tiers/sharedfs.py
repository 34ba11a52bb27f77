"""The shared-filesystem tier: one file per object, with a header that names and checks it."""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.arena.extents import Location, ObjectRef, zero
from kvpool.core.checksum import checksum
from kvpool.core.errors import Code
from kvpool.tiers.atrest import OVERHEAD
from kvpool.tiers.base import FaultDelay, advance

_SFS_MAGIC = b"KVPF"


_SFS_HEADER = struct.Struct("<4sHHQQ")  # magic, version, kind, size, checksum (v1) | generation (v2)
HEADER_BYTES = _SFS_HEADER.size
"""Bytes of a file's header; its payload follows."""


SFS_PLAIN, SFS_SEALED = 1, 2


@dataclass(frozen=True)
class SharedFsHeader:
    """A file's header: names and checks its payload (the on-disk format; see ``_SFS_HEADER``)."""

    kind: int
    size: int
    """Bytes of the object (of its plaintext, for a sealed file)."""
    checksum: int
    sealed: bool = False
    """Version 2: the payload is sealed (``kvpool.tiers.atrest``) and ``checksum`` is 0 — a hash of
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

    A :class:`~kvpool.tiers.base.Tier` whose locations are names: ``locate`` finds the files of
    other nodes and of previous lives by their header, and a read checks that header (magic,
    version, kind, size, generation) and the payload's checksum (a sealed blob has none: the
    ``SealedTier`` above checks its tag).
    ``capacity`` bounds what this instance reserves (0: unbounded); ``used`` counts its own
    files, not those of the other nodes on the mount.  Thread-safe.
    """

    name = "sharedfs"
    named = True

    def __init__(self, directory: str, capacity: int = 0, fault: FaultDelay | None = None) -> None:
        self.fault = fault or FaultDelay()
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.capacity = capacity
        self._lock = threading.Lock()
        self._mine: dict[str, int] = {}
        """Path → bytes of each file this instance reserved and has not freed."""
        self._used = 0

    def path_for(self, salt: bytes, key: bytes) -> str:
        name = hmac.new(salt, key, hashlib.sha256).hexdigest()
        return os.path.join(self.directory, name[:2], name)

    def _write_file(self, path: str, header: bytes, src: memoryview) -> None:
        """Write ``header`` ‖ ``src`` to a temporary file and rename it to ``path``."""
        self.fault()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
        try:
            try:
                data: list[bytes | memoryview] = [header, src]
                while data:
                    n = os.writev(fd, data)
                    data = advance(data, n)
            finally:
                os.close(fd)
            os.rename(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise

    def close(self) -> None:
        pass

    # ------------------------------------------------------------------ the Tier interface

    @property
    def used(self) -> int:
        return self._used

    def reserve(self, refs: Sequence[ObjectRef], sizes: Sequence[int]) -> list[Location | None]:
        """A name for each object that fits in ``capacity`` (None: no room); no I/O."""
        out: list[Location | None] = []
        with self._lock:
            for ref, size in zip(refs, sizes, strict=True):
                if size < 0:
                    raise ValueError(f"object size {size} is negative")
                path = self.path_for(ref.salt, ref.key)
                held = self._mine.get(path, 0)
                if self.capacity and self._used - held + size > self.capacity:
                    out.append(None)
                    continue
                self._mine[path] = size
                self._used += size - held
                out.append(Location(ref, size))
        return out

    def locate(self, refs: Sequence[ObjectRef], sealed: bool = False) -> list[Location | None]:
        """The files of ``refs`` whoever wrote them, by their header: sealed ones with
        ``sealed``, files in the clear without (the other kind is not this reader's: a file in
        the clear is not trusted by a sealing node, a sealed one cannot be opened without a key).
        None for no file, a damaged header, or a header that does not match the file's length."""
        out: list[Location | None] = []
        for ref in refs:
            self.fault()
            try:
                fd = os.open(self.path_for(ref.salt, ref.key), os.O_RDONLY)
            except FileNotFoundError:
                out.append(None)
                continue
            try:
                hdr = _parse_header(os.pread(fd, _SFS_HEADER.size, 0))
                stored = -1 if hdr is None else _stored_size(hdr)
                if (hdr is None or hdr.sealed != sealed or hdr.kind != ref.kind
                        or os.fstat(fd).st_size != _SFS_HEADER.size + stored):
                    out.append(None)
                    continue
                out.append(Location(ref, stored, sealed=hdr.sealed, generation=hdr.generation))
            finally:
                os.close(fd)
        return out

    def write_batch(self, locs: Sequence[Location], srcs: Sequence[memoryview]) -> list[Code]:
        """Write each object's file (reserved here: else NOT_FOUND); INVALID for a source of
        another size than reserved, UNAVAILABLE when the file system fails."""
        codes: list[Code] = []
        for loc, src in zip(locs, srcs, strict=True):
            path = self.path_for(loc.ref.salt, loc.ref.key)
            with self._lock:
                mine = self._mine.get(path)
            if mine is None:
                codes.append(Code.NOT_FOUND)
                continue
            if len(src) != loc.size or mine != loc.size or (loc.sealed and loc.size < OVERHEAD):
                codes.append(Code.INVALID)
                continue
            kind = loc.ref.kind
            if loc.sealed:
                header = _SFS_HEADER.pack(_SFS_MAGIC, SFS_SEALED, kind, loc.size - OVERHEAD, loc.generation)
            else:
                header = _SFS_HEADER.pack(_SFS_MAGIC, SFS_PLAIN, kind, len(src), checksum(src))
            try:
                self._write_file(path, header, src)
            except OSError:
                codes.append(Code.UNAVAILABLE)
                continue
            with self._lock:
                freed = path not in self._mine
            if freed:  # freed while it was written: the file goes too
                self._unlink(path)
                codes.append(Code.NOT_FOUND)
                continue
            codes.append(Code.OK)
        return codes

    def read_batch(self, locs: Sequence[Location], dsts: Sequence[memoryview]) -> list[Code]:
        """Read each object's payload into its caller buffer (exactly its size): NOT_FOUND for
        no file or a file of another object (kind, size, generation, sealed or not), CHECKSUM
        for a damaged one (header, length, payload), INVALID for a buffer of another size,
        UNAVAILABLE when the file system fails.  On any code but OK the buffer is zeroed."""
        codes: list[Code] = []
        for loc, dst in zip(locs, dsts, strict=True):
            try:
                code = self._read_one(loc, dst)
            except OSError:
                code = Code.UNAVAILABLE
            if code != Code.OK:
                zero(dst)
            codes.append(code)
        return codes

    def _read_one(self, loc: Location, dst: memoryview) -> Code:
        if len(dst) != loc.size:
            return Code.INVALID
        self.fault()
        try:
            fd = os.open(self.path_for(loc.ref.salt, loc.ref.key), os.O_RDONLY)
        except FileNotFoundError:
            return Code.NOT_FOUND
        try:
            hdr = _parse_header(os.pread(fd, _SFS_HEADER.size, 0))
            if hdr is None or os.fstat(fd).st_size != _SFS_HEADER.size + _stored_size(hdr):
                return Code.CHECKSUM
            if (hdr.sealed != loc.sealed or hdr.kind != loc.ref.kind or _stored_size(hdr) != loc.size
                    or hdr.generation != loc.generation):
                return Code.NOT_FOUND
            if not _read_payload(fd, dst):
                return Code.CHECKSUM
            if not hdr.sealed and checksum(dst) != hdr.checksum:
                return Code.CHECKSUM
            return Code.OK
        finally:
            os.close(fd)

    def free(self, locs: Sequence[Location]) -> None:
        """Remove the objects' files (whoever wrote them); a file that is gone is ignored."""
        for loc in locs:
            path = self.path_for(loc.ref.salt, loc.ref.key)
            with self._lock:
                held = self._mine.pop(path, None)
                if held is not None:
                    self._used -= held
            self._unlink(path)

    def _unlink(self, path: str) -> None:
        self.fault()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _stored_size(hdr: SharedFsHeader) -> int:
    """Bytes of the payload after the header: the object's, or its sealed blob's."""
    return hdr.size + OVERHEAD if hdr.sealed else hdr.size


def _read_payload(fd: int, dst: memoryview) -> bool:
    """Fill ``dst`` from the payload of an open file; False when the file is shorter."""
    done = 0
    while done < len(dst):
        n = os.preadv(fd, [dst[done:]], _SFS_HEADER.size + done)
        if n == 0:
            return False
        done += n
    return True
