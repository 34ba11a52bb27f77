"""Finding and ending processes by a marker in their environment.

Every process the harness starts carries markers (``KVPOOL_E2E_RUN_ID`` for the cluster,
``KVPOOL_E2E_POD_UID`` for one pod). Killing a process group misses a child that started its
own session; its environment, inherited unless it was cleared on purpose, still names it.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path


def kill_marked(name: str, value: str, sig: int = signal.SIGKILL) -> int:
    """Send ``sig`` to every process whose environment has ``name=value``; return the count."""
    needle = f"{name}={value}".encode()
    hit = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone already, or a kernel thread
            continue
        if needle in environ.split(b"\0"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), sig)
                hit += 1
    return hit
