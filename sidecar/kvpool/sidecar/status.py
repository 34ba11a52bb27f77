"""What a sidecar tells about itself: its greeting (fixed for a life) and its stats (a snapshot).

Plain values, built by the composition (:class:`kvpool.sidecar.server.Sidecar`) and turned into
replies by both front ends (:mod:`kvpool.sidecar.grpc_server`, :mod:`kvpool.sidecar.session_server`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.sidecar.estimates import ReadEstimates


@dataclass(frozen=True)
class Greeting:
    """What a client learns at HELLO that stays the same for this sidecar's life."""

    tenant_id: str
    arena_path: str
    arena_bytes: int
    incarnation: int
    """This life's id: a client holding another's leases, reservations or offsets is refused."""
    arena_generation: int
    """The arena's id (new whenever its files are created anew; 0 for an arena without a journal)."""
    handoff_address: str
    """The transfer port exporting state objects ("" : none)."""
    instance_id: str
    """Names this sidecar in handoff records (a record of its own state is served locally)."""


@dataclass(frozen=True)
class Stats:
    """A snapshot of counters and gauges (``Stats``; the scrape-time metrics read the same)."""

    counters: dict[str, int]
    local_capacity_bytes: int
    local_used_bytes: int
    local_objects: int
    ring_epoch: int
    pool_nodes_up: int
    pending_pool_bytes: int
    reads: ReadEstimates
    """Measured pool/local read bandwidth and match time (the engines' fetch-or-recompute inputs)."""
