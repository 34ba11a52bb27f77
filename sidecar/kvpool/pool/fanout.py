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
A node that answers for a newer epoch makes the caller learn the ring and route once more.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from kvpool.core import breaker, errors, ranges
from kvpool.core.deadlines import Deadlines, remaining
from kvpool.core.keys import KEY_BYTES
from kvpool.core.retry import UNREACHABLE
from kvpool.core.ring import Member, Ring, owners
from kvpool.pool.data_client import Dest, ExistsReply, ReadResult
from kvpool.pool.node_client import StoreClient
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


Routes = dict[str, npt.NDArray[np.intp]]

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


@dataclass
class PoolMatch:
    prefix: int                       # global leading run of present keys (from `start`)
    leases: list[tuple[str, int]] = field(default_factory=list)  # (node id, lease id)


def group_by_owner(own: npt.NDArray[Any], ids: Sequence[str]) -> Routes:
    """Node id → ascending indices of the keys whose owner (an index into ``ids``, -1: none) it is."""
    out: Routes = {}
    if len(own) == 0 or not ids:
        return out
    if len(ids) <= 16:
        # A few members: one comparison pass each is ~5x cheaper than sorting 8192 owners.
        for j, nid in enumerate(ids):
            idx = np.flatnonzero(own == j)
            if len(idx):
                out[nid] = idx
        return out
    order = np.argsort(own, kind="stable")
    bounds = np.searchsorted(own[order], np.arange(len(ids) + 1))
    for j, nid in enumerate(ids):
        if bounds[j + 1] > bounds[j]:
            out[nid] = order[bounds[j]:bounds[j + 1]]
    return out


