"""Which store nodes a key goes to, and catching up with a newer ring without blocking a call.

Pure routing (:func:`group_by_owner`, :func:`write_routes`, :func:`fallback_routes`,
:func:`merge_replica_codes`) and :class:`RingView`, the one place for the rule every pool call
follows when a node answers for a newer ring epoch than the one the call was routed by:

* the node's reply names the epoch (:meth:`RingView.note_epoch`); the newer ring is then learnt
  in the background, one refresh at a time, on the pool's threads (one GetRing per node, all
  concurrently) — never on the thread of the call that noticed it;
* a call asks :meth:`RingView.catch_up` with the epoch it routed by: True when the ring has moved
  since (learnt by that refresh, or by the sidecar's own poll), and the call routes what is still
  missing once more under the new ring.  A call waits for the refresh under way at most
  ``wait_seconds``: on the engine's path one lookup's deadline (``Pool.catch_up_seconds``; the
  nodes answer GetRing in about a millisecond), past which its misses go to the fallback routes
  or stay misses (shedding, not blocking) and the next call routes under the new ring; a
  background writer longer, to send refused items to their new owner at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvpool.core.keys import KEY_BYTES
from kvpool.core.retry import UNREACHABLE
from kvpool.core.ring import Ring, owners
from kvpool.wire.proto import store_pb2 as pb

Routes = dict[str, npt.NDArray[np.intp]]


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


class RingView:
    """The ring the pool routes by, the rings before it, and catching up with a newer one.
    Thread-safe; the node clients are the pool's (``refresh`` asks them, ``submit`` runs it on
    the pool's threads)."""

    def __init__(self, refresh: Callable[[], object], submit: Callable[[Callable[[], None]], object],
                 history_depth: int = 3, transition_seconds: float = 600.0, fallback_ranks: int = 2) -> None:
        self._refresh = refresh
        self._submit = submit
        self.ring = Ring(epoch=0)
        self.history: list[Ring] = []
        """Earlier rings, newest first (at most ``history_depth``): reads that miss at the new
        owner try the owners of these epochs, whose objects may not have moved yet."""
        self.history_depth = history_depth
        self.transition_seconds = transition_seconds
        """How long after a ring change misses are also looked for where the keys used to live
        (copy-over and the warm-up push move them meanwhile); outside it a miss costs one round, no more."""
        self.fallback_ranks = fallback_ranks
        self.active_ids: list[str] = []
        self.refresh_needed = threading.Event()
        """Set while a node has named an epoch newer than the ring (cleared when one is learnt)."""
        self._transition_until = 0.0
        self._seen_epoch = 0
        self._refreshing = False
        self._moved = threading.Condition()

    def accept(self, ring: Ring) -> bool:
        """Take ``ring`` if it is not older than the current one (the caller holds the pool's
        lock); whether it is a newer epoch that replaced a ring in use (a change to announce)."""
        if ring.epoch < self.ring.epoch:
            return False
        changed = ring.epoch > self.ring.epoch and bool(self.ring.members)
        if changed:
            self.history = [self.ring, *self.history][:self.history_depth]
            self._transition_until = time.monotonic() + self.transition_seconds
        elif not self.ring.members and ring.epoch > 1:
            # Bootstrapping into a ring that has changed before: a change may be recent, and
            # its objects not moved yet (the ranked fallbacks find them without history).
            self._transition_until = time.monotonic() + self.transition_seconds
        with self._moved:
            self.ring = ring
            self.active_ids = [m.id for m in ring.active]
            self._moved.notify_all()
        self.refresh_needed.clear()
        return changed

    def members_to_keep(self) -> dict[str, Any]:
        """Member id → member of the ring and of the rings before it (their nodes stay known)."""
        keep = {m.id: m for m in self.ring.members}
        for old in self.history:
            for m in old.members:
                keep.setdefault(m.id, m)
        return keep

    def note_epoch(self, epoch: int) -> None:
        """A node answered for ``epoch``: when it is newer than the ring, learn that ring in the
        background (one refresh at a time)."""
        if epoch <= self.ring.epoch:
            return
        with self._moved:
            self._seen_epoch = max(self._seen_epoch, epoch)
            start, self._refreshing = not self._refreshing, True
        self.refresh_needed.set()
        if start:
            try:
                self._submit(self._refresh_once)
            except RuntimeError:  # the pool is shut down
                with self._moved:
                    self._refreshing = False

    def _refresh_once(self) -> None:
        try:
            self._refresh()
        except Exception:  # noqa: BLE001 - the next reply naming the epoch, or the poll, tries again
            pass
        finally:
            with self._moved:
                self._refreshing = False
                self._moved.notify_all()

    def catch_up(self, routed_epoch: int | None = None, wait_seconds: float = 0.0) -> bool:
        """Whether the ring is not the one the caller routed by (``routed_epoch``, default the
        current one), so it routes what is missing again.  A newer epoch a node named is learnt
        in the background; ``wait_seconds`` (0: not at all, the engine's path) bounds how long
        the caller waits for that refresh."""
        before = self.ring.epoch if routed_epoch is None else routed_epoch
        if wait_seconds > 0 and self._seen_epoch > self.ring.epoch:
            deadline = time.monotonic() + wait_seconds
            with self._moved:
                while self._seen_epoch > self.ring.epoch and self._refreshing:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._moved.wait(left)
        return self.ring.epoch != before

    def route(self, key_array: npt.NDArray[Any]) -> Routes:
        """Owner node id → indices (ascending) of the keys it owns, for the active ring (its one
        write owner: :func:`write_routes`)."""
        return write_routes(key_array.tobytes(), self.active_ids, 1)

    def fallbacks(self, key_array: npt.NDArray[Any], kind: int = pb.BLOCK) -> list[Routes]:
        """Fallback routes for keys missing at their owner (see :func:`fallback_routes`): the
        ring's other replicas of a block, a draining member, and during a transition the
        owners of earlier epochs."""
        ring, history = self.ring, list(self.history)
        if len(key_array) == 0:
            return []
        replicated = kind == pb.BLOCK
        if not self.in_transition:
            return fallback_routes(key_array.tobytes(), ring, replicated=replicated)  # draining + replicas only
        return fallback_routes(key_array.tobytes(), ring, history, self.fallback_ranks, replicated)

    @property
    def in_transition(self) -> bool:
        return time.monotonic() < self._transition_until


