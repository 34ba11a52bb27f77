"""The sidecar (`kvpool sidecar`): a composition of its parts, serving one engine's client.

It owns the local tier (a shared-memory arena the client maps), asks the pool for what is not
local (one batched call per owner, all owners concurrently), fetches misses straight into the
arena, and writes through to the pool in the background (or back, on local eviction).  The
tenant and its token come from the command line / mounted credentials, never from the client.

The parts, each told only what it needs:

* :class:`~kvpool.sidecar.local_tier.LocalTier` — the arena, its index, leases and journal;
* :class:`~kvpool.pool.fanout.Pool` — the store nodes, the ring and its refresh;
* :class:`~kvpool.sidecar.reads.Reads` — match and read (:class:`~kvpool.sidecar.fetch.Fetcher`:
  the pool rounds; :mod:`kvpool.sidecar.landing`: where fetched bytes go);
* :class:`~kvpool.sidecar.puts.Puts` — reserve and commit; :class:`~kvpool.sidecar.writer.Writer`
  — the write-behind engine; :func:`kvpool.sidecar.flush.flush` — the drain at SIGTERM;
* :class:`~kvpool.sidecar.copyover.CopyOver`, :class:`~kvpool.sidecar.handoff.HandoffService`;
* the front ends: :mod:`kvpool.sidecar.grpc_server` and :mod:`kvpool.sidecar.session_server`.

The process around it (arguments, signals, READY/FLUSHED lines): :mod:`kvpool.sidecar.main`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import grpc

from kvpool.core.retry import UNREACHABLE
from kvpool.core.traffic import traffic_class_or_default
from kvpool.pool.fanout import Pool
from kvpool.sidecar import flush, grpc_server, journal, metrics
from kvpool.sidecar.config import SidecarConfig
from kvpool.sidecar.copyover import CopyOver
from kvpool.sidecar.fetch import Fetcher
from kvpool.sidecar.handoff import HandoffService
from kvpool.sidecar.journal import PersistentArena
from kvpool.sidecar.landing import SpillStash
from kvpool.sidecar.local_tier import LocalEntry, LocalTier
from kvpool.sidecar.puts import Puts
from kvpool.sidecar.reads import Reads
from kvpool.sidecar.session_server import FastSessionServer
from kvpool.sidecar.status import Greeting, Stats
from kvpool.sidecar.writer import PIN_MS, Writer
from kvpool.wire.counters import SidecarCounter
from kvpool.wire.kv_events import MEDIUM_LOCAL, EventPublisher
from kvpool.wire.metrics_http import MetricsServer
from kvpool.wire.proto import store_pb2 as pb
from kvpool.wire.sidecar_frames import socket_path as fast_socket_path

log = logging.getLogger("kvpool.sidecar")


class Sidecar:
    """One sidecar: builds its parts, keeps the ring fresh, and starts/stops its front ends."""

    def __init__(self, cfg: SidecarConfig) -> None:
        self.cfg = cfg
        arena_dir = cfg.arena_dir or os.path.dirname(os.path.abspath(cfg.socket))
        self.incarnation = journal.new_id()
        """This life's id: a client holding another's leases, reservations or offsets is refused."""
        self.local = LocalTier(cfg.local_bytes, arena_dir, label="sidecar", socket_path=cfg.socket,
                               tenant=cfg.tenant_id)
        self.counters = self.local.counters
        self.events = EventPublisher(cfg.events, MEDIUM_LOCAL, self.local.events_snapshot) if cfg.events else None
        self.local.events = self.events
        self.pool = Pool(cfg.pool, cfg.token, transition_seconds=cfg.transition_seconds, deadlines=cfg.deadlines(),
                         backoff=cfg.suspect_backoff_ms / 1000.0, max_backoff=8 * cfg.suspect_backoff_ms / 1000.0)
        self.pool.rdma.register("sidecar-arena", self.local.arena.view)  # one-sided reads land here
        self.writer = Writer(self.local, self.pool, self.counters, cfg.tenant_id, cfg.write_back,
                             cfg.max_pending_bytes or self.local.capacity // 4, cfg.pool_write_retries,
                             yield_seconds=cfg.pool_write_yield_ms / 1000.0)
        self.local.on_evict = self.writer.on_evict
        self.pool.on_ring_change = self.writer.ring_changed
        self._stop = threading.Event()
        self._refresher = threading.Thread(target=self._refresh_loop, name="ring", daemon=True)
        self._refresher.start()
        bound = self.local.capacity // 8 if cfg.copy_over_bytes < 0 else cfg.copy_over_bytes
        self.copy_over = CopyOver(self._pin_for_copy, self._copy_to_owner, self.counters, bound) if bound else None
        self.stash = SpillStash(min(64 << 20, max(self.local.capacity, 4 << 20)))
        """Objects a read had no room for in the arena, until the client's READ_INTO takes them."""
        self.fetcher = Fetcher(self.local, self.pool, self.counters)
        self.reads = Reads(self.local, self.pool, self.fetcher, self.counters, cfg.tenant_id, cfg.lease_ms,
                           self.stash, self.copy_over.offer if self.copy_over is not None else None)
        self.puts = Puts(self.local, self.pool, self.writer, self.counters, cfg.tenant_id, cfg.write_back)
        secret = cfg.handoff_key or cfg.token.encode()
        if not secret and cfg.handoff_listen:
            log.warning("no handoff key and no tenant token: handoff records are checked for integrity, "
                        "not authenticity (give --handoff-key-file)")
        self.handoff = HandoffService(cfg, self.local, self.pool, self.reads, self.writer, self.counters, secret)
        self.adopted = self._adopt()
        self._grpc: grpc.Server | None = None
        self.metrics: MetricsServer | None = None
        """The ``/metrics`` endpoint once served (None: ``metrics_port`` 0)."""
        self._session: FastSessionServer | None = None

    @property
    def greeting(self) -> Greeting:
        arena = self.local.arena
        return Greeting(tenant_id=self.cfg.tenant_id, arena_path=arena.path, arena_bytes=self.local.capacity,
                        incarnation=self.incarnation,
                        arena_generation=arena.generation if isinstance(arena, PersistentArena) else 0,
                        handoff_address=self.handoff.address, instance_id=self.handoff.instance)

    def _adopt(self) -> dict[str, int]:
        """Keep what a previous life left in the arena (a restart): adopted objects are served
        again, and those not yet in the pool are written there as before the crash."""
        arena = self.local.arena
        opened = arena.opened if isinstance(arena, PersistentArena) else None
        if opened is not None and opened.reset_reason:
            log.warning("local tier not adopted, starting empty: %s", opened.reset_reason)
            self.counters[SidecarCounter.RESTART_ARENA_RESET] += 1
        kept, counts = self.local.adopt(self.cfg.lease_ms)
        if opened is not None and opened.adopted_from:
            log.warning("local tier adopted from a previous life: %d objects (%d bytes) kept, %d dropped "
                        "(%d failed their checksum, %d uncommitted, %d incoherent)",
                        counts[SidecarCounter.RESTART_ADOPTED_OBJECTS], counts[SidecarCounter.RESTART_ADOPTED_BYTES],
                        counts[SidecarCounter.RESTART_DROPPED_OBJECTS], counts[SidecarCounter.RESTART_DROPPED_CHECKSUM],
                        counts[SidecarCounter.RESTART_DROPPED_UNCOMMITTED],
                        counts[SidecarCounter.RESTART_DROPPED_INCOHERENT])
        if self.pool.enabled:
            # Write-through blocks the previous life had not written yet: queued again (write-back
            # blocks and state objects stay dirty: eviction and the drain hand them over).
            unsent = [e for e in kept if not e.pooled and not e.dirty]
            self.local.mark_dirty(unsent)
            if not self.cfg.write_back:
                self.writer.defer([e for e in unsent if e.kind == pb.BLOCK])
            self.counters[SidecarCounter.RESTART_RESUMED_POOL_WRITES] += sum(1 for e in kept if not e.pooled)
        return counts

    def _refresh_loop(self) -> None:
        last = time.monotonic()
        while not self._stop.is_set():
            # Match leases released with no frame to their node since: dropped now (their pins
            # hold objects against eviction until then).
            self.pool.flush_deferred(older_than=0.5)
            # Suspect nodes whose probe is due are probed even when no call goes their way.
            self.pool.probe_due()
            if self.pool.refresh_needed.wait(1.0) and not self._stop.is_set():
                try:
                    self.pool.refresh_ring()
                except Exception:
                    log.exception("ring refresh failed")
                last = time.monotonic()
            elif self.pool.enabled and (self.pool.nodes_up() < len(self.pool.nodes)
                                        or time.monotonic() - last >= self.cfg.ring_poll_seconds):
                # A node came back, or the ring changed where no reply of ours could tell (only
                # the dead node's keys were asked for, say): re-learn it now and then.
                try:
                    self.pool.refresh_ring()
                except Exception:
                    pass
                last = time.monotonic()

    # -- copy-over's two hooks -------------------------------------------------------------------

    def _pin_for_copy(self, entries: list[LocalEntry]) -> tuple[list[LocalEntry], Callable[[], None]]:
        lease = self.local.lease(entries, PIN_MS)
        return list(lease.entries), lambda: self.local.release([lease.lease_id])

    def _copy_to_owner(self, entries: list[LocalEntry]) -> list[int]:
        """One pool write per traffic class to the current owners (the copy-over worker)."""
        codes = [UNREACHABLE] * len(entries)
        groups: dict[str, list[int]] = {}
        for i, e in enumerate(entries):
            groups.setdefault(traffic_class_or_default(e.traffic_class), []).append(i)
        for tclass, sel in groups.items():
            got = self.pool.put([entries[i].key for i in sel], [self.local.view(entries[i]) for i in sel],
                                [entries[i].checksum for i in sel], tclass, pb.BLOCK)
            for i, c in zip(sel, got, strict=True):
                codes[i] = c
        return codes

    # -- what the front ends and the process ask -------------------------------------------------

    def backlog_bytes(self) -> int:
        """Bytes on their way to the pool (the metrics' gauge)."""
        return self.writer.backlog_bytes()

    def stats(self) -> Stats:
        counters = dict(self.counters)
        counters[SidecarCounter.POOL_ERRORS] = self.pool.errors
        counters[SidecarCounter.POOL_MATCH_RELEASES_SENT] = self.pool.releases_sent
        counters[SidecarCounter.POOL_MATCH_RELEASES_CARRIED] = self.pool.releases_carried
        counters[SidecarCounter.POOL_DEADLINE_MISSES] = self.pool.deadline_misses
        counters[SidecarCounter.POOL_CALLS_SKIPPED] = self.pool.calls_skipped
        counters[SidecarCounter.POOL_PROBES_OK] = self.pool.probes_ok
        counters[SidecarCounter.POOL_PROBES_FAILED] = self.pool.probes_failed
        counters[SidecarCounter.LOCAL_ONLY_OBJECTS] = len(self.local.local_only())
        counters[SidecarCounter.RING_TRANSITION] = int(self.pool.in_transition)
        counters.update(self.pool.rdma.counters())
        if self.copy_over is not None:
            counters[SidecarCounter.POOL_COPYOVER_QUEUED_BYTES] = self.copy_over.queued_bytes
        return Stats(counters=counters, local_capacity_bytes=self.local.capacity, local_used_bytes=self.local.used,
                     local_objects=self.local.objects(), ring_epoch=self.pool.ring.epoch,
                     pool_nodes_up=self.pool.nodes_up(), pending_pool_bytes=self.backlog_bytes(),
                     reads=self.reads.meter.snapshot())

    def flush(self, seconds: float) -> tuple[int, int, int]:
        """Every local-only object to the pool within ``seconds``: (flushed, bytes, dropped)."""
        return flush.flush(self.writer, self.local, seconds)

    def start(self) -> None:
        """Serve: gRPC on the socket, the fast session beside it, and the metrics if asked."""
        servicer = grpc_server.SidecarServicer(cfg=self.cfg, greeting=self.greeting, pool=self.pool,
                                               reads=self.reads, puts=self.puts, handoff=self.handoff,
                                               stats=self.stats, flush=self.flush)
        self._grpc = grpc_server.start(servicer, self.cfg.socket, self.incarnation)
        # The hot calls' binary path beside the gRPC socket (kvpool.wire.sidecar_frames).
        self._session = FastSessionServer(fast_socket_path(self.cfg.socket), self.cfg, self.reads, self.puts,
                                          self.greeting)
        self._session.start()
        self.metrics = metrics.serve(self.cfg.metrics_port, self, self.cfg.metrics_addr)

    def stop_serving(self) -> None:
        """Stop accepting calls; in-flight gRPC calls finish (briefly)."""
        if self._session is not None:
            self._session.stop()
        if self._grpc is not None:
            self._grpc.stop(grace=0.5).wait()

    def close(self) -> None:
        if self.events is not None:
            self.events.close()
        self._stop.set()
        if self.metrics is not None:
            self.metrics.close()
        self.writer.close()
        self.fetcher.close()
        self.reads.close()
        self.handoff.close()
        if self.copy_over is not None:
            self.copy_over.close()
        self.pool.close()
        self.local.close()
