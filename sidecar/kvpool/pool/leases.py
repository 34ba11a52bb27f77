"""Match leases at the store nodes, dropped without a round trip of their own where one can ride.

A match pins the prefix it found at each node with a lease; the read that follows drops it in
its own frame.  A match released without a read leaves its newest lease per node waiting for
the next frame to that node (an EXISTS or a GET carries one lease to drop), or for
:meth:`MatchLeases.flush` (the sidecar's background loop, the pool's close); the rest are sent
at once, on the pool's threads.  Best effort throughout: a lease that is never dropped expires.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpool.pool.fanout import NodeHandle


class MatchLeases:
    """The match leases released and not dropped yet, per node.  Thread-safe."""

    def __init__(self, up: Callable[[str], NodeHandle | None], node: Callable[[str], NodeHandle | None],
                 submit: Callable[..., Future[None]], bound: Callable[[], float]) -> None:
        """``up``: the node if a call may go to it now; ``node``: the node, up or not; ``submit``:
        runs a call on the pool's threads; ``bound``: the deadline of a release call."""
        self._up, self._node, self._submit, self._bound = up, node, submit, bound
        self.deferred: dict[str, tuple[int, float, int]] = {}
        """Node id -> (a released match lease, when, the node's incarnation then): it is dropped
        by the next frame to that node (an EXISTS or a GET carries one lease to drop), or by
        :meth:`flush`; a match released without a read costs no round trip of its own.
        A node that failed or restarted since (another incarnation) lost it: it is not sent."""
        self._lock = threading.Lock()
        self.releases_sent = 0
        """Match leases dropped by a release frame of their own."""
        self.releases_carried = 0
        """Match leases dropped by a later exists or read frame to their node (no round trip)."""
        self._releasing: set[Future[None]] = set()
        """Release calls submitted and not done yet (guarded by ``_lock``): :meth:`sending`
        waits for them rather than cancel them."""

    def forget(self, nid: str) -> None:
        """The node failed: it may come back as another life, its leases died with this one."""
        with self._lock:
            self.deferred.pop(nid, None)

    def sending(self) -> list[Future[None]]:
        """The release calls on their way (the pool's close waits for them)."""
        with self._lock:
            return list(self._releasing)

    def release(self, leases: Sequence[tuple[str, int]]) -> None:
        """Drop match leases, without waiting (best effort: leases expire by themselves).

        At each node the newest lease waits for the next frame to that node
        (see ``deferred``); the one it replaces, and any more, are sent now."""
        by_node: dict[str, list[int]] = {}
        for nid, lid in leases:
            if lid:
                by_node.setdefault(nid, []).append(lid)
        now = time.monotonic()
        for nid, lids in by_node.items():
            node = self._up(nid)
            if node is None:
                continue
            with self._lock:
                before = self.deferred.get(nid)
                self.deferred[nid] = (lids[-1], now, node.client.incarnation)
            lids = lids[:-1] + ([before[0]] if before and before[2] == node.client.incarnation else [])
            if lids:
                self._send_release(node, lids)

    def take(self, nid: str) -> int:
        """The lease waiting to be dropped at ``nid`` (0: none), handed to a frame going there."""
        with self._lock:
            d = self.deferred.pop(nid, None)
            node = self._node(nid)
            if d is None or node is None or d[2] != node.client.incarnation:
                return 0  # none, or of the node's previous life: it died with it
            self.releases_carried += 1
        return d[0]

    def flush(self, older_than: float = 0.0) -> int:
        """Send the deferred drops waiting longer than ``older_than`` seconds (the sidecar's
        background loop: a node no frame goes to still has its pins dropped soon); how many."""
        now = time.monotonic()
        with self._lock:
            due = [(nid, lid, inc) for nid, (lid, at, inc) in self.deferred.items() if now - at >= older_than]
            for nid, _, _ in due:
                del self.deferred[nid]
        for nid, lid, inc in due:
            node = self._up(nid)
            if node is not None and node.client.incarnation == inc:
                self._send_release(node, [lid])
        return len(due)

    def _send_release(self, node: NodeHandle, lids: list[int]) -> None:
        try:
            # On the pool's threads: a gRPC future would start a thread per call.
            fut = self._submit(self._release_quietly, node, lids)
        except RuntimeError:  # shut down
            return
        with self._lock:
            self.releases_sent += len(lids)
            self._releasing.add(fut)
        fut.add_done_callback(self._release_done)

    def _release_done(self, fut: Future[None]) -> None:
        with self._lock:
            self._releasing.discard(fut)

    def _release_quietly(self, node: NodeHandle, lids: list[int]) -> None:
        try:
            # Bounded like a probe: a hung node must not hold the pool's threads.
            node.client.release(lids, timeout=self._bound())
        except Exception:  # noqa: BLE001 - best effort: leases expire by themselves
            pass
