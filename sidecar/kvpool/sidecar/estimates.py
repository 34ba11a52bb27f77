"""What the sidecar measures for the engines' fetch-or-recompute rule, exported in its Stats.

Three decaying, amount-weighted averages (:class:`kvpool.core.rates.DecayingRate`):

* pool read bandwidth — bytes per second of remote fetches from the store nodes, timed around
  each read's fetch rounds (the wait for the owners and the landing of their bytes);
* local read bandwidth — bytes per second of local-tier hits copied into the client's registered
  memory (``read_into``; a plain ``read`` of a local hit copies nothing here);
* match time — seconds per match call, the fixed cost a load pays before its bytes flow.

Until enough samples exist each reports the documented prior of :mod:`kvpool.core.planning`.
Reads and matches run on many threads: one lock around the few float updates of a sample.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from kvpool.core import planning
from kvpool.core.rates import DecayingRate


@dataclass(frozen=True)
class ReadEstimates:
    """The estimates as Stats exports them (``SidecarStats.pool_read_bytes_per_s`` and beside)."""

    pool_read_bytes_per_s: float
    local_read_bytes_per_s: float
    lookup_seconds: float
    pool_read_samples: int
    local_read_samples: int
    lookup_samples: int


class ReadMeter:
    """The sidecar's read estimates; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Half-lives: 64 MiB of reads (a few large reads, or many small ones) and 32 matches.
        self._pool = DecayingRate(planning.PRIOR_POOL_READ_BYTES_PER_S, half_life=64 << 20)
        self._local = DecayingRate(planning.PRIOR_LOCAL_READ_BYTES_PER_S, half_life=64 << 20)
        self._lookup = DecayingRate(1.0 / planning.PRIOR_LOOKUP_SECONDS, half_life=32)

    def pool_read(self, nbytes: int, seconds: float) -> None:
        """``nbytes`` fetched from store nodes in ``seconds``."""
        if nbytes > 0:
            with self._lock:
                self._pool.add(nbytes, seconds, time.monotonic())

    def local_read(self, nbytes: int, seconds: float) -> None:
        """``nbytes`` of local hits copied into the client's memory in ``seconds``."""
        if nbytes > 0:
            with self._lock:
                self._local.add(nbytes, seconds, time.monotonic())

    def lookup(self, seconds: float) -> None:
        """One match call took ``seconds``."""
        with self._lock:
            self._lookup.add(1, seconds, time.monotonic())

    def snapshot(self) -> ReadEstimates:
        now = time.monotonic()
        with self._lock:
            return ReadEstimates(self._pool.rate(now), self._local.rate(now), 1.0 / self._lookup.rate(now),
                                 self._pool.samples_at(now), self._local.samples_at(now),
                                 self._lookup.samples_at(now))
