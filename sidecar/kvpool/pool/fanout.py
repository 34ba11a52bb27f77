"""The sidecar's view of the pool: the ring, one client per store node, batched fan-out.

Keys are grouped by owner with numpy (no Python loop over keys for routing); each owner gets one
batched call and all owners are asked concurrently, over each node's data session (one round trip
per read, put or exists; :mod:`kvpool.pool.data_client`).  A node that is unreachable is marked
down for a short backoff and its keys become misses: the engine never sees a pool error, and
never wrong bytes.

Deadlines (:class:`~kvpool.core.deadlines.Deadlines`): every exists and read to a node has one (about
100 ms for a lookup; a read's grows with its bytes), armed on the node's data connection, so a
hung node holds no thread longer than that, and its answer is waited for no longer either: the
other nodes' answers are used without it.  A node that misses a deadline
or cannot be reached is suspect (:mod:`kvpool.core.breaker`): later calls skip it at once —
its keys are misses, or are read at the other replicas through the fallback routes — and a probe
on the pool's threads (one at a time per node) lets it back in when it answers.

Reads that miss at a key's owner look further, in one more batched round: at a draining member
(always), and during a ring transition (``transition_seconds`` after a ring change) at the
lower-ranked owners and the owners of earlier epochs: on scale-up objects reach their new owner
only gradually (copied over by such reads, :mod:`kvpool.sidecar.copyover`, and pushed by the
previous owners' warm-up, :mod:`kvpool.store.warm`).
A node that answers for a newer epoch makes the pool learn that ring in the background, and the
calls route once more when it is there (:mod:`kvpool.pool.routing`: one rule for every call).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from kvpool.core import breaker, errors, ranges
from kvpool.core.deadlines import Deadlines, remaining
from kvpool.core.retry import UNREACHABLE
from kvpool.core.ring import Member, Ring
from kvpool.pool import lookup
from kvpool.pool.data_client import Dest, ExistsReply, PendingExists, ReadResult
from kvpool.pool.leases import MatchLeases
from kvpool.pool.lookup import PoolMatch
from kvpool.pool.node_client import StoreClient
from kvpool.pool.rdma_path import LocalRdma
from kvpool.pool.routing import RingView, Routes, merge_replica_codes, rounds, write_routes
from kvpool.wire.convert import ring_from_pb
from kvpool.wire.proto import store_pb2 as pb

log = logging.getLogger("kvpool.pool.fanout")


@dataclass
class NodeHandle:
    member: Member
    client: StoreClient
    health: breaker.Health = field(default_factory=breaker.Health)
    """The node's circuit breaker (changed under ``Pool.lock``)."""

    @property
    def up(self) -> bool:
        return breaker.is_up(self.health)


_DOWN_STATUSES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                  grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


def node_is_down(exc: BaseException) -> bool:
    """Whether a failed call means the node is unreachable (back off from it) rather than that
    it refused this request (a bad argument, a missing token: the node is fine)."""
    if isinstance(exc, grpc.RpcError):
        return exc.code() in _DOWN_STATUSES if hasattr(exc, "code") else True
    if isinstance(exc, errors.KvpoolError):
        return isinstance(exc, errors.Unavailable) or type(exc) is errors.KvpoolError
    return True  # transport errors (OSError, a closed engine)


def newest_ring(known: dict[str, StoreClient], seeds: Sequence[str], token: str) -> Ring | None:
    """The ring of the newest epoch the nodes of ``known`` and of ``seeds`` (clients made for
    this call) answer GetRing with, all asked concurrently; None when none answers."""
    temp = {a: StoreClient(a, token, timeout=2.0) for a in seeds}
    best: Ring | None = None
    try:
        calls = [c.get_ring_future(2.0) for c in {**known, **temp}.values()]
        for fut in calls:
            try:
                ring = ring_from_pb(fut.result())
            except (grpc.RpcError, errors.KvpoolError):
                continue
            if best is None or ring.epoch > best.epoch:
                best = ring
    finally:
        for c in temp.values():
            c.close()
    return best


