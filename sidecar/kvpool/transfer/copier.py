"""Memory-to-memory copies of many (source, destination) view pairs, over two threads when big.

Used where bytes move between two mappings of this host without a socket: the client's
arena→caller copy of ``get_into``, its caller→arena copy of a put (:meth:`Copier.copy_hashed`:
each object's checksum hashed right after its copy), and the sidecar's local hits copied into a
client's registered buffers.  numpy releases the GIL while it copies, so the two threads really
copy in parallel.
"""

from __future__ import annotations

import itertools
import threading
from concurrent import futures
from typing import Any

import numpy as np

from kvpool.core.checksum import checksum

PARALLEL_COPY_BYTES = 4 << 20
"""Batches at least this large are copied by two threads (numpy releases the GIL while it
copies): one thread's memcpy of cold 1 MiB objects runs at ~6-10 GB/s here, two at ~1.7x."""
CHUNK_BYTES = 1 << 20


class Copier:
    """Copies (source, destination) view pairs; a big batch is cut into ~1 MiB chunks that the
    calling thread and one helper thread take in turn.  The caller never waits for a helper
    that has not started (a busy machine: it copies everything itself, as if alone), only for
    the one chunk a running helper holds."""

    def __init__(self) -> None:
        self._helper: futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    @staticmethod
    def _take(chunks: list[tuple[memoryview, memoryview]], turn: Any) -> None:
        n = len(chunks)
        while True:
            i = next(turn)  # itertools.count: one atomic step under the GIL
            if i >= n:
                return
            src, dst = chunks[i]
            np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))

    def copy(self, pairs: list[tuple[memoryview, memoryview]]) -> None:
        total = sum(s.nbytes for s, _ in pairs)
        if total < PARALLEL_COPY_BYTES:
            self._take(pairs, itertools.count())  # alone: every pair in turn
            return
        chunks = [(src[at:at + CHUNK_BYTES], dst[at:at + CHUNK_BYTES])
                  for src, dst in pairs for at in range(0, src.nbytes, CHUNK_BYTES)]
        turn = itertools.count()
        fut = self._helper_pool().submit(self._take, chunks, turn)
        try:
            self._take(chunks, turn)
        finally:
            if not fut.cancel():
                fut.result()

    @staticmethod
    def _take_hashed(pairs: list[tuple[memoryview, memoryview]], sums: list[int], turn: Any) -> None:
        n = len(pairs)
        while True:
            i = next(turn)
            if i >= n:
                return
            src, dst = pairs[i]
            np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))
            sums[i] = checksum(dst)  # while the copy is in cache (XXH3 holds the GIL; a copy does not)

    def copy_hashed(self, pairs: list[tuple[memoryview, memoryview]]) -> list[int]:
        """Copy each pair and return the checksum of each copy (what the destination holds).

        The unit is an object: its copy, then its hash while its bytes are still in cache.
        The hash holds the GIL and the copy does not, so with two threads one hashes while
        the other copies: the hashes hide behind the copies instead of following them (16 x
        1 MiB here: the put's copy and hash went from one after the other to side by side).
        A big batch of one object is copied in chunks by both threads and then hashed."""
        total = sum(s.nbytes for s, _ in pairs)
        sums = [0] * len(pairs)
        if total < PARALLEL_COPY_BYTES:
            self._take_hashed(pairs, sums, itertools.count())
            return sums
        if len(pairs) < 2:
            self.copy(pairs)
            return [checksum(dst) for _, dst in pairs]
        turn = itertools.count()
        fut = self._helper_pool().submit(self._take_hashed, pairs, sums, turn)
        try:
            self._take_hashed(pairs, sums, turn)
        finally:
            if not fut.cancel():
                fut.result()
        return sums

    def _helper_pool(self) -> futures.ThreadPoolExecutor:
        with self._lock:
            if self._helper is None:
                self._helper = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpool-copy")
            return self._helper

    def close(self) -> None:
        with self._lock:
            helper, self._helper = self._helper, None
        if helper is not None:
            helper.shutdown(wait=True)
