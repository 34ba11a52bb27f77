"""Per-call deadlines of the calls an engine waits for (pure; no I/O).

A hung store node (SIGSTOP, a long GC pause, a stuck disk) must cost an engine's call one
deadline at most, never the transport's generic timeout.  Lookups (match, exists) have a fixed,
tight bound; a read's bound grows with the bytes it moves: a base for the round trip plus the
payload at a conservative bandwidth floor, so a large read of a healthy node is never cut while
a node that stopped sending is given up on quickly.  The data session arms these on its sockets
(:mod:`kvpool.pool.data_client`), the sidecar's pool waits with them (:mod:`kvpool.pool.fanout`).
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_SECONDS = 0.001
"""The smallest timeout armed on a socket (0 would mean "block forever" to the kernel)."""


@dataclass(frozen=True)
class Deadlines:
    """The deadlines of a sidecar's calls to store nodes (``kvpool sidecar --match-deadline-ms``
    and friends; the KVPool's ``spec.deadlines``)."""

    match_seconds: float = 0.1
    """A match or exists at one node: the node looks keys up in memory, so ~100 ms is already
    hundreds of times its normal answer."""
    read_base_seconds: float = 0.1
    """The part of a read's deadline that does not depend on its size (the round trip, the
    node's lookup, a disk read's latency)."""
    read_bytes_per_second: float = 100e6
    """The bandwidth floor a read's payload is given time for (100 MB/s: a twelfth of 10 GbE);
    0 gives payloads no extra time."""
    probe_seconds: float = 1.0
    """How long a probe of a suspect node waits for its answer (in the background, beside the
    engine's calls: a slow but live node is let back in)."""

    def __post_init__(self) -> None:
        for name in ("match_seconds", "read_base_seconds", "probe_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"deadline {name} must be > 0, got {getattr(self, name)!r}")
        if self.read_bytes_per_second < 0:
            raise ValueError(f"read_bytes_per_second must be >= 0, got {self.read_bytes_per_second!r}")

    def read_seconds(self, nbytes: int) -> float:
        """The deadline of a read that moves ``nbytes`` of payload."""
        return read_seconds(nbytes, self.read_base_seconds, self.read_bytes_per_second)


def read_seconds(nbytes: int, base: float, bytes_per_second: float) -> float:
    """``base`` + ``nbytes`` at ``bytes_per_second`` (no extra time when that is 0)."""
    extra = nbytes / bytes_per_second if bytes_per_second > 0 and nbytes > 0 else 0.0
    return max(base + extra, MIN_SECONDS)


def remaining(deadline: float, now: float) -> float:
    """Seconds left until the monotonic ``deadline`` (at least :data:`MIN_SECONDS`: a call past
    its deadline still gets to collect an answer that is already there)."""
    return max(deadline - now, MIN_SECONDS)


@dataclass(frozen=True)
class ClientDeadlines:
    """How long a :class:`kvpool.Client` call waits for its sidecar at most (``Client(deadlines=)``).

    These are the engine's safety net: the sidecar bounds its own calls to the store nodes much
    tighter (:class:`Deadlines`), so a healthy sidecar answers well within them even with a store
    node hung.  A call past its bound raises :class:`~kvpool.core.errors.DeadlineExceeded`; the
    connection it used is dropped (its stream may be out of step) and the next call opens another.
    """

    match_seconds: float = 0.8
    """``match`` / ``match_lease`` (the sidecar's own lookups in the pool take ~0.1 s at most)."""
    read_seconds: float = 0.8
    """``get`` / ``get_into``: the base (the sidecar may fetch the batch from the pool first)."""
    read_bytes_per_second: float = 100e6
    """``get_into``'s bound grows by its buffers' bytes at this rate (``get`` does not know its
    bytes before the answer: reads of more than ~50 MB with ``get`` want a larger base)."""
    write_seconds: float = 0.8
    """``put``'s reservation, and a commit the sidecar answers from its local tier; a commit that
    waits for the pool (``wait=True``, or a round of a batch larger than the local tier) has
    ``other_seconds``."""
    other_seconds: float = 30.0
    """Everything else (stats, flush, handoff): the client's ``timeout``."""

    def read_bound(self, nbytes: int = 0) -> float:
        """The bound of a read of ``nbytes`` (0: not known)."""
        return read_seconds(nbytes, self.read_seconds, self.read_bytes_per_second)

    def __post_init__(self) -> None:
        for name in ("match_seconds", "read_seconds", "read_bytes_per_second", "write_seconds", "other_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"client deadline {name} must be > 0, got {getattr(self, name)!r}")
