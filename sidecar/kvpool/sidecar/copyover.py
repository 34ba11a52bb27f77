"""Copy-over on read: a block found at a fallback (a previous owner) is written to its new owner.

During a ring transition a read that misses at a key's new owner finds the object at the owner
of an earlier epoch (:func:`kvpool.pool.routing.fallback_routes`); the object has just landed in
the local tier, so the sidecar hands it to the new owner, and the next reader anywhere finds it
at the first place it looks.  Off the reader's critical path: the read only offers the blocks to
a bounded queue and returns; one worker thread writes them.  It sheds rather than blocks: an
offer over the byte bound is dropped (counted), the warm-up push of the previous owner or the
next fallback read covers it.  A key queued or in flight is not queued again, and the pool put
asks the owner before sending, so what the new owner already holds costs no bytes.

Only blocks are copied: they are content-addressed and immutable, while a state object is a
single copy that its writer may be replacing at the new owner at this very moment.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.wire.counters import SidecarCounter, copyover_result
from kvpool.wire.proto import store_pb2 as pb

log = logging.getLogger("kvpool.sidecar.copyover")


@dataclass(frozen=True)
class Offer:
    """What one read offered: which blocks to queue and which to shed (pure decision)."""

    take: tuple[int, ...]
    duplicate: int
    shed: int


def admit(keys: Sequence[bytes], sizes: Sequence[int], queued: set[bytes] | frozenset[bytes],
          queued_bytes: int, max_bytes: int) -> Offer:
    """Which of the offered blocks enter the queue: not those queued or in flight already, and
    none once ``max_bytes`` would be exceeded (pure; a block larger than the bound never fits)."""
    take: list[int] = []
    seen: set[bytes] = set()
    dup = shed = 0
    total = queued_bytes
    for i, (k, size) in enumerate(zip(keys, sizes, strict=True)):
        if k in queued or k in seen:
            dup += 1
            continue
        if total + size > max_bytes:
            shed += 1
            continue
        seen.add(k)
        take.append(i)
        total += size
    return Offer(tuple(take), dup, shed)


class CopyOver:
    """The bounded queue and its writer thread.

    ``pin(entries)`` pins local-tier entries and returns (the entries still live, a release
    callable); ``put(entries)`` writes them to their owners and returns per-item store codes.
    Thread-safe: reads on many threads offer, one thread writes.
    """

    def __init__(self, pin: Callable[[list[Any]], tuple[list[Any], Callable[[], None]]],
                 put: Callable[[list[Any]], list[int]], counters: Any, max_bytes: int) -> None:
        self._pin = pin
        self._put = put
        self.counters = counters
        self.max_bytes = max_bytes
        self._cv = threading.Condition()
        self._queue: collections.deque[tuple[list[Any], Callable[[], None]]] = collections.deque()
        self._keys: set[bytes] = set()
        self.queued_bytes = 0
        self._closed = False
        self._busy = False
        self._thread = threading.Thread(target=self._loop, name="copy-over", daemon=True)
        self._thread.start()

    def offer(self, entries: Sequence[Any]) -> None:
        """Queue blocks a read found at a fallback (never blocks the reader)."""
        blocks = [e for e in entries if e.kind == pb.BLOCK]
        if not blocks or self._closed:
            return
        with self._cv:
            o = admit([e.key for e in blocks], [e.size for e in blocks], self._keys, self.queued_bytes,
                      self.max_bytes)
            self.counters[SidecarCounter.POOL_COPYOVER_SHED] += o.shed
            self.counters[SidecarCounter.POOL_COPYOVER_DUPLICATE] += o.duplicate
            if not o.take:
                return
            live, release = self._pin([blocks[i] for i in o.take])
            if not live:
                release()
                return
            self._keys.update(e.key for e in live)
            self.queued_bytes += sum(e.size for e in live)
            self.counters[SidecarCounter.POOL_COPYOVER_QUEUED] += len(live)
            self._queue.append((live, release))
            self._cv.notify()

    @property
    def idle(self) -> bool:
        with self._cv:
            return not self._queue and not self._busy

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                entries, release = self._queue.popleft()
                self._busy = True
            try:
                codes = self._put(entries)
                for c in codes:
                    self.counters[copyover_result(c)] += 1
            except Exception:  # noqa: BLE001 - best effort: the warm-up push covers what fails here
                log.exception("copy-over failed")
                self.counters[SidecarCounter.POOL_COPYOVER_FAILED] += len(entries)
            finally:
                release()
                with self._cv:
                    self._busy = False
                    self._keys.difference_update(e.key for e in entries)
                    self.queued_bytes -= sum(e.size for e in entries)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            left = list(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        for _, release in left:
            release()
