"""The local tier's persistence: an arena file and a journal beside it that a restarted sidecar adopts.

In a pod the arena directory is the shared-memory emptyDir, which outlives the sidecar
container: when the container is killed and started again (``restartPolicy: Always``), the
new sidecar finds the previous life's arena and journal there and adopts the objects they
hold instead of starting empty (goal row 26).

Files, named after the socket they serve (several sidecars may share one directory)::

    kvpool-sidecar-<tag>.tier      the arena (the bytes; clients map it)
    kvpool-sidecar-<tag>.journal   a header page, then one fixed slot per ``align`` unit of the arena

The journal is an mmap'd table, not a log: the slot of an object is its extent's offset
divided by the allocation unit, so a write is a fixed-size store into shared memory (no
append, no compaction, no fsync: the pages live in tmpfs and survive the process, not the
node).  A slot is written when its extent is reserved (RESERVED: a client may be writing
there), committed (COMMITTED, with the checksum and the flags) and when the object leaves the
index (FREE); the state byte is written last, so a process killed mid-write leaves the slot
RESERVED, and the object is dropped, never half-described.

Adoption (:func:`plan_adoption`, pure): a journal whose header does not match this sidecar's
configuration (arena size, allocation unit, tenant, format) is not adopted — both files are
created anew (new inodes, so clients of the old life keep their mappings) and the reason is
reported.  Otherwise every COMMITTED slot whose record is coherent (offset = its slot, inside
the arena, not overlapping another, a known kind, a key not seen twice) is a candidate; the
caller checks each candidate's checksum against its bytes before serving it.  RESERVED
extents are quarantined for a while (a client of the old life may still be copying into
them) and then freed.

The arena has a generation (random, new whenever the files are created anew); the sidecar
process has an incarnation (random, per life).  Clients learn both at HELLO: the generation
says whether their mapping is still the arena, the incarnation whether leases, reservations
and offsets they hold belong to this life.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import secrets
import struct
import tempfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvpool.arena.allocator import ExtentAllocator
from kvpool.core import sizing

FORMAT = 1
MAGIC = b"KVPJ"
HEADER_BYTES = sizing.JOURNAL_HEADER_BYTES
TENANT_BYTES = 256
SOCKET_BYTES = 1024
_HEADER = struct.Struct(f"<4sIQQQQ{TENANT_BYTES}s{SOCKET_BYTES}s")
"""magic, format, generation, arena bytes, align, slots, tenant, socket path (UTF-8, NUL-padded)."""

FREE, RESERVED, COMMITTED = 0, 1, 2
FLAG_DIRTY, FLAG_POOLED = 1, 2
TCLASS_BYTES = 32

SLOT = np.dtype([("key", "V32"), ("offset", "<u8"), ("size", "<u8"), ("checksum", "<u8"), ("kind", "u1"),
                 ("flags", "u1"), ("state", "u1"), ("pad", "V5"), ("tclass", f"S{TCLASS_BYTES}")])
"""One slot: 96 bytes (2.3 % of a 4 KiB allocation unit)."""
_RECORD = struct.Struct(f"<32sQQQBBB5x{TCLASS_BYTES}s")
"""The same slot as a struct: one ``pack_into`` per object is the cheapest write of a few."""
_CHECKSUM_AT = 32 + 2 * 8
_COMMIT = struct.Struct("<QBB")
"""checksum, kind, flags: what a commit adds to a reserved slot."""
_STATE_AT = 32 + 3 * 8 + 2
_FLAGS_AT = 32 + 3 * 8 + 1
assert SLOT.itemsize == sizing.JOURNAL_SLOT_BYTES  # what the operator sizes the pod's volume by
assert SLOT.fields is not None and (SLOT.fields["state"][1], SLOT.fields["flags"][1],
                                    SLOT.fields["checksum"][1]) == (_STATE_AT, _FLAGS_AT, _CHECKSUM_AT)
assert _RECORD.size == SLOT.itemsize

_KINDS = (0, 1)  # kvpool.v1.Kind BLOCK, STATE


def new_id() -> int:
    """A random nonzero 63-bit id (an arena generation or a sidecar incarnation)."""
    return secrets.randbits(63) | 1


def paths(directory: str, socket_path: str) -> tuple[str, str]:
    """(arena, journal) paths of the sidecar serving ``socket_path``."""
    tag = hashlib.sha256(os.path.abspath(socket_path).encode()).hexdigest()[:16]
    base = os.path.join(directory, f"kvpool-sidecar-{tag}")
    return base + ".tier", base + ".journal"


def remove_files(directory: str, socket_path: str) -> None:
    """Delete a sidecar's arena and journal (a test cluster's cleanup; a pod's emptyDir goes by itself)."""
    arena, journal = paths(directory, socket_path)
    for p in (arena, journal, journal + ".lock"):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


