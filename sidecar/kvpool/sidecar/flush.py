"""The sidecar's drain (SIGTERM, ``Flush``): every local-only object to the pool by a deadline.

Local-only objects are those in the local tier that the pool does not hold (write-back blocks,
state objects, write-through blocks whose write failed or was shed) and the copies of evicted
objects that wait for a retry in the :class:`~kvpool.sidecar.writer.Writer`.  They are written
hottest first, 16 at a time; a write that fails for a passing reason is tried again, in rounds
with short growing pauses, until the deadline; what the pool refuses, or what is not there by
the deadline, is reported dropped (and logged).
"""

from __future__ import annotations

import logging
import time

from kvpool.core.retry import DONE, REFUSED, UNREACHABLE, drain_pause, outcome
from kvpool.sidecar.local_tier import LocalEntry, LocalTier
from kvpool.sidecar.writer import Writer

log = logging.getLogger("kvpool.sidecar")


def flush(writer: Writer, local: LocalTier, seconds: float) -> tuple[int, int, int]:
    """Push every local-only object to the pool within ``seconds``: (flushed, bytes, dropped)."""
    deadline = time.monotonic() + seconds
    if not writer.pool.enabled:
        return 0, 0, len(local.local_only())
    flushed = nbytes = lost = 0
    refused: set[int] = set()  # id of a local object the pool refused: not sent again
    copies: dict[LocalEntry, bytes] = {}
    rounds = 0  # rounds that had a passing failure
    while True:
        copies.update(writer.take_retries())
        items = [e for e in local.local_only() if id(e) not in refused]
        if not items and not copies:
            if not writer.sending() or time.monotonic() >= deadline:
                break
            time.sleep(0.01)  # the pool writer is still at the write-through backlog
            continue
        done, failed = _round(writer, local, items, copies, refused, deadline)
        flushed += len(done)
        nbytes += sum(e.size for e in done)
        lost += sum(1 for e in failed if e in copies and outcome(failed[e]) == REFUSED)
        for e in done + [e for e in failed if outcome(failed[e]) == REFUSED]:
            copies.pop(e, None)
        passing = sum(1 for c in failed.values() if outcome(c) != REFUSED)
        left = deadline - time.monotonic()
        if passing and left > 0:
            if not rounds:
                log.warning("flush: %d objects not written for a passing reason; trying again until the "
                            "deadline (%.1fs)", passing, left)
            rounds += 1
            time.sleep(drain_pause(rounds, left))
        elif left <= 0 or not passing and not writer.sending():
            break
    dropped = len(local.local_only()) + len(copies) + lost
    if dropped:
        log.warning("flush: %d local-only objects dropped: not in the pool by the deadline or refused by it",
                    dropped)
    return flushed, nbytes, dropped


def _round(writer: Writer, local: LocalTier, items: list[LocalEntry], copies: dict[LocalEntry, bytes],
           refused: set[int], deadline: float) -> tuple[list[LocalEntry], dict[LocalEntry, int]]:
    """One write of each local object ``items`` and evicted copy, 16 at a time (the local ones
    pinned meanwhile), none started past ``deadline``: (those the pool now holds, those that
    failed → their code); a refused local object's id goes into ``refused``."""
    done: list[LocalEntry] = []
    failed: dict[LocalEntry, int] = {}

    def write(batch: list[LocalEntry], data: list[bytes] | None) -> None:
        codes: dict[int, int] = {}
        try:
            writer.push(batch, data, codes)
        except Exception:
            log.exception("flush: pool write failed")
        for e in batch:
            if id(e) not in codes and e.pooled:
                continue  # the pool writer wrote it meanwhile
            code = codes.get(id(e), UNREACHABLE)
            if outcome(code) == DONE:
                done.append(e)
            else:
                failed[e] = code
                if data is None and outcome(code) == REFUSED:
                    refused.add(id(e))

    for start in range(0, len(items), 16):
        if time.monotonic() >= deadline:
            return done, failed
        lease = local.lease(items[start:start + 16], 60_000)
        try:
            # Evicted meanwhile: already handed to the writer as copies (left out of the lease).
            write(list(lease.entries), None)
        finally:
            local.release([lease.lease_id])
    pairs = list(copies.items())
    for start in range(0, len(pairs), 16):
        if time.monotonic() >= deadline:
            break
        write([e for e, _ in pairs[start:start + 16]], [c for _, c in pairs[start:start + 16]])
    return done, failed
