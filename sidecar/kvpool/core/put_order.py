"""Batch order for a put cut into parts over several data-session connections.

A writer sends the parts of one batch concurrently (each on its own connection, so their bytes
move at once), but quota and space must still go to the earliest items, as in one frame: a
prefix cache's later blocks are worthless without the earlier ones.  Each part carries an order
ticket (the batch's random number and the part's index, :func:`kvpool.wire.store_frames.
order_ticket`); the node reserves part k only once part k-1 of the same tenant and batch has
reserved, or once ``wait_seconds`` have passed (a lost or slow part must not hold up the rest:
the order is then lost for that batch, never the data).

Bounded: a batch is forgotten once its last part reserved or after ``keep_seconds``.
"""

from __future__ import annotations

import threading
import time
from collections import deque

#: How long part k waits for part k-1 to reserve.  Its request left the writer at the same
#: moment, so under normal load it arrives within a round trip; the bound is for a part lost
#: on its way (a connection that broke) or a node too busy to read it.
WAIT_SECONDS = 0.25
KEEP_SECONDS = 30.0


class PutOrder:
    """Which parts of which batches have reserved; see the module docstring."""

    def __init__(self, wait_seconds: float = WAIT_SECONDS, keep_seconds: float = KEEP_SECONDS) -> None:
        self.wait_seconds = wait_seconds
        self.keep_seconds = keep_seconds
        self._cond = threading.Condition()
        self._done: dict[tuple[str, int], int] = {}  # (tenant, batch) -> bit mask of parts reserved
        self._born: deque[tuple[float, tuple[str, int]]] = deque()
        self.waited_out = 0  # parts that stopped waiting for their predecessor (order lost)

    def wait_turn(self, tenant: str, batch: int, part: int) -> bool:
        """Block until parts 0..part-1 of the batch have reserved; False if the wait ran out."""
        if part <= 0:
            return True
        key = (tenant, batch)
        before = (1 << part) - 1
        with self._cond:
            if self._cond.wait_for(lambda: self._done.get(key, 0) & before == before, self.wait_seconds):
                return True
            self.waited_out += 1
            return False

    def reserved(self, tenant: str, batch: int, part: int, parts: int) -> None:
        """Part ``part`` of ``parts`` reserved (or failed: its successors need not wait)."""
        key = (tenant, batch)
        now = time.monotonic()
        with self._cond:
            if key not in self._done:
                self._born.append((now, key))
            done = self._done.get(key, 0) | (1 << part)
            if done == (1 << parts) - 1:
                self._done.pop(key, None)  # the last part: nobody waits on this batch again
            else:
                self._done[key] = done
            while self._born and now - self._born[0][0] > self.keep_seconds:
                self._done.pop(self._born.popleft()[1], None)
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._done)