@dataclass(frozen=True)
class Layout:
    """What must be equal for an arena to be adopted."""

    arena_bytes: int
    align: int
    tenant: str

    @property
    def slots(self) -> int:
        return self.arena_bytes // self.align

    def header(self, generation: int, socket_path: str = "") -> bytes:
        return _HEADER.pack(MAGIC, FORMAT, generation, self.arena_bytes, self.align, self.slots,
                            self.tenant.encode()[:TENANT_BYTES], os.path.abspath(socket_path).encode()[:SOCKET_BYTES]
                            if socket_path else b"")


def layout_mismatch(header: bytes, want: Layout, arena_file_bytes: int) -> str:
    """Why a journal with ``header`` cannot be adopted by a sidecar of layout ``want`` ("" if it can)."""
    if len(header) < _HEADER.size:
        return "journal header is truncated"
    magic, fmt, gen, arena_bytes, align, slots, tenant, _ = _HEADER.unpack_from(header)
    if magic != MAGIC or fmt != FORMAT or not gen:
        return f"journal format {fmt} (this sidecar writes {FORMAT})" if magic == MAGIC else "not a journal"
    old_tenant = tenant.rstrip(b"\0").decode("utf-8", "replace")
    if old_tenant != want.tenant:
        return f"tenant changed: {old_tenant!r} -> {want.tenant!r}"
    if arena_bytes != want.arena_bytes:
        return f"local tier size changed: arena of {arena_bytes} -> {want.arena_bytes} bytes"
    if align != want.align or slots != want.slots:
        return f"arena layout changed: unit {align} x {slots} -> {want.align} x {want.slots}"
    if arena_file_bytes != arena_bytes:
        return f"arena file is {arena_file_bytes} bytes, its journal says {arena_bytes}"
    return ""


def header_generation(header: bytes) -> int:
    return int(_HEADER.unpack_from(header)[2])


def orphaned(header: bytes, dir_exists: bool) -> bool:
    """Whether a journal with ``header``, whose lock no process holds, belongs to a sidecar that
    can never come back: its socket's directory is gone (a test cluster's workdir; in a pod the
    socket lives in the arena's own directory, so a pod's files are never orphans)."""
    if len(header) < _HEADER.size:
        return False
    magic, *_, sock = _HEADER.unpack_from(header)
    return magic == MAGIC and bool(sock.rstrip(b"\0")) and not dir_exists


def socket_of(header: bytes) -> str:
    if len(header) < _HEADER.size:
        return ""
    return str(_HEADER.unpack_from(header)[-1].rstrip(b"\0").decode("utf-8", "replace"))


