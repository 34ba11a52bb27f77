"""A simulated RDMA fabric between processes of one host: one-sided READ/WRITE without the
target's CPU, for tests where no RDMA device exists (``KVPOOL_RDMA=sim:<dir>``).

The fabric is a directory both sides name.  What a NIC would know lives there as small files:

* ``mr-<rkey>.json``: a registered memory region — the registering process's pid, a descriptor
  of the file that backs the region (opened through ``/proc/self/map_files``, so an arena
  unlinked at start still has one) and the region's address and file offset.  A peer maps that
  file through ``/proc/<pid>/fd/<fd>`` and copies straight from or into the pages: the owner runs
  no code for the transfer, as with a real one-sided READ/WRITE.
* ``qp-<qp_num>.json``: a live queue pair.  ``connect`` needs the peer's; a transfer fails once
  the peer's queue pair (or its process) is gone — a broken RC connection.
* ``fault``: optional fault injection read at each batch, one of ``fail-after N`` (the batch's
  first N work requests complete, the rest fail: a link lost mid-way), ``corrupt`` (each READ's
  first byte is flipped after the copy: an extent that changed under the read) and ``delay S``
  (each batch waits S seconds before copying: the window in which a hold must keep the extent).

Two fabrics in different directories do not reach each other (a connect fails).  The
:class:`FabricContext` / :class:`FabricQueuePair` pair has the shape of
:class:`~kvpool.transfer.rdma.RdmaContext` / :class:`~kvpool.transfer.rdma.RdmaQueuePair`.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import os
import secrets
import threading
import time
from typing import Any

import numpy as np

from kvpool.transfer.rdma import RdmaEndpoint, RdmaSegmentKey, WorkRequestPlan, buffer_address
from kvpool.transfer.status import TransferCode, TransferStatus

SIM_DEVICE = "kvpool-sim"
"""The device name a simulated context reports (what a node advertises in the ring)."""


def _mapping_of(addr: int, length: int) -> tuple[str, int]:
    """``(range, file offset of addr)`` of this process's mapping that holds ``[addr, addr+length)``."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            start_s, _, end_s = parts[0].partition("-")
            start, end = int(start_s, 16), int(end_s, 16)
            if start <= addr and addr + length <= end:
                if len(parts) < 6 or not parts[5].startswith("/"):
                    raise ValueError("a simulated memory region must be backed by a shared file mapping")
                return parts[0], int(parts[2], 16) + (addr - start)
    raise ValueError(f"no mapping holds [{addr:#x}, +{length})")


def _write_record(path: str, doc: dict[str, Any]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)  # whole or absent, never half-written


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Temporary:
    """A region registered for one batch; ``close`` deregisters it."""

    def __init__(self, context: FabricContext, key: int) -> None:
        self._context, self._key = context, key

    def close(self) -> None:
        self._context._drop_local(self._key)


class _RemoteRegion:
    """A peer's region, mapped here: its pages, at the address the peer registered."""

    def __init__(self, record: dict[str, Any]) -> None:
        self.pid = int(record["pid"])
        self.addr, self.length = int(record["addr"]), int(record["length"])
        offset = int(record["offset"])
        page = offset - offset % mmap.PAGESIZE
        self.skew = offset - page
        fd = os.open(f"/proc/{self.pid}/fd/{int(record['fd'])}", os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, self.length + self.skew, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE, offset=page)
        finally:
            os.close(fd)
        self._array = np.frombuffer(self._map, np.uint8)
        self.base = int(self._array.ctypes.data) + self.skew

    def local_address(self, remote_addr: int, length: int) -> int | None:
        if not (self.addr <= remote_addr and remote_addr + length <= self.addr + self.length):
            return None
        return self.base + (remote_addr - self.addr)

    def close(self) -> None:
        del self._array
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()