class Pool:
    """Membership + per-node clients, thread-safe."""

    def __init__(self, seeds: Sequence[str], token: str = "", backoff: float = 1.0,
                 rpc_timeout: float = 5.0, history_depth: int = 3, transition_seconds: float = 600.0,
                 fallback_ranks: int = 2, deadlines: Deadlines | None = None,
                 max_backoff: float = 8.0) -> None:
        self.seeds = [s for s in seeds if s]
        self.token = token
        self.policy = breaker.Policy(backoff, max(backoff, max_backoff))
        """The circuit breaker's back-off after a failed probe (doubling up to the max)."""
        self.deadlines = deadlines or Deadlines()
        self.rpc_timeout = rpc_timeout
        self.lock = threading.Lock()
        self.nodes: dict[str, NodeHandle] = {}
        self._executor = ThreadPoolExecutor(max_workers=16, thread_name_prefix="pool")
        self.view = RingView(self.refresh_ring, self._executor.submit, history_depth, transition_seconds,
                             fallback_ranks)
        """The ring, the rings before it, routing and catching up (:mod:`kvpool.pool.routing`)."""
        self.refresh_needed = self.view.refresh_needed
        self.errors = 0
        self.deadline_misses = 0
        """Calls to a node given up at their deadline (the node was hung or slow)."""
        self.calls_skipped = 0
        """Calls not sent because their node was suspect (its keys were misses or read elsewhere)."""
        self.probes_ok = 0
        self.probes_failed = 0
        self.leases = MatchLeases(self._up, self.nodes.get, self._executor.submit,
                                  lambda: self.deadlines.probe_seconds)
        """Match leases released and not dropped yet (:mod:`kvpool.pool.leases`)."""
        self.on_ring_change: Callable[[Ring], None] | None = None
        """Called (outside the lock) after the ring moved to a newer epoch."""
        self.rdma = LocalRdma()
        """This process's RDMA device ($KVPOOL_RDMA) and the counters of the nodes' RDMA reads."""
        if self.seeds:
            self.refresh_ring()

    @property
    def enabled(self) -> bool:
        return bool(self.seeds)

    # -- membership ---------------------------------------------------------------------------

    def refresh_ring(self) -> bool:
        """Learn the newest ring any reachable node knows (all asked concurrently); without an
        operator (epoch 0) the seeds are the membership, named by their addresses."""
        with self.lock:
            nodes = list(self.nodes.values())
        # Suspect nodes are not asked (a hung one would hold this for the whole timeout) unless
        # no node is up.
        live = [n for n in nodes if n.up] or nodes
        held = {n.member.address for n in nodes}
        best = newest_ring({n.member.address: n.client for n in live},
                           [a for a in self.seeds if a not in held], self.token)
        if best is None or best.epoch == 0 or not best.members:
            if self.ring.epoch > 0:
                return False  # nobody answered: keep what we know
            best = Ring(epoch=0, members=tuple(Member(a, a) for a in self.seeds))
        self.set_ring(best)
        return True

    @property
    def ring(self) -> Ring:
        return self.view.ring

    def set_ring(self, ring: Ring) -> None:
        with self.lock:
            if ring.epoch < self.view.ring.epoch:
                return
            # The ring's nodes first, then the ring: whoever routes by it the moment it is
            # accepted (a writer that catch_up wakes, without this lock) finds a client for every
            # member; before, a new member had none yet and its share of the write failed as
            # UNREACHABLE, waiting for a backoff (more often over TLS, whose clients take longer
            # to make and start their connections in a thread).
            for m in ring.members:
                self._node_for(m)
            changed = self.view.accept(ring)
            keep = self.view.members_to_keep()
            for m in keep.values():
                self._node_for(m)
            for mid in [i for i in self.nodes if i not in keep]:
                self.nodes.pop(mid).client.close()
        if changed and self.on_ring_change is not None:
            self.on_ring_change(ring)

    def _node_for(self, m: Member) -> None:
        """A handle of member ``m`` (under the lock): the one known, or a new client when ``m``
        is new or moved to another address (over TLS its connections start opening now)."""
        h = self.nodes.get(m.id)
        if h is not None and h.member.address == m.address:
            h.member = m
            return
        if h is not None:
            h.client.close()
        client = StoreClient(m.address, self.token, timeout=self.rpc_timeout, rdma=self.rdma)
        self.nodes[m.id] = NodeHandle(m, client)
        if client.tls is not None:
            _open_in_background(client)

    def _note_epoch(self, epoch: int) -> None:
        self.view.note_epoch(epoch)

    @property
    def catch_up_seconds(self) -> float:
        """How long a call on the engine's path waits for a newer ring a node named, being
        learnt in the background: one lookup's deadline (then it sheds, :mod:`kvpool.pool.routing`)."""
        return self.deadlines.match_seconds

    def catch_up(self, routed_epoch: int | None = None, wait_seconds: float = 0.0) -> bool:
        """:meth:`RingView.catch_up`: whether the caller routes again (the ring moved since it
        routed by ``routed_epoch``); waits for a newer ring at most ``wait_seconds`` (default:
        not at all — the engine's path sheds rather than blocks)."""
        return self.view.catch_up(routed_epoch, wait_seconds)

    def _failed(self, node: NodeHandle, exc: BaseException) -> None:
        down = node_is_down(exc)
        with self.lock:
            self.errors += 1
            if isinstance(exc, errors.DeadlineExceeded):
                self.deadline_misses += 1
            was_up = node.up
            if down:
                node.health = breaker.on_failure(node.health, time.monotonic(), self.policy)
        if not down:
            log.warning("pool node %s refused a call: %s", node.member.id, exc)
            return
        self.leases.forget(node.member.id)  # it may come back as another life: never sent there
        if was_up:
            log.warning("pool node %s is suspect (calls skip it until a probe answers): %s", node.member.id, exc)
        self._admit(node, False)  # the first probe goes out at once

    def _answered(self, node: NodeHandle) -> None:
        """A call to ``node`` was answered: a suspect node is healthy again."""
        if not node.up:
            with self.lock:
                node.health = breaker.on_success(node.health)

    def _up(self, nid: str) -> NodeHandle | None:
        """The node ``nid`` if a call may go to it now; None when it is unknown or suspect (a
        probe is started when one is due: the call itself never waits for a suspect node)."""
        node = self.nodes.get(nid)
        if node is None:
            return None
        return node if node.up or self._admit(node, True) else None

    def _admit(self, node: NodeHandle, call: bool) -> bool:
        """Whether a call (``call``; else the background loop) may go to a node that was not up;
        starts its probe when one is due."""
        with self.lock:
            verdict = breaker.admit(node.health, time.monotonic())
            if verdict is breaker.Admission.CALL:
                return True
            if call:
                self.calls_skipped += 1
            if verdict is breaker.Admission.PROBE:
                node.health = breaker.probe_started(node.health)
        if verdict is breaker.Admission.PROBE:
            try:
                self._executor.submit(self._probe, node)
            except RuntimeError:  # shut down
                pass
        return False

    def _probe(self, node: NodeHandle) -> None:
        """One small call to a suspect node, on the pool's threads (bounded by the probe
        deadline): it is let back in when it answers."""
        try:
            epoch = node.client.probe(self.deadlines.probe_seconds)
        except Exception as exc:  # noqa: BLE001 - any failure keeps it suspect
            with self.lock:
                self.probes_failed += 1
                node.health = breaker.on_failure(node.health, time.monotonic(), self.policy, probe=True)
            log.debug("probe of pool node %s failed: %s", node.member.id, exc)
            return
        with self.lock:
            self.probes_ok += 1
            node.health = breaker.on_success(node.health)
        log.warning("pool node %s answered a probe: calls go to it again", node.member.id)
        self._note_epoch(epoch)

    def probe_due(self) -> None:
        """Start the probes that are due (the sidecar's background loop calls this, so a node is
        let back in even when no call goes its way)."""
        for node in list(self.nodes.values()):
            if not node.up:
                self._admit(node, False)

    def nodes_up(self) -> int:
        return sum(1 for n in self.nodes.values() if n.up)

    # -- routing ------------------------------------------------------------------------------

    def route(self, key_array: npt.NDArray[Any]) -> Routes:
        return self.view.route(key_array)

    def fallbacks(self, key_array: npt.NDArray[Any], kind: int = pb.BLOCK) -> list[Routes]:
        return self.view.fallbacks(key_array, kind)

    @property
    def in_transition(self) -> bool:
        return self.view.in_transition

    def rounds(self, key_array: npt.NDArray[Any], kind: int,
               missing: Callable[[], npt.NDArray[np.bool_]]) -> Iterator[tuple[bool, Routes]]:
        """The rounds of a lookup or read of ``key_array`` (:func:`kvpool.pool.routing.rounds`),
        a newer ring waited for at most :attr:`catch_up_seconds`."""
        return rounds(self.view, key_array, kind, missing, self.catch_up_seconds)

    def exists_many(self, key_array: npt.NDArray[Any], calls: Sequence[tuple[str, npt.NDArray[np.intp], bool]],
                    prefix_only: bool, lease_ms: int, kind: int = pb.BLOCK
                    ) -> list[tuple[str, npt.NDArray[np.intp], ExistsReply | None]]:
        """One batched exists per (node, indices, pin), all concurrently; None where it failed."""
        # The requests go out to every node first and the answers are collected after, on this
        # thread: one send and one receive per node, no thread handoff (the pool's threads cost
        # more than a 2048-key EXISTS on a busy machine).
        # One deadline for the whole round: each answer is waited for with what is left of it, so
        # hung nodes cost the round one deadline together, not one each.
        limit = self.deadlines.match_seconds
        deadline = time.monotonic() + limit
        # Each call keeps the handle it was sent to: a ring refresh meanwhile (``_note_epoch`` below)
        # may drop or replace the node's entry in ``self.nodes``.
        pending: list[tuple[str, npt.NDArray[np.intp], NodeHandle | None,
                            PendingExists | None]] = []
        for nid, idx, pin in calls:
            node = self._up(nid)
            if node is None:
                pending.append((nid, idx, None, None))
                continue
            args = (key_array[idx].tobytes(), pin, lease_ms if pin else 0, prefix_only, kind, self.ring.epoch)
            try:
                finish = node.client.exists_array_begin(*args, drop_lease=self.leases.take(nid), timeout=limit)
            except (grpc.RpcError, errors.KvpoolError, OSError) as exc:
                self._failed(node, exc)
                pending.append((nid, idx, None, None))
                continue
            pending.append((nid, idx, node, finish))
        # What a node's receive window did not take goes now, once every node has its request
        # started: a node slow to read holds back only its own answer.
        for _, _, _, started in pending:
            if started is not None:
                started.flush()
        out: list[tuple[str, npt.NDArray[np.intp], ExistsReply | None]] = []
        for nid, idx, node, collect in pending:
            reply = None
            if node is not None and collect is not None:
                try:
                    reply = collect(remaining(deadline, time.monotonic()))
                    self._note_epoch(reply.epoch)
                    self._answered(node)
                except (grpc.RpcError, errors.KvpoolError, OSError) as exc:
                    self._failed(node, exc)
                    reply = None
            out.append((nid, idx, reply))
        return out

    # -- match --------------------------------------------------------------------------------

    def match(self, key_array: npt.NDArray[Any], lease_ms: int) -> PoolMatch:
        """Longest prefix of ``key_array`` present in the pool, pinned (:func:`lookup.match`)."""
        return lookup.match(self, key_array, lease_ms)

    def present(self, key_array: npt.NDArray[Any], kind: int) -> npt.NDArray[np.bool_]:
        """Per-key presence in the pool (:func:`lookup.present`)."""
        return lookup.present(self, key_array, kind)

    def release(self, leases: Sequence[tuple[str, int]]) -> None:
        """Drop match leases without waiting (:meth:`MatchLeases.release`)."""
        self.leases.release(leases)

    def flush_deferred(self, older_than: float = 0.0) -> int:
        return self.leases.flush(older_than)

    @property
    def releases_sent(self) -> int:
        """Match leases dropped by a release frame of their own."""
        return self.leases.releases_sent

    @property
    def releases_carried(self) -> int:
        """Match leases dropped by a later exists or read frame to their node (no round trip)."""
        return self.leases.releases_carried

    def read(self, nid: str, key_array: npt.NDArray[Any], dest: Dest, kind: int, lease_ms: int = 0,
             drop_lease: int = 0, streams: int | None = None) -> ReadResult | None:
        """Read ``key_array`` from node ``nid`` into the memory ``dest`` hands out as each size
        becomes known (one round trip on the data session); None when the node is down or failed
        (its keys are misses: the engine never sees a pool error).  ``drop_lease``: a match lease
        at that node the read supersedes (dropped in the same round trip); ``streams``: data
        connections to cut it over (:meth:`StoreClient.read`)."""
        node = self._up(nid)
        if node is None or len(key_array) == 0:
            return None
        d = self.deadlines
        try:
            r = node.client.read(key_array.tobytes(), dest, kind, drop_lease or self.leases.take(nid), streams,
                                 d.read_base_seconds, d.read_bytes_per_second)
        except (grpc.RpcError, errors.KvpoolError, OSError, RuntimeError) as exc:
            self._failed(node, exc)
            return None
        if r.error is not None:
            # Cut in the middle: what arrived whole and verified is kept (per-item codes); the
            # node is suspect all the same.
            self._failed(node, r.error)
        else:
            self._answered(node)
        self._note_epoch(r.epoch)
        return r

    def read_ranges(self, nid: str, key_array: npt.NDArray[Any], per_key: Sequence[Any],
                    buffers: Sequence[memoryview | None], kind: int, verify_object: bool = False) -> ReadResult | None:
        """Sparse read at node ``nid``: only ``per_key[i]``'s byte ranges, into ``buffers[i]``
        (:meth:`StoreClient.read_ranges`); None when the node is down or failed."""
        node = self._up(nid)
        if node is None or len(key_array) == 0:
            return None
        nbytes = sum(ranges.total_bytes(p) for p in per_key)
        try:
            r = node.client.read_ranges(key_array.tobytes(), per_key, buffers, kind, verify_object=verify_object,
                                        timeout=self.deadlines.read_seconds(nbytes))
        except (grpc.RpcError, errors.KvpoolError, OSError, RuntimeError) as exc:
            self._failed(node, exc)
            return None
        self._answered(node)
        self._note_epoch(r.epoch)
        return r

    # -- put ----------------------------------------------------------------------------------

    def put(self, keys: list[bytes], views: list[memoryview], checksums: list[int], traffic_class: str,
            kind: int) -> list[int]:
        """Write-through of a batch to the owners, concurrently; per-item codes (UNREACHABLE
        where the owner could not be asked).  With replication R a block goes to each of its R
        owners, one batched call per node, all concurrently, and its code is the outcome over
        them (:func:`merge_replica_codes`); a state object keeps one copy, at its primary."""
        # R=1 is the same path: one owner per item, and the merge of one code is that code.
        replicas = self.ring.replicas if kind == pb.BLOCK else 1
        ids = self.view.active_ids
        per_owner: list[list[int]] = [[] for _ in keys]
        routes = write_routes(b"".join(keys), ids, replicas)
        for _, idx, got in self._put_each(routes, keys, views, checksums, traffic_class, kind):
            for i, c in zip(idx.tolist(), got, strict=True):
                per_owner[i].append(c)
        return merge_replica_codes(per_owner)

    def _put_each(self, routes: Routes, keys: list[bytes], views: list[memoryview], checksums: list[int],
                  traffic_class: str, kind: int) -> list[tuple[str, npt.NDArray[np.intp], list[int]]]:
        """One batched put per node of ``routes``, concurrently; (node, indices, per-item codes),
        UNREACHABLE for a node that is down or failed."""

        def one(nid: str, idx: npt.NDArray[np.intp]) -> tuple[str, npt.NDArray[np.intp], list[int]]:
            unreachable = (nid, idx, [UNREACHABLE] * len(idx))
            node = self._up(nid)
            if node is None:
                return unreachable
            ii = idx.tolist()
            try:
                res = node.client.put([keys[i] for i in ii], [views[i] for i in ii], traffic_class, kind,
                                      epoch=self.ring.epoch, checksums=[checksums[i] for i in ii])
            except (errors.KvpoolError, OSError, RuntimeError) as exc:
                self._failed(node, exc)
                return unreachable
            # A node at a newer epoch refuses what it no longer owns (WRONG_OWNER): the caller's
            # catch_up learns that ring from this answer and sends those items again.
            self._note_epoch(node.client.epoch_seen)
            return nid, idx, list(res)

        items = list(routes.items())
        if len(items) == 1:
            return [one(*items[0])]
        return list(self._executor.map(lambda kv: one(*kv), items))

    def close(self, timeout: float = 2.0) -> None:
        """Drop the match leases still deferred (else their pins hold objects at the nodes until
        the leases run out), wait up to ``timeout`` seconds for the drops on their way, then close
        the clients.  Best effort: a drop that fails or is late is given up (it expires)."""
        self.leases.flush()
        wait(self.leases.sending(), timeout=timeout)
        self._executor.shutdown(wait=False, cancel_futures=True)
        with self.lock:
            for n in self.nodes.values():
                n.client.close()
            self.nodes.clear()
        self.rdma.close()


def _open_in_background(client: StoreClient) -> None:
    """Open a new node's data session and its connections now, off the engine's path: over TLS a
    first call would otherwise spend its deadline (a lookup's 100 ms) on handshakes.  A node that cannot be
    reached is left to the calls (and their breaker) as before."""
    def run() -> None:
        try:
            client.session(5.0).open_idle(5.0)
        except errors.KvpoolError:
            pass
    threading.Thread(target=run, name=f"kvpool-open-{client.address}", daemon=True).start()