def sweep_orphans(directory: str) -> int:
    """Remove the files of sidecars that can never come back (:func:`orphaned`) from
    ``directory``: a sidecar killed with its test cluster leaves its arena in shared memory."""
    removed = 0
    try:
        names = [n for n in os.listdir(directory) if n.startswith("kvpool-sidecar-") and n.endswith(".journal")]
    except OSError:
        return 0
    for name in names:
        journal_path = os.path.join(directory, name)
        try:
            lock_fd = os.open(journal_path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its sidecar is alive
            with open(journal_path, "rb") as f:
                header = f.read(HEADER_BYTES)
            sock = socket_of(header)
            if orphaned(header, bool(sock) and os.path.isdir(os.path.dirname(sock))):
                base = journal_path[:-len(".journal")]
                for p in (base + ".tier", journal_path, journal_path + ".lock"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(p)
                removed += 1
        except OSError:
            continue
        finally:
            os.close(lock_fd)
    return removed


@dataclass
class AdoptionPlan:
    """What :func:`plan_adoption` decided, as slot indices."""

    candidates: npt.NDArray[np.int64]
    """COMMITTED and coherent: adopted if their bytes match their checksum."""
    reserved: npt.NDArray[np.int64]
    """RESERVED (uncommitted or torn writes): dropped; their extents quarantined for a while."""
    incoherent: npt.NDArray[np.int64]
    """COMMITTED but impossible (bad offset, overlap, unknown kind, a key twice): dropped."""
    notes: list[str] = field(default_factory=list)


def rounded(size: npt.NDArray[np.uint64], align: int) -> npt.NDArray[np.uint64]:
    a = np.uint64(align)
    out: npt.NDArray[np.uint64] = np.maximum(a, (size + a - np.uint64(1)) // a * a)
    return out


def plan_adoption(slots: npt.NDArray[Any], align: int, arena_bytes: int) -> AdoptionPlan:
    """Sort a journal's slots into adoptable, quarantined and impossible (pure; no bytes read)."""
    state = slots["state"]
    used = np.flatnonzero(state != FREE)
    reserved = used[state[used] == RESERVED]
    committed = used[state[used] == COMMITTED]
    bad = used[(state[used] != RESERVED) & (state[used] != COMMITTED)]
    rec = slots[committed]
    off, size = rec["offset"], rec["size"]
    ext = rounded(size, align)
    ok = ((off == committed.astype(np.uint64) * np.uint64(align)) & (size > 0)
          & (size <= np.uint64(arena_bytes)) & (off + ext <= np.uint64(arena_bytes))
          & np.isin(rec["kind"], _KINDS))
    # Overlaps: in offset order (the slot order), an extent must end before the next begins;
    # both of an overlapping pair go (which one is right cannot be told from the journal).
    cand = committed[ok]
    if len(cand) > 1:
        c_off = slots["offset"][cand]
        c_end = c_off + rounded(slots["size"][cand], align)
        clash = c_end[:-1] > c_off[1:]
        over = np.zeros(len(cand), bool)
        over[:-1] |= clash
        over[1:] |= clash
        # A RESERVED extent inside a committed one is also a contradiction.
        cand = cand[~over]
        bad = np.concatenate([bad, committed[ok][over]])
    # A key committed twice (one object, two slots): neither is trusted.
    if len(cand) > 1:
        ident = np.empty(len(cand), dtype=[("kind", "u1"), ("key", "V32")])
        ident["kind"], ident["key"] = slots["kind"][cand], slots["key"][cand]
        _, inverse, counts = np.unique(ident, return_inverse=True, return_counts=True)
        twice = counts[inverse] > 1
        bad = np.concatenate([bad, cand[twice]])
        cand = cand[~twice]
    bad = np.sort(np.concatenate([bad, committed[~ok]]))
    return AdoptionPlan(np.sort(cand), reserved, bad)


def _flags(e: Any) -> int:
    """A slot's flags byte for a local entry's ``dirty`` / ``pooled``."""
    return (FLAG_DIRTY if e.dirty else 0) | (FLAG_POOLED if e.pooled else 0)


class Journal:
    """The slot table of one arena, mapped (writes are stores into shared memory)."""

    def __init__(self, mm: mmap.mmap, layout: Layout) -> None:
        self._mmap = mm
        self.layout = layout
        self.shift = layout.align.bit_length() - 1
        self.slots: npt.NDArray[Any] = np.frombuffer(mm, SLOT, layout.slots, HEADER_BYTES)

    def reserved(self, entries: list[Any]) -> None:
        """Extents handed out for writing (entries with ``key``, ``offset``, ``size``, ``kind``,
        ``traffic_class``): a crash now drops them and quarantines their extents.  The whole
        record, as RESERVED (a slot only ever becomes an object by :meth:`committed`)."""
        self._write(entries, RESERVED)

    def committed(self, entries: list[Any]) -> None:
        """Objects published (their checksum and flags final), of extents :meth:`reserved`
        described: their checksum and flags, then the state, per object."""
        mm, shift, size, pack = self._mmap, self.shift, SLOT.itemsize, _COMMIT.pack_into
        at = [HEADER_BYTES + (e.offset >> shift) * size for e in entries]
        for pos, e in zip(at, entries, strict=True):
            pack(mm, pos + _CHECKSUM_AT, e.checksum, e.kind, _flags(e))
        for pos in at:
            mm[pos + _STATE_AT] = COMMITTED

    def flags(self, entries: list[Any]) -> None:
        """The dirty/pooled flags of committed objects changed."""
        mm, shift, size = self._mmap, self.shift, SLOT.itemsize
        for e in entries:
            mm[HEADER_BYTES + (e.offset >> shift) * size + _FLAGS_AT] = _flags(e)

    def freed(self, offset: int) -> None:
        """The object at ``offset`` left the index (its extent is free, or will be at its last unpin)."""
        self._mmap[HEADER_BYTES + (offset >> self.shift) * SLOT.itemsize + _STATE_AT] = FREE

    def _write(self, entries: list[Any], state: int) -> None:
        mm, shift, size, pack = self._mmap, self.shift, SLOT.itemsize, _RECORD.pack_into
        for e in entries:
            pack(mm, HEADER_BYTES + (e.offset >> shift) * size, e.key, e.offset, e.size, e.checksum, e.kind,
                 _flags(e), state, e.traffic_class.encode()[:TCLASS_BYTES])

    def close(self) -> None:
        self.slots = np.zeros(0, SLOT)
        try:
            self._mmap.close()
        except BufferError:
            pass


@dataclass
class Opened:
    """An arena and its journal, adopted or new."""

    arena: mmap.mmap
    journal: Journal
    generation: int
    adopted_from: bool
    """Whether a previous life's files were found and kept (then :attr:`plan` says what to keep)."""
    reset_reason: str
    """Why a previous life's files were not adopted ("" when there were none, or they were)."""
    plan: AdoptionPlan | None
    lock_fd: int


def _map(path: str, size: int, populate: bool) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        return mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def _create(path: str, size: int, head: bytes = b"") -> None:
    """A new file at ``path`` (a new inode, renamed over any old one: mappings of the old stay valid)."""
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", dir=os.path.dirname(path))
    try:
        os.ftruncate(fd, size)
        if head:
            os.pwrite(fd, head, 0)
        os.rename(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    finally:
        os.close(fd)


def open_arena(directory: str, socket_path: str, layout: Layout) -> Opened:
    """Adopt the arena and journal of the sidecar serving ``socket_path`` if they match
    ``layout``, else create both anew.  Raises RuntimeError if another live process holds them."""
    arena_path, journal_path = paths(directory, socket_path)
    os.makedirs(directory, exist_ok=True)
    sweep_orphans(directory)
    lock_fd = os.open(journal_path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock_fd)
        raise RuntimeError(f"the local tier at {arena_path} belongs to another live sidecar") from None
    journal_bytes = sizing.journal_bytes(layout.arena_bytes, layout.align)  # what the operator sizes the volume for
    reason = ""
    found = os.path.exists(journal_path) and os.path.exists(arena_path)
    if found:
        try:
            with open(journal_path, "rb") as f:
                header = f.read(HEADER_BYTES)
            reason = layout_mismatch(header, layout, os.path.getsize(arena_path))
            if not reason and os.path.getsize(journal_path) != journal_bytes:
                reason = f"journal is {os.path.getsize(journal_path)} bytes, expected {journal_bytes}"
        except OSError as exc:
            reason = f"cannot read the journal: {exc}"
    elif os.path.exists(journal_path) or os.path.exists(arena_path):
        reason = "arena or journal missing"
    adopt = found and not reason
    if adopt:
        generation = header_generation(header)
    else:
        generation = new_id()
        # The journal first with no slots used, then the arena: a crash in between leaves a
        # journal that adopts nothing.
        _create(journal_path, journal_bytes, layout.header(generation, socket_path))
        _create(arena_path, layout.arena_bytes)
    jm = _map(journal_path, journal_bytes, populate=False)
    journal = Journal(jm, layout)
    plan = plan_adoption(journal.slots, layout.align, layout.arena_bytes) if adopt else None
    arena = _map(arena_path, layout.arena_bytes, populate=True)
    return Opened(arena, journal, generation, adopt, reason, plan, lock_fd)


class PersistentArena:
    """The local tier's arena as a named file with a journal (the interface of a
    :class:`~kvpool.arena.dram.DramTier`: ``alloc``, ``capacity``, ``path``, ``view``, ``slice``)."""

    def __init__(self, capacity: int, directory: str, socket_path: str, tenant: str, align: int = 4096) -> None:
        self.alloc = ExtentAllocator(capacity, align)
        self.capacity = self.alloc.capacity
        self.path = paths(directory, socket_path)[0]
        self.opened = open_arena(directory, socket_path, Layout(self.capacity, align, tenant))
        self.journal = self.opened.journal
        self.generation = self.opened.generation
        self._mmap = self.opened.arena
        self.view = memoryview(self._mmap)

    def slice(self, offset: int, size: int) -> memoryview:
        return self.view[offset:offset + size]

    def close(self) -> None:
        """Unmap (the files stay for the next life) and let go of the lock."""
        self.journal.close()
        try:
            self.view.release()
            self._mmap.close()
        except (BufferError, ValueError):
            pass  # views still exported; the mapping goes with the process
        os.close(self.opened.lock_fd)