def write_routes(key_blob: bytes, ids: Sequence[str], replicas: int) -> Routes:
    """Node id → ascending indices of the keys it is one of the ``replicas`` write owners of
    (the highest-weight ``ids``): one batched write per node (pure).  A key's owners are
    distinct nodes, so a node lists a key at most once."""
    n = len(key_blob) // KEY_BYTES
    if n == 0 or not ids:
        return {}
    own = owners(key_blob, ids, replicas)
    r = own.shape[1]
    if r == 1:
        return group_by_owner(own[:, 0], ids)
    # Row-major: the owners of key i sit at i*r .. i*r + r - 1, so position // r is the key and
    # the positions a node gets are ascending, hence so are its keys.
    return {nid: pos // r for nid, pos in group_by_owner(own.ravel(), ids).items()}


_HELD = (pb.OK, pb.ALREADY_EXISTS)


def merge_replica_codes(per_owner: Sequence[Sequence[int]]) -> list[int]:
    """One code per item of a write sent to each of its owners (``per_owner[i]``: the codes of
    item i's owners; UNREACHABLE where an owner was not asked or did not answer).

    The rule: an item is pooled (OK, or ALREADY_EXISTS when no owner took new bytes) when every
    owner that answered holds it and at least one did; an owner that is down does not hold a
    write back (the engine keeps writing while a node is lost: that is what the replicas are
    for).  An owner that answered with a refusal decides the item's code (the first such owner),
    so the writer retries or gives up on it as for an unreplicated write: a retry asks every
    owner again, and those that hold the object answer ALREADY_EXISTS before any byte is sent.
    No owner answered: UNREACHABLE.  Pure."""
    out: list[int] = []
    for codes in per_owner:
        refused = next((c for c in codes if c != UNREACHABLE and c not in _HELD), None)
        if refused is not None:
            out.append(refused)
        elif pb.OK in codes:
            out.append(pb.OK)
        elif pb.ALREADY_EXISTS in codes:
            out.append(pb.ALREADY_EXISTS)
        else:
            out.append(UNREACHABLE)
    return out


def fallback_routes(key_blob: bytes, ring: Ring, previous: Ring | Sequence[Ring] | None = None,
                    ranks: int = 0, replicated: bool = True) -> list[Routes]:
    """Where else a read looks for keys missing at their active owner, in order (DESIGN §6).

    1. The owner among active + draining members: a draining node still holds what it has not
       pushed yet.
    2. The 2nd, 3rd, ... highest-weight active members: always the ring's other replicas
       (``ring.replicas`` - 1 of them, for ``replicated`` objects: blocks, not the single-copy
       state objects), and during a ring transition ``ranks`` of them.  Rendezvous hashing
       moves a key only to a node that joined, so an object written before
       one or more scale-ups lives at the first node in weight order that existed then, even
       when this sidecar never saw the intermediate epochs.
    3. The active owner under each earlier ring epoch (``previous``, newest first): covers
       members that left since.
    Each source lists only keys whose fallback differs from every node asked before it.
    A pure function of the rings.
    """
    n = len(key_blob) // KEY_BYTES
    active = [m.id for m in ring.active]
    if n == 0 or not active:
        return []
    history = [previous] if isinstance(previous, Ring) else list(previous or ())
    if replicated:
        ranks = max(ranks, ring.replicas - 1)
    ranks = max(0, min(ranks, len(active) - 1))
    ranked = owners(key_blob, active, ranks + 1)
    asked = [np.array(active, dtype=object)[ranked[:, 0]]]
    sources: list[tuple[list[str], npt.NDArray[np.intp]]] = []
    if len(ring.members) != len(active):
        ids = [m.id for m in ring.members]
        sources.append((ids, owners(key_blob, ids)[:, 0]))
    for r in range(1, ranks + 1):
        sources.append((active, ranked[:, r]))
    seen = [sorted(active)]
    for old in history:
        ids = [m.id for m in old.active]
        if ids and sorted(ids) not in seen:
            seen.append(sorted(ids))
            sources.append((ids, owners(key_blob, ids)[:, 0]))
    out: list[Routes] = []
    for ids, own in sources:
        fb = np.array(ids, dtype=object)[own]
        new = np.ones(n, dtype=bool)
        for a in asked:
            new &= fb != a
        asked.append(fb)
        if not new.any():
            continue
        sel = np.flatnonzero(new)
        out.append({nid: sel[idx] for nid, idx in group_by_owner(own[sel], ids).items()})
    return out


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
        self.ring = Ring(epoch=0)
        self.history: list[Ring] = []
        """Earlier rings, newest first (at most ``history_depth``): reads that miss at the new
        owner try the owners of these epochs, whose objects may not have moved yet."""
        self.history_depth = history_depth
        self.transition_seconds = transition_seconds
        """How long after a ring change misses are also looked for where the keys used to live
        (copy-over and the warm-up push move them meanwhile); outside it a miss costs one round, no more."""
        self.fallback_ranks = fallback_ranks
        self._transition_until = 0.0
        self._active_ids: list[str] = []
        self._executor = ThreadPoolExecutor(max_workers=16, thread_name_prefix="pool")
        self.errors = 0
        self.deadline_misses = 0
        """Calls to a node given up at their deadline (the node was hung or slow)."""
        self.calls_skipped = 0
        """Calls not sent because their node was suspect (its keys were misses or read elsewhere)."""
        self.probes_ok = 0
        self.probes_failed = 0
        self.refresh_needed = threading.Event()
        self._seen_epoch = 0
        self.on_ring_change: Callable[[Ring], None] | None = None
        """Called (outside the lock) after the ring moved to a newer epoch."""
        self._refresh_lock = threading.Lock()
        self._deferred: dict[str, tuple[int, float, int]] = {}
        """Node id -> (a released match lease, when, the node's incarnation then): it is dropped
        by the next frame to that node (an EXISTS or a GET carries one lease to drop), or by
        :meth:`flush_deferred`; a match released without a read costs no round trip of its own.
        A node that failed or restarted since (another incarnation) lost it: it is not sent."""
        self._deferred_lock = threading.Lock()
        self.releases_sent = 0
        """Match leases dropped by a release frame of their own."""
        self.releases_carried = 0
        """Match leases dropped by a later exists or read frame to their node (no round trip)."""
        self._releasing: set[Future[None]] = set()
        """Release calls submitted and not done yet (guarded by ``_deferred_lock``): :meth:`close`
        waits for them rather than cancel them."""
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
        # Suspect nodes are not asked (a hung one would hold this for the whole timeout, and
        # catch_up runs on an engine's call) unless no node is up.
        live = [n for n in nodes if n.up] or nodes
        known = {n.member.address: n.client for n in live}
        held = {n.member.address for n in nodes}
        temp = {a: StoreClient(a, self.token, timeout=2.0) for a in self.seeds if a not in held}
        clients = {**known, **temp}
        best: Ring | None = None
        try:
            calls = [(a, c.stub.GetRing.future(pb.Empty(), timeout=2.0, metadata=c._metadata))
                     for a, c in clients.items()]
            for _, fut in calls:
                try:
                    ring = ring_from_pb(fut.result())
                except (grpc.RpcError, errors.KvpoolError):
                    continue
                if best is None or ring.epoch > best.epoch:
                    best = ring
        finally:
            for c in temp.values():
                c.close()
        if best is None or best.epoch == 0 or not best.members:
            if self.ring.epoch > 0:
                return False  # nobody answered: keep what we know
            best = Ring(epoch=0, members=tuple(Member(a, a) for a in self.seeds))
        self.set_ring(best)
        return True

    def set_ring(self, ring: Ring) -> None:
        with self.lock:
            if ring.epoch < self.ring.epoch:
                return
            changed = ring.epoch > self.ring.epoch and bool(self.ring.members)
            if ring.epoch > self.ring.epoch and self.ring.members:
                self.history = [self.ring, *self.history][:self.history_depth]
                self._transition_until = time.monotonic() + self.transition_seconds
            elif not self.ring.members and ring.epoch > 1:
                # Bootstrapping into a ring that has changed before: a change may be recent, and
                # its objects not moved yet (the ranked fallbacks find them without history).
                self._transition_until = time.monotonic() + self.transition_seconds
            keep = {m.id: m for m in ring.members}
            for old in self.history:
                for m in old.members:
                    keep.setdefault(m.id, m)
            for m in keep.values():
                h = self.nodes.get(m.id)
                if h is None or h.member.address != m.address:
                    if h is not None:
                        h.client.close()
                    self.nodes[m.id] = NodeHandle(m, StoreClient(m.address, self.token, timeout=self.rpc_timeout))
                else:
                    h.member = m
            for mid in [i for i in self.nodes if i not in keep]:
                self.nodes.pop(mid).client.close()
            self.ring = ring
            self._active_ids = [m.id for m in ring.active]
        self.refresh_needed.clear()
        if changed and self.on_ring_change is not None:
            self.on_ring_change(ring)

    def _note_epoch(self, epoch: int) -> None:
        if epoch > self.ring.epoch:
            with self.lock:
                self._seen_epoch = max(self._seen_epoch, epoch)
            self.refresh_needed.set()

    def catch_up(self, routed_epoch: int | None = None) -> bool:
        """If a node answered for a newer epoch than ours, learn the ring now (one caller does,
        the others wait for it); True when the ring is not the one the caller routed under
        (``routed_epoch``, default: the current one), so the caller routes again.  The
        background refresh may have learnt the newer ring between the caller's round and this
        call: that still counts as a change for the caller."""
        before = self.ring.epoch if routed_epoch is None else routed_epoch
        if self._seen_epoch > self.ring.epoch:
            with self._refresh_lock:
                if self._seen_epoch > self.ring.epoch:
                    self.refresh_ring()
        return self.ring.epoch != before

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
        with self._deferred_lock:
            # It may come back as another life: its leases die with this one, never sent there.
            self._deferred.pop(node.member.id, None)
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
        """Owner node id → indices (ascending) of the keys it owns, for the active ring."""
        with self.lock:
            ids = list(self._active_ids)
        if not ids or len(key_array) == 0:
            return {}
        return group_by_owner(owners(key_array.tobytes(), ids)[:, 0], ids)

    def fallbacks(self, key_array: npt.NDArray[Any], kind: int = pb.BLOCK) -> list[Routes]:
        """Fallback routes for keys missing at their owner (see :func:`fallback_routes`): the
        ring's other replicas of a block, a draining member, and during a transition the
        owners of earlier epochs."""
        with self.lock:
            ring, history = self.ring, list(self.history)
        if len(key_array) == 0:
            return []
        replicated = kind == pb.BLOCK
        if time.monotonic() >= self._transition_until:
            # Draining members and the other replicas only.
            return fallback_routes(key_array.tobytes(), ring, replicated=replicated)
        return fallback_routes(key_array.tobytes(), ring, history, self.fallback_ranks, replicated)

    @property
    def in_transition(self) -> bool:
        return time.monotonic() < self._transition_until

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
                            Callable[[float | None], ExistsReply] | None]] = []
        for nid, idx, pin in calls:
            node = self._up(nid)
            if node is None:
                pending.append((nid, idx, None, None))
                continue
            args = (key_array[idx].tobytes(), pin, lease_ms if pin else 0, prefix_only, kind, self.ring.epoch)
            try:
                finish = node.client.exists_array_begin(*args, drop_lease=self._take_deferred(nid), timeout=limit)
            except (grpc.RpcError, errors.KvpoolError, OSError) as exc:
                self._failed(node, exc)
                pending.append((nid, idx, None, None))
                continue
            pending.append((nid, idx, node, finish))
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
        """Longest prefix of ``key_array`` present in the pool (see :meth:`_match`); asked again
        when a node told us of a newer ring on the way (the first call after a ring change)."""
        epoch = self.ring.epoch
        m = self._match(key_array, lease_ms)
        if m.prefix < len(key_array) and self.catch_up(epoch):
            self.release(m.leases)
            m = self._match(key_array, lease_ms)
        return m

    def _match(self, key_array: npt.NDArray[Any], lease_ms: int) -> PoolMatch:
        """Longest prefix of ``key_array`` present in the pool, pinned at each node.

        Each owner is asked for the leading run of *its* keys (prefix_only + pin): the global
        prefix ends at the earliest first miss among the owners.  When a fallback exists (a
        draining node, or the owners of earlier ring epochs) the keys from that first miss
        on are asked per key of their owners and fallbacks in one more concurrent round.
        """
        n = len(key_array)
        routes = self.route(key_array)
        if not routes:
            return PoolMatch(0)
        first_miss = n
        leases: list[tuple[str, int]] = []
        for nid, idx, reply in self.exists_many(key_array, [(nid, idx, True) for nid, idx in routes.items()],
                                                True, lease_ms):
            run = reply.prefix if reply is not None else 0
            if reply is not None and reply.lease_id:
                leases.append((nid, reply.lease_id))
            if run < len(idx):
                first_miss = min(first_miss, int(idx[run]))
        prefix = first_miss
        if prefix < n:
            tail = key_array[prefix:]
            fbs = self.fallbacks(tail)
            if fbs:
                present = np.zeros(len(tail), dtype=bool)
                calls = [(nid, idx, False) for nid, idx in self.route(tail).items()]
                calls += [(nid, idx, True) for fb in fbs for nid, idx in fb.items()]
                for nid, idx, reply in self.exists_many(tail, calls, False, lease_ms):
                    if reply is None:
                        continue
                    if reply.lease_id:
                        leases.append((nid, reply.lease_id))
                    got = reply.present
                    present[idx[:len(got)][got[:len(idx)]]] = True
                misses = np.flatnonzero(~present)
                prefix += int(misses[0]) if len(misses) else len(tail)
        return PoolMatch(prefix, leases)

    def present(self, key_array: npt.NDArray[Any], kind: int) -> npt.NDArray[np.bool_]:
        """Per-key presence at the owners, then at the fallbacks for what is still missing."""
        epoch = self.ring.epoch
        p = self._present(key_array, kind)
        if not p.all() and self.catch_up(epoch):
            p = self._present(key_array, kind)
        return p

    def _present(self, key_array: npt.NDArray[Any], kind: int) -> npt.NDArray[np.bool_]:
        present = np.zeros(len(key_array), dtype=bool)
        rounds: list[Routes] = [self.route(key_array)]
        fbs: list[Routes] | None = None
        while rounds:
            routes = rounds.pop(0)
            calls = [(nid, idx[~present[idx]], False) for nid, idx in routes.items()]
            calls = [c for c in calls if len(c[1])]
            for _, idx, reply in self.exists_many(key_array, calls, False, 0, kind):
                if reply is not None:
                    got = reply.present
                    present[idx[:len(got)][got[:len(idx)]]] = True
            if fbs is None:
                fbs = self.fallbacks(key_array, kind) if not present.all() else []
                rounds.extend(fbs)
        return present

    def release(self, leases: Sequence[tuple[str, int]]) -> None:
        """Drop match leases, without waiting (best effort: leases expire by themselves).

        At each node the newest lease waits for the next frame to that node
        (see ``_deferred``); the one it replaces, and any more, are sent now."""
        by_node: dict[str, list[int]] = {}
        for nid, lid in leases:
            if lid:
                by_node.setdefault(nid, []).append(lid)
        now = time.monotonic()
        for nid, lids in by_node.items():
            node = self._up(nid)
            if node is None:
                continue
            with self._deferred_lock:
                before = self._deferred.get(nid)
                self._deferred[nid] = (lids[-1], now, node.client.incarnation)
            lids = lids[:-1] + ([before[0]] if before and before[2] == node.client.incarnation else [])
            if lids:
                self._send_release(node, lids)

    def _take_deferred(self, nid: str) -> int:
        """The lease waiting to be dropped at ``nid`` (0: none), handed to a frame going there."""
        with self._deferred_lock:
            d = self._deferred.pop(nid, None)
            node = self.nodes.get(nid)
            if d is None or node is None or d[2] != node.client.incarnation:
                return 0  # none, or of the node's previous life: it died with it
            self.releases_carried += 1
        return d[0]

    def flush_deferred(self, older_than: float = 0.0) -> int:
        """Send the deferred drops waiting longer than ``older_than`` seconds (the sidecar's
        background loop: a node no frame goes to still has its pins dropped soon); how many."""
        now = time.monotonic()
        with self._deferred_lock:
            due = [(nid, lid, inc) for nid, (lid, at, inc) in self._deferred.items() if now - at >= older_than]
            for nid, _, _ in due:
                del self._deferred[nid]
        for nid, lid, inc in due:
            node = self._up(nid)
            if node is not None and node.client.incarnation == inc:
                self._send_release(node, [lid])
        return len(due)

    def _send_release(self, node: NodeHandle, lids: list[int]) -> None:
        try:
            # On the pool's threads: a gRPC future would start a thread per call.
            fut = self._executor.submit(self._release_quietly, node, lids)
        except RuntimeError:  # shut down
            return
        with self._deferred_lock:
            self.releases_sent += len(lids)
            self._releasing.add(fut)
        fut.add_done_callback(self._release_done)

    def _release_done(self, fut: Future[None]) -> None:
        with self._deferred_lock:
            self._releasing.discard(fut)

    def _release_quietly(self, node: NodeHandle, lids: list[int]) -> None:
        try:
            # Bounded like a probe: a hung node must not hold the pool's threads.
            node.client.release(lids, timeout=self.deadlines.probe_seconds)
        except Exception:  # noqa: BLE001 - best effort: leases expire by themselves
            pass

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
            r = node.client.read(key_array.tobytes(), dest, kind, drop_lease or self._take_deferred(nid), streams,
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
        with self.lock:
            ids = list(self._active_ids)
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
        self.flush_deferred()
        with self._deferred_lock:
            sending = list(self._releasing)
        wait(sending, timeout=timeout)
        self._executor.shutdown(wait=False, cancel_futures=True)
        with self.lock:
            for n in self.nodes.values():
                n.client.close()
            self.nodes.clear()