class FabricContext:
    """One process's end of the simulated fabric in ``directory`` (see the module docstring)."""

    device = SIM_DEVICE

    def __init__(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self._lock = threading.Lock()
        self._local: dict[int, tuple[int, int]] = {}  # key -> (start, end) of this process's regions
        self._exported: dict[int, int] = {}  # rkey -> descriptor of the region's backing file
        self._remote: dict[int, _RemoteRegion] = {}  # rkey -> a peer's region mapped here

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _new_key(self) -> int:
        while True:
            key = secrets.randbits(32)
            if key and key not in self._local:
                return key

    def register(self, name: str, view: memoryview) -> RdmaSegmentKey:
        """Register ``view`` (a shared file mapping) for peers' one-sided READ/WRITE."""
        addr = buffer_address(view)
        span, offset = _mapping_of(addr, view.nbytes)
        fd = os.open(f"/proc/self/map_files/{span}", os.O_RDWR)
        with self._lock:
            key = self._new_key()
            self._local[key] = (addr, addr + view.nbytes)
            self._exported[key] = fd
        _write_record(self._path(f"mr-{key:08x}.json"),
                      {"pid": os.getpid(), "fd": fd, "offset": offset, "addr": addr, "length": view.nbytes})
        return RdmaSegmentKey(name, addr, view.nbytes, key)

    def register_temporary(self, addr: int, length: int) -> tuple[int, _Temporary]:
        with self._lock:
            key = self._new_key()
            self._local[key] = (addr, addr + length)
        return key, _Temporary(self, key)

    def _drop_local(self, key: int) -> None:
        with self._lock:
            self._local.pop(key, None)

    def lkey_for(self, addr: int, length: int) -> int | None:
        with self._lock:
            for key, (start, end) in self._local.items():
                if key not in self._exported and start <= addr and addr + length <= end:
                    return key
            for key, (start, end) in self._local.items():
                if start <= addr and addr + length <= end:
                    return key
        return None

    def local_allowed(self, addr: int, length: int, key: int) -> bool:
        with self._lock:
            span = self._local.get(key)
        return span is not None and span[0] <= addr and addr + length <= span[1]

    def remote(self, rkey: int) -> _RemoteRegion | None:
        """A peer's region by its rkey, mapped on first use; None when no live process exports it."""
        with self._lock:
            region = self._remote.get(rkey)
        if region is not None and _alive(region.pid):
            return region
        try:
            with open(self._path(f"mr-{rkey:08x}.json")) as f:
                record = json.load(f)
            region = _RemoteRegion(record)
        except (OSError, ValueError, KeyError):
            return None
        with self._lock:
            old, self._remote[rkey] = self._remote.get(rkey), region
        if old is not None:
            old.close()
        return region

    def create_queue_pair(self, depth: int = 256) -> FabricQueuePair:
        return FabricQueuePair(self)

    def accept(self, remote: RdmaEndpoint, depth: int = 256) -> FabricQueuePair:
        qp = FabricQueuePair(self)
        try:
            qp.connect(remote)
        except BaseException:
            qp.close()
            raise
        return qp

    def fault(self) -> tuple[str, float]:
        """The fault injected now (``("", 0)``: none)."""
        try:
            with open(self._path("fault")) as f:
                words = f.read().split()
        except OSError:
            return "", 0.0
        if not words:
            return "", 0.0
        return words[0], float(words[1]) if len(words) > 1 else 0.0

    def close(self) -> None:
        with self._lock:
            exported, self._exported = self._exported, {}
            remote, self._remote = self._remote, {}
            self._local.clear()
        for key, fd in exported.items():
            with contextlib.suppress(OSError):
                os.unlink(self._path(f"mr-{key:08x}.json"))
            os.close(fd)
        for region in remote.values():
            region.close()


class FabricQueuePair:
    """A simulated RC queue pair; :meth:`execute` copies between this process and the peer's pages."""

    def __init__(self, context: FabricContext) -> None:
        self.context = context
        self.depth = 256
        self._qp_num = 1 + secrets.randbits(23)
        self.endpoint = RdmaEndpoint(self._qp_num, secrets.randbits(24), 0, os.getpid().to_bytes(16, "little"))
        self._record = context._path(f"qp-{self._qp_num:06x}.json")
        _write_record(self._record, {"pid": os.getpid()})
        self.remote: RdmaEndpoint | None = None

    def _peer_alive(self) -> bool:
        if self.remote is None:
            return False
        try:
            with open(self.context._path(f"qp-{self.remote.qp_num:06x}.json")) as f:
                pid = int(json.load(f)["pid"])
        except (OSError, ValueError, KeyError):
            return False
        return _alive(pid)

    def connect(self, remote: RdmaEndpoint) -> None:
        self.remote = remote
        if not self._peer_alive():
            self.remote = None
            raise ConnectionError(f"no queue pair {remote.qp_num:#x} on fabric {self.context.directory}")

    def execute(self, plans: list[WorkRequestPlan], lkeys: dict[int, int],
                stall_timeout: float) -> dict[int, TransferStatus]:
        errors: dict[int, TransferStatus] = {}
        if not plans:
            return errors
        fault, arg = self.context.fault()
        if fault == "delay":
            time.sleep(arg)
        if not self._peer_alive():
            return {p.index: TransferStatus(TransferCode.CONNECTION, "peer queue pair gone") for p in plans}
        for n, p in enumerate(plans):
            if fault == "fail-after" and n >= arg:
                errors.setdefault(p.index, TransferStatus(TransferCode.CONNECTION, "injected link failure"))
                continue
            region = self.context.remote(p.rkey)
            there = region.local_address(p.remote_addr, p.length) if region is not None else None
            if there is None or not self.context.local_allowed(p.local_addr, p.length, lkeys[p.wr_id]):
                errors.setdefault(p.index, TransferStatus(TransferCode.CONNECTION, "remote access error"))
                continue
            dst, src = (p.local_addr, there) if p.is_read else (there, p.local_addr)
            ctypes.memmove(dst, src, p.length)
            if fault == "corrupt" and p.is_read and p.length:
                byte = ctypes.c_ubyte.from_address(p.local_addr)
                byte.value ^= 0xFF
        return errors

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self._record)
