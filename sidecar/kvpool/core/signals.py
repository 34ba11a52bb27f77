"""Stop signals for a command's serving loop, with no lock taken inside the signal handler.

Every long-running command (store node, sidecar, router, ``kvpool up``, loadgen ``--hold``)
serves until SIGTERM or SIGINT and then stops gracefully: the sidecar flushes what is only
local, the store node closes its tiers.  The obvious way, a handler that calls
``stop.set()`` on the :class:`threading.Event` the main thread waits on, can deadlock: Python
runs the handler on the main thread between two bytecodes, and when those are inside
``Event.wait``'s own ``with self._cond`` (taking or giving back the condition's lock, which is
not reentrant), the handler's ``set()`` waits for a lock its own thread holds, forever.  Measured
here: a main thread looping on ``stop.wait(0)`` hung on 4 of 10 SIGTERMs.  In a pod the kubelet
then waits out the grace period and kills the process, and a write-back sidecar loses what it
had not flushed.

So the handler only writes a byte to a pipe (``os.write`` takes no Python lock) and a relay
thread, blocked on the pipe's other end, sets the event.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Sequence

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def stop_on_signals(stop: threading.Event, signums: Sequence[int] = STOP_SIGNALS) -> threading.Event:
    """Set ``stop`` when one of ``signums`` arrives (from the main thread; the handlers stay for
    the life of the process, as a command's main wants).  Returns ``stop``."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # a burst of signals never blocks the handler

    def handler(_signum: int, _frame: object) -> None:
        try:
            os.write(write_end, b"\0")
        except OSError:  # the pipe is full: a byte is already waiting for the relay
            pass

    def relay() -> None:
        os.read(read_end, 1)
        stop.set()

    threading.Thread(target=relay, name="stop-signal", daemon=True).start()
    for signum in signums:
        signal.signal(signum, handler)
    return stop