def rounds(view: RingView, key_array: npt.NDArray[Any], kind: int, missing: Callable[[], npt.NDArray[np.bool_]],
           wait_seconds: float = 0.0) -> Iterator[tuple[bool, Routes]]:
    """The rounds of a lookup or read of ``key_array``: (whether it is a fallback round, the
    routes), each limited to the keys still ``missing()`` (a mask over ``key_array``, read again
    before each round): the owners under the ring it routes by; the owners under a newer ring
    when one was learnt since (waited for at most ``wait_seconds``: :meth:`RingView.catch_up`);
    then the fallbacks (:meth:`RingView.fallbacks`), until none is missing.  The one "route, catch up, route
    again, fall back" of every pool read."""
    epoch = view.ring.epoch
    yield False, view.route(key_array)
    miss = missing()
    if miss.any() and view.catch_up(epoch, wait_seconds):
        yield False, _only(view.route(key_array), miss)
        miss = missing()
    if not miss.any():
        return
    for routes in view.fallbacks(key_array, kind):
        yield True, _only(routes, miss)
        miss = missing()
        if not miss.any():
            return


def _only(routes: Routes, mask: npt.NDArray[np.bool_]) -> Routes:
    """``routes`` limited to the keys of ``mask``, without the nodes left with none."""
    out = {nid: idx[mask[idx]] for nid, idx in routes.items()}
    return {nid: idx for nid, idx in out.items() if len(idx)}
