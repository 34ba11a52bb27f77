"""The shared-filesystem tier: one file per object, with a header that names and checks it."""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import tempfile
from dataclasses import dataclass

from kvpool.tiers.base import FaultDelay, advance

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
