"""The sidecar's view of the pool: the ring, one client per store node, batched fan-out.

Keys are grouped by owner with numpy (no Python loop over keys for routing); each owner gets one
batched call and all owners are asked concurrently (gRPC futures for metadata, the transfer
engine's threads for bytes).  A node that fails is marked down for a short backoff and its keys
become misses: the engine never sees a pool error, and never wrong bytes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from .. import errors
from ..keys import KEY_BYTES
from ..proto import store_pb2 as pb
from ..ring import Member, Ring, owners
from ..store.service import ring_from_pb
from ..store_client import GetPlan, StoreClient
from ..transfer import TransferEngine

log = logging.getLogger("kvpool.sidecar.pool")


@dataclass
class NodeHandle:
    member: Member
    client: StoreClient
    down_until: float = 0.0

    @property
    def up(self) -> bool:
        return time.monotonic() >= self.down_until


@dataclass
class PoolMatch:
    prefix: int                       # global leading run of present keys (from `start`)
    leases: dict[str, int] = field(default_factory=dict)  # node id → lease id


class Pool:
    """Membership + per-node clients, thread-safe."""

    def __init__(self, seeds: Sequence[str], token: str = "", backoff: float = 1.0,
                 rpc_timeout: float = 5.0) -> None:
        self.seeds = [s for s in seeds if s]
        self.token = token
        self.backoff = backoff
        self.rpc_timeout = rpc_timeout
        self.engine = TransferEngine()
        self.lock = threading.Lock()
        self.nodes: dict[str, NodeHandle] = {}
        self.ring = Ring(epoch=0)
        self._active_ids: list[str] = []
        self._fallback_ids: list[str] = []
        self._executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="pool")
        self.errors = 0
        self.refresh_needed = threading.Event()
        if self.seeds:
            self.refresh_ring()

    @property
    def enabled(self) -> bool:
        return bool(self.seeds)

    # -- membership ---------------------------------------------------------------------------

    def refresh_ring(self) -> bool:
        """Learn the ring from any reachable node; without an operator (epoch 0) the seeds are
        the membership, named by their addresses."""
        best: Ring | None = None
        for addr in [n.member.address for n in self.nodes.values()] + self.seeds:
            try:
                with StoreClient(addr, self.token, engine=self.engine, timeout=2.0) as c:
                    ring = ring_from_pb(c.get_ring())
            except errors.KvpoolError:
                continue
            if best is None or ring.epoch > best.epoch:
                best = ring
            if best.epoch > 0:
                break
        if best is None or best.epoch == 0 or not best.members:
            best = Ring(epoch=0, members=tuple(Member(a, a) for a in self.seeds))
        self.set_ring(best)
        return True

    def set_ring(self, ring: Ring) -> None:
        with self.lock:
            if ring.epoch < self.ring.epoch:
                return
            for m in ring.members:
                h = self.nodes.get(m.id)
                if h is None or h.member.address != m.address:
                    if h is not None:
                        h.client.close()
                    self.nodes[m.id] = NodeHandle(m, StoreClient(m.address, self.token, engine=self.engine,
                                                                 timeout=self.rpc_timeout))
                else:
                    h.member = m
            for mid in [i for i in self.nodes if ring.member(i) is None]:
                self.nodes.pop(mid).client.close()
            self.ring = ring
            self._active_ids = [m.id for m in ring.active]
            self._fallback_ids = [m.id for m in ring.members]
        self.refresh_needed.clear()

    def _note_epoch(self, epoch: int) -> None:
        if epoch > self.ring.epoch:
            self.refresh_needed.set()

    def _failed(self, node: NodeHandle, exc: BaseException) -> None:
        self.errors += 1
        node.down_until = time.monotonic() + self.backoff
        log.warning("pool node %s failed: %s", node.member.id, exc)

    def nodes_up(self) -> int:
        return sum(1 for n in self.nodes.values() if n.up)

    # -- routing ------------------------------------------------------------------------------

    def route(self, key_array: npt.NDArray[Any]) -> dict[str, npt.NDArray[np.intp]]:
        """Owner node id → indices (ascending) of the keys it owns, for the active ring."""
        with self.lock:
            ids = list(self._active_ids)
        if not ids or len(key_array) == 0:
            return {}
        own = owners(key_array.tobytes(), ids)[:, 0]
        order = np.argsort(own, kind="stable")
        bounds = np.searchsorted(own[order], np.arange(len(ids) + 1))
        return {ids[j]: order[bounds[j]:bounds[j + 1]] for j in range(len(ids)) if bounds[j + 1] > bounds[j]}

    def draining_fallback(self, key_array: npt.NDArray[Any]) -> npt.NDArray[Any] | None:
        """Owner id among active + draining members per key, or None when nobody drains."""
        with self.lock:
            if len(self._fallback_ids) == len(self._active_ids):
                return None
            ids = list(self._fallback_ids)
        own = owners(key_array.tobytes(), ids)[:, 0]
        return np.array(ids, dtype=object)[own]

    # -- match --------------------------------------------------------------------------------

    def match(self, key_array: npt.NDArray[Any], lease_ms: int) -> PoolMatch:
        """Longest prefix of ``key_array`` present in the pool, pinned at each node.

        Each owner is asked for the leading run of *its* keys (prefix_only + pin): the global
        prefix ends at the earliest first miss among the owners.
        """
        n = len(key_array)
        routes = self.route(key_array)
        if not routes:
            return PoolMatch(0)
        futures = []
        for nid, idx in routes.items():
            node = self.nodes.get(nid)
            if node is None or not node.up:
                futures.append((nid, idx, None))
                continue
            req = pb.ExistsRequest(keys=key_array[idx].tobytes(), pin=True, lease_ms=lease_ms, prefix_only=True,
                                   epoch=self.ring.epoch)
            fut = node.client.stub.Exists.future(req, timeout=self.rpc_timeout, metadata=node.client._metadata)
            futures.append((nid, idx, fut))
        first_miss = n
        leases: dict[str, int] = {}
        for nid, idx, fut in futures:
            run = 0
            if fut is not None:
                try:
                    reply = fut.result()
                    run = reply.prefix
                    if reply.lease_id:
                        leases[nid] = reply.lease_id
                    self._note_epoch(reply.epoch)
                except grpc.RpcError as exc:
                    self._failed(self.nodes[nid], exc)
            if run < len(idx):
                first_miss = min(first_miss, int(idx[run]))
        prefix = first_miss
        if prefix < n:
            prefix = self._extend_from_draining(key_array, prefix, lease_ms, leases)
        return PoolMatch(prefix, leases)

    def _extend_from_draining(self, key_array: npt.NDArray[Any], prefix: int, lease_ms: int,
                              leases: dict[str, int]) -> int:
        """During a drain, a miss at the new owner may still be held by the draining node."""
        fb = self.draining_fallback(key_array[prefix:])
        if fb is None:
            return prefix
        while prefix < len(key_array):
            nid = fb[0] if len(fb) else None
            node = self.nodes.get(nid) if nid is not None else None
            if node is None or node.member.state != "draining" or not node.up:
                return prefix
            # Ask the draining node for the run of keys starting here.
            try:
                r = node.client.exists([bytes(k) for k in key_array[prefix:]], pin=True, lease_ms=lease_ms)
            except errors.KvpoolError as exc:
                self._failed(node, exc)
                return prefix
            if r.lease_id:
                leases[f"{nid}#drain"] = r.lease_id
            if r.prefix == 0:
                return prefix
            prefix += r.prefix
            fb = fb[r.prefix:]
        return prefix

    def release(self, leases: dict[str, int]) -> None:
        for nid, lid in leases.items():
            node = self.nodes.get(nid.split("#", 1)[0])
            if node is None or not node.up:
                continue
            try:
                node.client.stub.Release.future(pb.ReleaseRequest(lease_ids=[lid]), timeout=self.rpc_timeout,
                                                metadata=node.client._metadata)
            except Exception:  # best effort: leases expire by themselves
                pass

    # -- get ----------------------------------------------------------------------------------

    def get_plans(self, key_array: npt.NDArray[Any], kind: int, lease_ms: int
                  ) -> list[tuple[NodeHandle, npt.NDArray[np.intp], GetPlan]]:
        """Ask each owner (concurrently) where its keys are; misses fall back to a draining node."""
        routes = self.route(key_array)
        calls = []
        for nid, idx in routes.items():
            node = self.nodes.get(nid)
            if node is None or not node.up:
                continue
            req = pb.GetRequest(keys=key_array[idx].tobytes(), kind=kind, lease_ms=lease_ms, epoch=self.ring.epoch)
            calls.append((node, idx, node.client.stub.Get.future(req, timeout=self.rpc_timeout,
                                                                 metadata=node.client._metadata)))
        out = []
        for node, idx, fut in calls:
            try:
                r = fut.result()
            except grpc.RpcError as exc:
                self._failed(node, exc)
                continue
            self._note_epoch(r.epoch)
            out.append((node, idx, GetPlan(list(r.codes), list(r.offsets), list(r.sizes), list(r.checksums),
                                           list(r.tokens), r.lease_id, r.location, r.epoch)))
        return out

    def fetch(self, node: NodeHandle, plan: GetPlan, buffers: Sequence[memoryview | None]) -> list[int]:
        try:
            return node.client.fetch_into(plan, buffers)
        except errors.KvpoolError as exc:
            self._failed(node, exc)
            return [pb.NOT_FOUND] * len(plan.codes)
        finally:
            if plan.lease_id:
                self.release({node.member.id: plan.lease_id})

    def get_from(self, nid: str, keys: list[bytes], kind: int) -> tuple[NodeHandle, GetPlan] | None:
        node = self.nodes.get(nid)
        if node is None or not node.up:
            return None
        try:
            return node, node.client.get_plan(keys, kind=kind)
        except errors.KvpoolError as exc:
            self._failed(node, exc)
            return None

    # -- put ----------------------------------------------------------------------------------

    def put(self, keys: list[bytes], views: list[memoryview], checksums: list[int], traffic_class: str,
            kind: int) -> list[int]:
        """Write-through of a batch to the owners, concurrently; per-item codes."""
        key_array = np.frombuffer(b"".join(keys), dtype=f"V{KEY_BYTES}")
        routes = self.route(key_array)
        codes = [pb.NO_SPACE] * len(keys)

        def one(nid: str, idx: npt.NDArray[np.intp]) -> None:
            node = self.nodes.get(nid)
            if node is None or not node.up:
                return
            ii = idx.tolist()
            try:
                res = node.client.put([keys[i] for i in ii], [views[i] for i in ii], traffic_class, kind,
                                      epoch=self.ring.epoch, checksums=[checksums[i] for i in ii])
            except errors.KvpoolError as exc:
                self._failed(node, exc)
                return
            for i, c in zip(ii, res, strict=True):
                codes[i] = c

        items = list(routes.items())
        if len(items) == 1:
            one(*items[0])
        else:
            list(self._executor.map(lambda kv: one(*kv), items))
        return codes

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        with self.lock:
            for n in self.nodes.values():
                n.client.close()
            self.nodes.clear()
        self.engine.close()
