"""The sidecar's put path: reserve arena extents, commit them, hand them to the pool.

A put is two calls (the client copies into the reserved extents in between): ``write_start``
reserves, ``write_commit`` publishes and hands the objects to the write-behind engine
(:class:`~kvpool.sidecar.writer.Writer`) — or, for a put that waits, writes them now and answers
the pool's verdict.  A batch larger than the free local tier streams through it (its rounds are
written to the pool in their commit, ``_commit_spilling``), and what no round has room for the
client writes to the pool straight from its own memory (``write_from``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from kvpool.core import errors
from kvpool.core.checksum import checksum
from kvpool.core.keys import KEY_BYTES
from kvpool.core.retry import UNREACHABLE
from kvpool.core.traffic import traffic_class_or_default
from kvpool.pool.fanout import Pool
from kvpool.sidecar import metrics
from kvpool.sidecar.local_tier import LocalEntry, LocalTier
from kvpool.sidecar.writer import PIN_MS, Writer, verdict
from kvpool.wire.counters import SidecarCounter
from kvpool.wire.proto import store_pb2 as pb


def take_verdict(codes: list[pb.Code], entries: Sequence[LocalEntry | None], got: dict[int, pb.Code]) -> None:
    """Answer, for each object committed here, the pool's verdict ``got`` (id(entry) → code;
    UNAVAILABLE for one without)."""
    for i, e in enumerate(entries):
        if codes[i] == pb.OK and e is not None:
            codes[i] = got.get(id(e), pb.UNAVAILABLE)


class Puts:
    """Reservations, commits and streamed writes of one sidecar; thread-safe."""

    def __init__(self, local: LocalTier, pool: Pool, writer: Writer, counters: Any, tenant_id: str,
                 write_back: bool) -> None:
        self.local, self.pool, self.writer, self.counters = local, pool, writer, counters
        self.tenant_id = tenant_id
        self.write_back = write_back
        self._lock = threading.Lock()
        self._spilling: dict[int, float] = {}
        """Reservations of a put round that left items out (guarded by ``_lock``) → when they
        lapse: written to the pool in their commit (:meth:`_commit_spilling`)."""

    def write_start(self, keys: list[bytes], sizes: list[int], kind: int,
                    traffic_class: str) -> tuple[list[pb.Code], list[LocalEntry | None], int]:
        """Reserve arena extents for a put: (codes, entries, reservation id).

        A batch larger than the free local tier (items left NO_SPACE) with a pool behind: its
        commit writes the reserved part to the pool before it answers (:meth:`write_commit`),
        so the client's next round (:meth:`Client.put`) can evict those clean copies and take
        their room — the batch streams through the tier instead of being refused."""
        self.writer.put_seen()
        codes, entries, rid = self.local.reserve(keys, sizes, kind, traffic_class_or_default(traffic_class))
        if rid and self.pool.enabled and pb.NO_SPACE in codes:
            now = time.monotonic()
            with self._lock:
                # Rounds never committed lapse with their reservation: forgotten here then.
                for old in [r for r, t in self._spilling.items() if t < now]:
                    del self._spilling[old]
                self._spilling[rid] = now + self.local.reservation_seconds
        return codes, entries, rid

    def write_commit(self, reservation_id: int, sums: list[int], pool_wait_ms: int = 0) -> list[pb.Code]:
        """Make a reservation's objects visible (and queue them for the pool): per-item codes.

        ``pool_wait_ms``: write them to the pool now and answer, for each object committed
        here, the pool's verdict (:meth:`Writer.write_waited`) instead of the local tier's."""
        t0 = time.perf_counter()
        self.writer.put_seen()
        entries = self.local.reservation_entries(reservation_id)
        if entries is None:
            return [pb.LEASE_EXPIRED] * len(sums)
        if len(sums) != len(entries):
            raise errors.InvalidArgument(f"{len(sums)} checksums for {len(entries)} items")
        for i, e in enumerate(entries):
            if e is not None and not sums[i]:
                sums[i] = checksum(self.local.view(e))
        with self._lock:
            spilling = self._spilling.pop(reservation_id, None) is not None
        if spilling:
            return self._commit_spilling(reservation_id, entries, sums, t0, pool_wait_ms > 0)
        kind_state = any(e is not None and e.kind == pb.STATE for e in entries)
        # State objects are single-copy host-memory objects: only flushed on drain/eviction.
        dirty = self.write_back or kind_state or not self.pool.enabled
        through = self.pool.enabled and not dirty
        waited = pool_wait_ms > 0 and self.pool.enabled
        codes, done, pin = self.local.commit(reservation_id, sums, dirty=dirty and self.pool.enabled,
                                             pin_ms=PIN_MS if through or waited else 0)
        if pool_wait_ms > 0:
            # The pool's verdict was asked for; with no pool there is none to take the objects.
            got = self.writer.write_waited(done, pin, pool_wait_ms / 1000.0) if pin is not None and waited else {}
            take_verdict(codes, entries, got)
        elif pin is not None:
            self.writer.enqueue(done, pin=pin)
        self._count(done, t0)
        return codes

    def _commit_spilling(self, reservation_id: int, entries: list[LocalEntry | None], sums: list[int], t0: float,
                         wait: bool = False) -> list[pb.Code]:
        """Commit a round of a batch larger than the free local tier and write it to the pool
        now, from the arena (pinned meanwhile), on the caller's thread: when the client's next
        round asks, these are clean copies it may evict.  Whatever the write policy (the tier
        cannot keep the batch anyway); a write that failed leaves its objects local-only, handed
        over on eviction like any other (and retried, :meth:`Writer.retry_later`).  ``wait`` (a
        put with wait): the codes of the objects committed are the pool's."""
        codes, done, pin = self.local.commit(reservation_id, sums, dirty=True, pin_ms=PIN_MS)
        pool_codes = self.writer.push_pinned(done, pin, "a spilling put")
        self.writer.retry_later(done, None, pool_codes)
        if wait:
            take_verdict(codes, entries, verdict(pool_codes))
        self.counters[SidecarCounter.PUT_SPILLED_ROUNDS] += 1
        self._count(done, t0)
        return codes

    def _count(self, done: list[LocalEntry], t0: float) -> None:
        self.counters[SidecarCounter.PUT_BLOCKS] += len(done)
        metrics.record_put(self.tenant_id, sum(e.size for e in done), time.perf_counter() - t0)

    def write_from(self, keys: list[bytes], srcs: Sequence[memoryview], sums: list[int], kind: int,
                   traffic_class: str) -> list[int]:
        """Write objects to the pool straight from the client's memory (fast session WRITE_FROM:
        the part of a put the local tier had no room for, everything in it pinned), on the
        caller's thread: per-item pool codes (OK for one the pool holds already; NO_SPACE where
        no owner could be reached — no copy is left here to try again with)."""
        if not self.pool.enabled:
            return [pb.NO_SPACE] * len(keys)
        todo = [i for i, (k, v) in enumerate(zip(keys, srcs, strict=True)) if len(k) == KEY_BYTES and v.nbytes]
        codes: list[int] = [pb.INVALID] * len(keys)
        for i in todo:
            if not sums[i]:
                sums[i] = checksum(srcs[i])
        got = self.pool.put([keys[i] for i in todo], [srcs[i] for i in todo], [sums[i] for i in todo],
                            traffic_class_or_default(traffic_class), kind) if todo else []
        for i, c in zip(todo, got, strict=True):
            codes[i] = pb.OK if c in (pb.OK, pb.ALREADY_EXISTS) else pb.NO_SPACE if c == UNREACHABLE else c
        ok = sum(1 for c in codes if c == pb.OK)
        self.counters[SidecarCounter.PUT_STREAMED] += ok
        self.counters[SidecarCounter.POOL_WRITES] += ok
        return codes

    def remove(self, keys: list[bytes], kind: int) -> list[pb.Code]:
        """Drop objects from the local tier (the pool keeps its copies): per-item codes."""
        return self.local.remove(keys, kind)
