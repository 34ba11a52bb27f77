"""Pushing a node's objects to other nodes in batches: shared by the drain and the warm push.

Both walk the node's objects hottest first, split the walk into runs bound for one target
(one put each: a few round trips instead of one per object), pace the runs by a bandwidth
bound and stop at a deadline.  The splitting and the pacing are pure; :func:`push_batch` does
the reading and the put; :class:`Targets` keeps one client per (target, tenant token).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ..store_client import StoreClient
from ..transfer import TransferEngine
from .node import DEFAULT_TENANT, Entry, StoreNode

log = logging.getLogger("kvpool.store.push")

BATCH_OBJECTS = 16
BATCH_BYTES = 4 << 20


def pace_delay(sent_bytes: int, elapsed_s: float, max_bytes_per_second: int) -> float:
    """Seconds to wait so that ``sent_bytes`` in ``elapsed_s`` stays within the bound (pure)."""
    if max_bytes_per_second <= 0:
        return 0.0
    return max(0.0, sent_bytes / max_bytes_per_second - elapsed_s)


def batch_cap(max_bytes_per_second: int) -> int:
    """Bytes one batch may carry: at most ~0.1 s of the rate, so the pacing stays fine-grained (pure)."""
    return min(BATCH_BYTES, max_bytes_per_second // 10) if max_bytes_per_second > 0 else BATCH_BYTES


def batches(entries: Sequence[Any], targets: Sequence[int], max_objects: int = BATCH_OBJECTS,
            max_bytes: int = BATCH_BYTES) -> list[tuple[int, list[Any]]]:
    """Split the push, in its order, into (target, entries) runs of one target, tenant, traffic
    class and kind, at most ``max_objects`` and (unless one object alone is larger) ``max_bytes``
    each: one put per run (pure).  The runs keep the order: the hottest object goes first."""
    out: list[tuple[int, list[Any]]] = []
    size = 0
    for e, t in zip(entries, targets, strict=True):
        if out:
            tgt, run = out[-1]
            same = (tgt == t and run[0].tenant == e.tenant and run[0].traffic_class == e.traffic_class
                    and run[0].kind == e.kind)
            if same and len(run) < max_objects and size + e.size <= max_bytes:
                run.append(e)
                size += e.size
                continue
        out.append((t, [e]))
        size = e.size
    return out


def push_batch(node: StoreNode, client: StoreClient, batch: Sequence[Entry], epoch: int) -> dict[int, int]:
    """One put of ``batch`` to ``client``'s node; id(entry) → code for those read here (the put
    asks first, so ALREADY_EXISTS costs no bytes).  Empty when the target failed."""
    codes: dict[int, int] = {}

    def sink(held: list[Entry], views: list[memoryview]) -> None:
        got = client.put([e.key for e in held], views, traffic_class=held[0].traffic_class or "chatbot",
                         kind=held[0].kind, epoch=epoch, checksums=[e.checksum for e in held])
        codes.update((id(e), c) for e, c in zip(held, got, strict=True))

    try:
        node.read_objects(batch, sink)
    except Exception as exc:  # a dead target fails this batch, the push goes on
        log.warning("push of %d objects failed: %s", len(batch), exc)
        return {}
    return codes


class Targets:
    """One client per (target address, tenant token), over one transfer engine; a context manager."""

    def __init__(self, node: StoreNode) -> None:
        self.node = node
        self.engine = TransferEngine()
        self.clients: dict[tuple[str, str], StoreClient] = {}

    def client(self, address: str, tenant_id: str) -> StoreClient | None:
        """The client writing ``tenant_id``'s objects to ``address``; None for a tenant without a
        token (revoked): written without one, its objects would land in the open default partition."""
        tenant = self.node.tenants.get(tenant_id)
        token = tenant.token if tenant is not None else ""
        if tenant_id != DEFAULT_TENANT and not token:
            return None
        ck = (address, token)
        c = self.clients.get(ck)
        if c is None:
            c = self.clients[ck] = StoreClient(address, token, engine=self.engine)
        return c

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        self.engine.close()

    def __enter__(self) -> Targets:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
