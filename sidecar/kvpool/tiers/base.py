"""What every tier below DRAM shares: injected faults for tests of slow disks."""

from __future__ import annotations

import time


class FaultDelay:
    """Test hook (fault injection): while the file at ``path`` exists, each SSD or shared-fs read,
    write, stat and removal first sleeps the seconds it holds (a float; unreadable or empty: none).

    Set by the store's ``--fault-tier-delay-file`` (or ``faultTierDelayFile``) only: it stands in
    for a slow or hung disk in tests, where no throttled device (dm-delay) or FUSE mount is at
    hand.  Unset, it costs one attribute test per I/O.
    """

    def __init__(self, path: str = "") -> None:
        self.path = path

    def __call__(self) -> None:
        if not self.path:
            return
        try:
            with open(self.path) as f:
                delay = float(f.read().strip() or 0)
        except (OSError, ValueError):
            return
        if delay > 0:
            time.sleep(delay)


def advance(bufs: list[bytes | memoryview], n: int) -> list[bytes | memoryview]:
    """Drop the first ``n`` bytes written by writev from a buffer list."""
    out: list[bytes | memoryview] = []
    for b in bufs:
        if n >= len(b):
            n -= len(b)
            continue
        out.append(memoryview(b)[n:] if n else b)
        n = 0
    return out
