"""One conformance suite for every tier: the DRAM arena, the SSD slot file, the shared
filesystem, and the SSD and the shared filesystem sealed at rest (``SealedTier``).

Each test talks to ``case.tier`` through the Tier interface only (``kvpool.tiers.base``); the
fixture (``case``, below) is the only place that knows which tier it is, to damage a stored byte
or start the tier's next life.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from kvpool.arena.dram import DramTier
from kvpool.tiers.atrest import OVERHEAD, AtRest
from kvpool.tiers.base import Code, Location, ObjectRef, Tier
from kvpool.tiers.sealed import SealedTier
from kvpool.tiers.sharedfs import HEADER_BYTES, SharedFsTier
from kvpool.tiers.ssd import SsdTier

CAPACITY = 4 << 20
MASTER = b"m" * 32
OTHER_MASTER = b"o" * 32
KINDS = ["dram", "ssd", "sharedfs", "ssd-sealed", "sharedfs-sealed"]
"""DRAM is never sealed (see ``DramTier``): the arena lives as long as its process and is served
by one-sided transfers from its pages, so there is no ``dram-sealed``."""


@dataclass
class TierCase:
    """One tier under test and what the suite needs to know about it."""

    kind: str
    make: Callable[[], Tier]
    """A new life of the tier on the same medium (the previous one closed where the medium
    admits one user only: the SSD slot file)."""
    tier: Tier = field(init=False)
    lives: list[Tier] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tier = self.new_life()

    @property
    def sealed(self) -> bool:
        return self.kind.endswith("-sealed")

    @property
    def named(self) -> bool:
        """Its objects outlive the instance and are found by name (the shared filesystem)."""
        return self.kind.startswith("sharedfs")

    @property
    def max_size(self) -> int:
        """The largest object the tier takes: its capacity, less the sealing overhead."""
        return CAPACITY - OVERHEAD if self.sealed else CAPACITY

    def new_life(self) -> Tier:
        if self.lives and self.kind.startswith("ssd"):
            self.lives[-1].close()
        t = self.make()
        self.lives.append(t)
        self.tier = t
        return t

    def under_other_key(self) -> SealedTier:
        """The same medium read under another master key (a sealed tier only)."""
        assert isinstance(self.tier, SealedTier)
        return SealedTier(self.tier.inner, AtRest(OTHER_MASTER))

    def damage(self, loc: Location, index: int) -> None:
        """Flip one stored byte of the object at ``loc`` (of its sealed blob, when sealed)."""
        base = self.tier.inner if isinstance(self.tier, SealedTier) else self.tier
        if isinstance(base, DramTier):
            base.view[loc.offset + index] ^= 0xFF
            return
        if isinstance(base, SsdTier):
            path, at = base.path, loc.offset + index
        else:
            assert isinstance(base, SharedFsTier)
            path, at = base.path_for(loc.ref.salt, loc.ref.key), HEADER_BYTES + index
        fd = os.open(path, os.O_RDWR)
        try:
            b = os.pread(fd, 1, at)
            os.pwrite(fd, bytes([b[0] ^ 0xFF]), at)
        finally:
            os.close(fd)


def make_case(kind: str, tmp: Path) -> TierCase:
    at_rest = AtRest(MASTER)
    plain = kind.removesuffix("-sealed")

    def make() -> Tier:
        t: Tier
        if plain == "dram":
            t = DramTier(CAPACITY, shm_dir=str(tmp), label="conformance")
        elif plain == "ssd":
            t = SsdTier(str(tmp / "ssd"), CAPACITY, "conformance")
        else:
            t = SharedFsTier(str(tmp / "fs"), CAPACITY)
        return SealedTier(t, at_rest) if kind.endswith("-sealed") else t

    return TierCase(kind, make)


@pytest.fixture(params=KINDS)
def case(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TierCase]:
    c = make_case(str(request.param), tmp_path)
    yield c
    for t in c.lives:
        try:
            t.close()
        except OSError:
            pass


KiB = 1 << 10
SIZES = [0, 1, 4095, 4096, 4097, 128 * KiB, (1 << 20) + 13]
SALT = b"kvpool-tenant\0a\0"


def ref(i: int) -> ObjectRef:
    """Object ``i`` of tenant ``a`` (its shared-fs names keyed by the tenant's salt)."""
    return ObjectRef("a", f"key-{i}".encode(), 0, SALT)


def data(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def put(tier: Tier, refs: list[ObjectRef], values: list[bytes]) -> list[Location]:
    """Reserve and write, asserting both succeed; the locations."""
    got = tier.reserve(refs, [len(v) for v in values])
    locs = [loc for loc in got if loc is not None]
    assert len(locs) == len(refs), f"no room for {len(refs) - len(locs)} of {len(refs)}"
    assert tier.write_batch(locs, [memoryview(v) for v in values]) == [Code.OK] * len(locs)
    return locs


def get(tier: Tier, locs: list[Location], fill: int = 0xAA) -> tuple[list[Code], list[bytes]]:
    """Read into fresh buffers of exactly each object's size (prefilled with ``fill``)."""
    bufs = [bytearray([fill]) * loc.size for loc in locs]
    codes = tier.read_batch(locs, [memoryview(b) for b in bufs])
    return codes, [bytes(b) for b in bufs]


class TestTierConformance:
    def test_every_tier_is_a_tier(self, case: TierCase) -> None:
        t = case.tier
        assert isinstance(t, Tier)
        assert t.name == case.kind.removesuffix("-sealed")
        assert t.named == case.named
        assert t.capacity == CAPACITY
        assert t.used == 0

    def test_a_batch_round_trips_byte_exact_into_caller_buffers(self, case: TierCase) -> None:
        t = case.tier
        values = [data(n, n) for n in SIZES]
        locs = put(t, [ref(i) for i in range(len(SIZES))], values)
        assert t.used >= sum(SIZES)
        # Read back in reverse order into slices of one caller region, a guard between each:
        # a read fills exactly its buffer.
        guard = 64
        region = bytearray(b"\x5a") * (sum(SIZES) + guard * (len(SIZES) + 1))
        view, spans, pos = memoryview(region), [], guard
        for n in reversed(SIZES):
            spans.append((pos, n))
            pos += n + guard
        codes = t.read_batch(list(reversed(locs)), [view[p:p + n] for p, n in spans])
        assert codes == [Code.OK] * len(SIZES)
        for (p, n), v in zip(spans, reversed(values), strict=True):
            assert bytes(region[p:p + n]) == v
            assert region[p - guard:p] == b"\x5a" * guard
        assert region[-guard:] == b"\x5a" * guard

    def test_the_largest_object_fits_and_one_byte_more_does_not(self, case: TierCase) -> None:
        t = case.tier
        big = data(case.max_size, 1)
        [loc] = put(t, [ref(1)], [big])
        assert get(t, [loc]) == ([Code.OK], [big])
        assert t.reserve([ref(2)], [1]) == [None]  # full
        t.free([loc])
        assert t.used == 0
        assert t.reserve([ref(3)], [case.max_size + 1]) == [None]
        assert t.used == 0

    def test_empty_batches(self, case: TierCase) -> None:
        t = case.tier
        assert t.reserve([], []) == []
        assert t.locate([]) == []
        assert t.write_batch([], []) == []
        assert t.read_batch([], []) == []
        t.free([])
        assert t.used == 0

    def test_a_buffer_of_another_size_is_invalid_and_zeroed(self, case: TierCase) -> None:
        t = case.tier
        v = data(5000, 2)
        [loc] = t.reserve([ref(1)], [len(v)])
        assert loc is not None
        for wrong in (v[:-1], v + b"x"):
            assert t.write_batch([loc], [memoryview(wrong)]) == [Code.INVALID]
        assert get(t, [loc]) == ([Code.NOT_FOUND], [bytes(len(v))])  # nothing was written
        assert t.write_batch([loc], [memoryview(v)]) == [Code.OK]
        for n in (len(v) - 1, len(v) + 1, 0):
            buf = bytearray(b"\xaa") * n
            assert t.read_batch([loc], [memoryview(buf)]) == [Code.INVALID]
            assert buf == bytes(n)
        assert get(t, [loc]) == ([Code.OK], [v])

    def test_unwritten_freed_and_forged_locations_are_not_found(self, case: TierCase) -> None:
        t = case.tier
        a_val, b_val = data(64 * KiB, 3), data(64 * KiB, 4)
        [a] = t.reserve([ref(1)], [len(a_val)])
        assert a is not None
        assert get(t, [a]) == ([Code.NOT_FOUND], [bytes(len(a_val))])  # reserved, never written
        assert t.write_batch([a], [memoryview(a_val)]) == [Code.OK]
        t.free([a])
        assert get(t, [a]) == ([Code.NOT_FOUND], [bytes(len(a_val))])
        assert t.write_batch([a], [memoryview(a_val)]) == [Code.NOT_FOUND]  # freed: not writable
        t.free([a])  # idempotent
        assert t.used == 0
        # Another object takes the room (an addressed tier: most likely a's very extent); a's
        # location never reads its bytes.
        [b] = put(t, [ref(2)], [b_val])
        assert get(t, [a]) == ([Code.NOT_FOUND], [bytes(len(a_val))])
        assert get(t, [b]) == ([Code.OK], [b_val])
        # Forged locations: another object's name; in an addressed tier also b's extent under
        # another serial, or a's serial or object with b's extent (a named tier has no serials).
        forged = [replace(b, ref=ref(99))]
        if not case.named:
            forged += [replace(b, serial=b.serial + 1), replace(a, offset=b.offset), replace(b, ref=a.ref)]
        for f in forged:
            assert get(t, [f]) == ([Code.NOT_FOUND], [bytes(f.size)])

    def test_capacity_exhaustion_is_no_room_and_loses_nothing(self, case: TierCase) -> None:
        t = case.tier
        size = 512 * KiB
        stored: list[tuple[Location, bytes]] = []
        for i in range(2 * CAPACITY // size):
            v = data(size, 100 + i)
            [loc] = t.reserve([ref(i)], [size])
            if loc is None:
                break
            assert t.write_batch([loc], [memoryview(v)]) == [Code.OK]
            stored.append((loc, v))
        else:
            pytest.fail("the tier never ran out of room")
        assert len(stored) >= CAPACITY // size - 1
        used = t.used
        assert used <= t.capacity
        # A batch that does not fit: per item, nothing reserved for what did not fit.
        assert t.reserve([ref(1000), ref(1001)], [size, size]) == [None, None]
        assert t.used == used
        codes, got = get(t, [loc for loc, _ in stored])
        assert codes == [Code.OK] * len(stored)
        assert got == [v for _, v in stored]
        t.free([stored[0][0]])
        [again] = t.reserve([ref(1000)], [size])
        assert again is not None
        t.free([again, *(loc for loc, _ in stored[1:])])
        assert t.used == 0

    def test_concurrent_batches_from_threads(self, case: TierCase) -> None:
        t = case.tier
        shared_values = [data(32 * KiB, 200 + i) for i in range(2)]
        shared = put(t, [ref(100_000 + i) for i in range(2)], shared_values)
        start = threading.Barrier(8)

        def worker(w: int) -> int:
            rng = random.Random(w)
            start.wait(30)
            rounds = 0
            for r in range(15):
                refs = [ref(w * 1000 + r * 10 + j) for j in range(4)]
                values = [rng.randbytes(rng.choice([0, 1, 4096, 60 * KiB])) for _ in refs]
                locs = put(t, refs, values)
                # Its own objects and the shared ones, which every thread reads at once.
                assert get(t, [*locs, *shared]) == ([Code.OK] * (len(locs) + 2), [*values, *shared_values])
                t.free(locs)
                rounds += 1
            return rounds

        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(worker, w) for w in range(8)]
            assert [f.result(timeout=120) for f in futures] == [15] * 8
        t.free(shared)
        assert t.used == 0

    def test_a_read_racing_a_free_and_reuse_never_returns_the_new_bytes(self, case: TierCase) -> None:
        """A reader holding a location while another thread frees it and writes another object
        in its room gets the old object or a failure (buffer zeroed): never the newcomer."""
        t = case.tier
        size = 64 * KiB
        old, new = data(size, 30), data(size, 31)
        current = put(t, [ref(1)], [old])
        stop = threading.Event()
        seen: list[tuple[Code, bool]] = []

        def reader() -> None:
            buf = bytearray(size)
            while not stop.is_set() and len(seen) < 5000:
                [code] = t.read_batch(current, [memoryview(buf)])
                seen.append((code, bytes(buf) == (old if code == Code.OK else bytes(size))))

        thread = threading.Thread(target=reader)
        thread.start()
        try:
            for i in range(200):
                t.free(current)
                other = put(t, [ref(2 + i % 2)], [new])  # most likely in the room just freed
                current[:] = put(t, [ref(1)], [old])
                t.free(other)
        finally:
            stop.set()
            thread.join(30)
        assert not thread.is_alive()
        assert seen and all(ok for _, ok in seen), [c for c, ok in seen if not ok][:5]

    @pytest.mark.parametrize("where", ["first", "middle", "last"])
    def test_a_damaged_byte_is_detected_not_served(self, case: TierCase, where: str) -> None:
        t = case.tier
        values = [data(64 * KiB, 10 + i) for i in range(3)]
        locs = put(t, [ref(i) for i in range(3)], values)
        stored = locs[1].size + (32 if case.sealed else 0)  # bytes on the medium (a sealed blob's)
        case.damage(locs[1], {"first": 0, "middle": stored // 2, "last": stored - 1}[where])
        codes, got = get(t, locs)
        assert codes == [Code.OK, Code.CHECKSUM, Code.OK]
        assert got == [values[0], bytes(len(values[1])), values[2]]

    def test_another_tenant_object_or_key_cannot_read_a_sealed_object(self, case: TierCase) -> None:
        if not case.sealed:
            pytest.skip("a tier in the clear has no key: the store's index (and the tenant's salt in a "
                        "shared-fs file name) keeps tenants apart")
        t = case.tier
        v = data(64 * KiB, 5)
        [loc] = put(t, [ref(1)], [v])
        # The same bytes at the same place, asked for as another tenant's, another kind, another
        # generation: the tag binds them to the one object they were sealed as.
        # (An addressed tier refuses a location that names another object before reading it;
        # the shared filesystem finds the same file under the same salt and key and reads it.)
        for other in (replace(loc, ref=replace(loc.ref, tenant="b")), replace(loc, ref=replace(loc.ref, kind=1)),
                      replace(loc, generation=loc.generation ^ 1)):
            codes, got = get(t, [other])
            assert codes[0] in (Code.CHECKSUM, Code.NOT_FOUND)
            assert got == [bytes(len(v))]
        if case.named:
            assert get(t, [replace(loc, ref=replace(loc.ref, tenant="b"))])[0] == [Code.CHECKSUM]  # the tag
        # Another master key (another pool, or a key dropped after rotation) opens nothing.
        other_key = case.under_other_key()
        assert get(other_key, [loc]) == ([Code.CHECKSUM], [bytes(len(v))])
        assert other_key.counters["at_rest_auth_failures"] == 1
        assert get(t, [loc]) == ([Code.OK], [v])
        # Rotated: the old key is a previous one, still opened (and counted as such).
        assert isinstance(t, SealedTier)
        t.at_rest.set_keys(OTHER_MASTER, [MASTER])
        assert get(t, [loc]) == ([Code.OK], [v])
        assert t.counters["at_rest_previous_key_opens"] == 1

    def test_the_next_life_of_the_tier(self, case: TierCase) -> None:
        values = [data(n, 20 + n) for n in (0, 1, 100 * KiB)]
        refs = [ref(i) for i in range(len(values))]
        old = put(case.tier, refs, values)
        t = case.new_life()
        if case.named:
            # The shared filesystem keeps its files: found by their header, byte-exact.
            found = t.locate(refs)
            assert [loc is not None and loc.size for loc in found] == [len(v) for v in values]
            assert get(t, [loc for loc in found if loc is not None]) == ([Code.OK] * len(values), values)
            assert t.locate([ref(99)]) == [None]
        else:
            # An addressed tier starts empty: nothing is found, no location of the last life reads.
            assert t.used == 0
            assert t.locate(refs) == [None] * len(refs)
            codes, got = get(t, old)
            assert codes == [Code.NOT_FOUND] * len(old)
            assert got == [bytes(len(v)) for v in values]


@pytest.fixture(params=[k for k in KINDS if k.startswith("sharedfs")])
def named(request: pytest.FixtureRequest, tmp_path: Path) -> TierCase:
    return make_case(str(request.param), tmp_path)


def _poke(path: str, at: int, value: bytes) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, value, at)
    finally:
        os.close(fd)


class TestSharedFsFilesOfOtherLives:
    """What only a named tier has: files written by other nodes and previous lives, trusted by
    their header and nothing else."""

    @pytest.mark.parametrize(("field", "at", "code"), [("magic", 0, Code.CHECKSUM), ("version", 4, Code.CHECKSUM),
                                                      ("kind", 6, Code.NOT_FOUND), ("size", 8, Code.CHECKSUM)])
    def test_a_damaged_header_is_neither_located_nor_read(self, named: TierCase, field: str, at: int,
                                                          code: Code) -> None:
        v = data(10 * KiB, 7)
        [loc] = put(named.tier, [ref(1)], [v])
        base = named.tier.inner if isinstance(named.tier, SealedTier) else named.tier
        assert isinstance(base, SharedFsTier)
        _poke(base.path_for(loc.ref.salt, loc.ref.key), at, b"\x7f")
        t = named.new_life()
        assert t.locate([ref(1)]) == [None]
        assert get(t, [loc]) == ([code], [bytes(len(v))])

    def test_a_file_in_the_clear_and_a_sealed_file_are_each_found_by_their_own_kind_only(
            self, tmp_path: Path) -> None:
        plain, sealed = make_case("sharedfs", tmp_path).tier, make_case("sharedfs-sealed", tmp_path).tier
        a, b = data(3000, 8), data(3000, 9)
        [pa] = put(plain, [ref(1)], [a])
        [sb] = put(sealed, [ref(2)], [b])
        assert [x is not None for x in plain.locate([ref(1), ref(2)])] == [True, False]
        assert [x is not None for x in sealed.locate([ref(1), ref(2)])] == [False, True]
        # A sealed reader does not trust a file in the clear (anyone with the mount could have
        # planted it), and a reader in the clear has no key for a sealed one.
        assert get(sealed, [replace(pa, sealed=True)]) == ([Code.NOT_FOUND], [bytes(len(a))])
        assert get(plain, [replace(sb, size=len(b) + OVERHEAD, sealed=False)])[0] == [Code.NOT_FOUND]

    def test_a_stale_generation_is_not_found_and_a_fresh_locate_reads(self, tmp_path: Path) -> None:
        one = make_case("sharedfs-sealed", tmp_path)
        other = make_case("sharedfs-sealed", tmp_path)  # another node on the same mount
        v = data(5000, 10)
        [first] = put(one.tier, [ref(1)], [v])
        [found] = other.tier.locate([ref(1)])
        assert found == first
        put(one.tier, [ref(1)], [v])  # written again: a new generation
        assert get(other.tier, [found]) == ([Code.NOT_FOUND], [bytes(len(v))])
        [again] = other.tier.locate([ref(1)])
        assert again is not None and get(other.tier, [again]) == ([Code.OK], [v])

    def test_the_file_format_is_the_store_nodes(self, tmp_path: Path) -> None:
        """A file is its header (magic ``KVPF``, version, kind, size, then the payload's checksum
        in the clear or the generation when sealed) and its payload: files of earlier nodes on
        the mount stay readable, and a sealed payload opens with ``AtRest`` alone."""
        import struct

        from kvpool.core.checksum import checksum

        fs = SharedFsTier(str(tmp_path / "fs"))
        v = data(7000, 11)
        [loc] = put(fs, [ref(1)], [v])
        raw = Path(fs.path_for(SALT, ref(1).key)).read_bytes()
        assert struct.unpack("<4sHHQQ", raw[:HEADER_BYTES]) == (b"KVPF", 1, 0, len(v), checksum(v))
        assert raw[HEADER_BYTES:] == v
        at_rest = AtRest(MASTER)
        [s2] = put(SealedTier(fs, at_rest), [ref(2)], [v])
        raw = Path(fs.path_for(SALT, ref(2).key)).read_bytes()
        assert struct.unpack("<4sHHQQ", raw[:HEADER_BYTES]) == (b"KVPF", 2, 0, len(v), s2.generation)
        out = memoryview(bytearray(len(v)))
        assert at_rest.open_into("a", ref(2).key, 0, s2.generation, memoryview(raw[HEADER_BYTES:]), out)
        assert bytes(out) == v and loc.size == len(v)


def test_a_closed_ssd_tier_reads_nothing_even_where_its_descriptor_number_is_reused(tmp_path: Path) -> None:
    """Closing gives up the slot file's descriptor; a later call fails (UNAVAILABLE, buffer
    zeroed) instead of reading whatever file the process opens next under that number."""
    ssd = SsdTier(str(tmp_path / "ssd"), CAPACITY, "closed")
    v = data(8192, 13)
    [loc] = put(ssd, [ref(1)], [v])
    ssd.close()
    other = tmp_path / "other"
    other.write_bytes(v * 2)
    fd = os.open(other, os.O_RDWR)  # most likely the number the slot file had
    try:
        assert get(ssd, [loc]) == ([Code.UNAVAILABLE], [bytes(len(v))])
        assert ssd.write_batch([loc], [memoryview(v)]) == [Code.UNAVAILABLE]
        assert other.read_bytes() == v * 2
    finally:
        os.close(fd)
    ssd.close()  # twice: nothing more to do
