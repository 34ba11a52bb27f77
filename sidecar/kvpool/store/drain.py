"""Drain: a leaving node pushes its objects, hottest first, to their owners in the new ring.

Runs in a background thread of the draining node until every object moved or the deadline
passed; what could not move by then is counted as dropped.  With a bandwidth bound the pusher
sleeps whenever it is ahead of ``max_bytes_per_second`` (so a drain under load does not take the
network and the cores from serving); the deadline still wins.  Writes use the owning tenant's token,
so the objects land in the same tenant partition at the new owner.
"""

from __future__ import annotations

import logging
import time

from ..proto import store_pb2 as pb
from ..ring import Ring
from ..store_client import StoreClient
from ..transfer import TransferEngine
from .node import DEFAULT_TENANT, Entry, StoreNode

log = logging.getLogger("kvpool.store.drain")


def pace_delay(sent_bytes: int, elapsed_s: float, max_bytes_per_second: int) -> float:
    """Seconds to wait so that ``sent_bytes`` in ``elapsed_s`` stays within the bound (pure)."""
    if max_bytes_per_second <= 0:
        return 0.0
    return max(0.0, sent_bytes / max_bytes_per_second - elapsed_s)


def run_drain(node: StoreNode, ring: Ring, progress: object, max_bytes_per_second: int = 0) -> None:
    p = progress  # DrainProgress; typed loosely to avoid an import cycle with the service
    deadline = p.deadline_unix_ms / 1000.0
    started = time.monotonic()
    active = ring.active
    engine = TransferEngine()
    clients: dict[tuple[str, str], StoreClient] = {}
    objects = list(node.objects_hottest_first())
    p.remaining_objects = len(objects)  # type: ignore[attr-defined]
    try:
        if not active:
            raise RuntimeError("no active member to drain to")
        owners = ring.owners_of([e.key for e in objects]) if objects else []
        for e, owner_idx in zip(objects, owners, strict=True):
            wait = pace_delay(p.moved_bytes + p.dropped_bytes,  # type: ignore[attr-defined]
                              time.monotonic() - started, max_bytes_per_second)
            if wait > 0:
                time.sleep(min(wait, max(0.0, deadline - time.time())))
            if time.time() >= deadline:
                break
            target = active[int(owner_idx)]
            tenant = node.tenants.get(e.tenant)
            token = tenant.token if tenant is not None else ""
            if e.tenant != DEFAULT_TENANT and not token:
                # A tenant without a token (revoked) cannot be written at the target as itself;
                # without a token its objects would land in the target's open default partition.
                ok = False
            else:
                ck = (target.address, token)
                client = clients.get(ck)
                if client is None:
                    client = clients[ck] = StoreClient(target.address, token, engine=engine)
                ok = _push(node, client, e, ring.epoch)
            if ok:
                p.moved_objects += 1  # type: ignore[attr-defined]
                p.moved_bytes += e.size  # type: ignore[attr-defined]
            else:
                p.dropped_objects += 1  # type: ignore[attr-defined]
                p.dropped_bytes += e.size  # type: ignore[attr-defined]
            p.remaining_objects -= 1  # type: ignore[attr-defined]
    except Exception:
        log.exception("drain failed")
    finally:
        # Whatever is left when the deadline hits is dropped: count it, never hide it.
        left = p.remaining_objects  # type: ignore[attr-defined]
        if left:
            p.dropped_objects += left  # type: ignore[attr-defined]
            p.dropped_bytes += sum(e.size for e in objects[-left:])  # type: ignore[attr-defined]
            p.remaining_objects = 0  # type: ignore[attr-defined]
        p.state = "done"  # type: ignore[attr-defined]
        for c in clients.values():
            c.close()
        engine.close()
        log.info("drain done: moved %d objects (%d bytes), dropped %d", p.moved_objects,  # type: ignore[attr-defined]
                 p.moved_bytes, p.dropped_objects)  # type: ignore[attr-defined]


def _push(node: StoreNode, client: StoreClient, e: Entry, epoch: int) -> bool:
    """Write one object to ``client``'s node; True when it is there now (OK, or ALREADY_EXISTS:
    nothing was sent); False when it could not be read here or the target refused or failed."""
    result: list[int] = []

    def sink(view: memoryview) -> None:
        result.extend(client.put([e.key], [view], traffic_class=e.traffic_class or "chatbot", kind=e.kind,
                                 epoch=epoch, checksums=[e.checksum]))

    try:
        if not node.read_object(e, sink):
            return False
    except Exception as exc:  # a dead target drops this object, the push goes on
        log.warning("push of one object failed: %s", exc)
        return False
    return bool(result) and result[0] in (pb.OK, pb.ALREADY_EXISTS)
