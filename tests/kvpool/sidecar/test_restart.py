"""A sidecar restart (SIGKILL, then a new process on the same socket and arena directory: what a
pod's native sidecar with ``restartPolicy: Always`` goes through) never hands a client another
object's bytes, and keeps the pod's cache: the new sidecar adopts the arena and its journal,
checks every object, and resumes writing what exists only here to the pool."""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest

from kvpool import errors
from kvpool.local import LocalCluster
from kvpool.proto import store_pb2 as pb

KiB, MiB = 1 << 10, 1 << 20


def _wrong(client: Any, keys: list[bytes], values: list[bytes]) -> tuple[int, int, int]:
    """(right, wrong, errors) of reading each key alone, in reverse order (so a new sidecar's
    extents differ from the old ones), by ``get`` then ``get_into``."""
    right = wrong = failed = 0
    for k, v in zip(reversed(keys), reversed(values), strict=True):
        try:
            with client.get([k]) as got:
                ok = bytes(got[0]) == v
            right += ok
            wrong += not ok
        except errors.KvpoolError:
            failed += 1
        buf = np.zeros(len(v) + 16, np.uint8)
        try:
            size = client.get_into([k], [buf])[0]
        except errors.KvpoolError:
            failed += 1
            continue
        if size < 0:
            failed += 1
        elif size == len(v) and buf[:size].tobytes() == v:
            right += 1
        else:
            wrong += 1
    return right, wrong, failed


def test_old_client_never_reads_another_objects_bytes_after_a_sigkill(rng: random.Random) -> None:
    """Finding 1: the client kept its mapping of the dead sidecar's arena and applied the new
    sidecar's offsets to it (32 of 32 objects came back with other objects' bytes)."""
    with LocalCluster(stores=1, sidecars=1, local_bytes=16 * MiB) as lc:
        keys = [rng.randbytes(32) for _ in range(32)]
        values = [rng.randbytes(64 * KiB) for _ in keys]
        c = lc.connect()
        try:
            assert c.put(keys, values) == [pb.OK] * len(keys)
            assert [bytes(v) for v in c.get(keys)] == values
            deadline = time.monotonic() + 30
            while c.stats().pending_pool_bytes and time.monotonic() < deadline:
                time.sleep(0.05)  # in the pool too: a new sidecar can fetch what it did not keep
            lc.restart_sidecar(0, kill=True)
            right, wrong, failed = _wrong(c, keys, values)
            assert wrong == 0, f"{wrong} reads returned other bytes ({right} right, {failed} errors)"
            # The client carries on: after at most one error per connection it reads again.
            right, wrong, failed = _wrong(c, keys, values)
            assert (wrong, failed) == (0, 0) and right == 2 * len(keys)
            # A put through the old client lands where the new sidecar reads it.
            more = [rng.randbytes(32) for _ in range(8)]
            more_values = [rng.randbytes(48 * KiB) for _ in more]
            assert c.put(more, more_values) == [pb.OK] * len(more)
            with lc.connect() as fresh:
                assert [bytes(v) for v in fresh.get(more)] == more_values
        finally:
            c.close()
