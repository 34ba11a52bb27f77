"""Stop signals for a command's serving loop, seen by a thread of their own, not by a Python handler.

Every long-running command (store node, sidecar, router, ``kvpool up``, loadgen ``--hold``)
serves until SIGTERM or SIGINT and then stops gracefully: the sidecar flushes what is only
local, the store node closes its tiers.  The obvious way, a Python handler that calls
``stop.set()`` on the :class:`threading.Event` the main thread waits on, fails in two ways:

* Python runs a handler only on the main thread, and only between bytecodes.  The kernel may
  deliver a process's signal to any of its threads (gRPC's, a client's); then CPython's C-level
  handler just notes it, and a main thread blocked in ``Event.wait()`` (a lock acquire with no
  timeout) is never woken to run the Python one.  Measured here: ``kvpool loadgen --hold`` hung
  on 1 of 20 SIGTERMs (the main thread in ``Event.wait``, the handler never run), and a signal
  sent to a non-main thread with ``pthread_kill`` hangs it every time.
* When the handler does run between the bytecodes of the main thread's own ``Event.wait`` that
  hold the event's non-reentrant lock, its ``set()`` waits for a lock its own thread holds,
  forever: a main thread looping on ``stop.wait(0)`` hung on 4 of 10 SIGTERMs.

In a pod the kubelet then waits out the grace period and kills the process, and a write-back
sidecar loses what it had not flushed.  So the signal's number goes to a pipe through
:func:`signal.set_wakeup_fd`, which CPython's C-level handler writes in whichever thread the
signal lands, and a relay thread blocked on the pipe's other end sets the event.  The Python
handlers do nothing; they are there so that the signals are caught at all.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Sequence

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def stop_on_signals(signums: Sequence[int] = STOP_SIGNALS) -> threading.Event:
    """An event set when one of ``signums`` arrives.  From the main thread, once per process (it
    takes the process's one wakeup fd, and the handlers stay for the life of the process, as a
    command's main wants; not for a thread running an asyncio loop, which wants that fd)."""
    stop = threading.Event()
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # the C handler never blocks; a full pipe drops the byte
    wanted = {int(s) for s in signums}

    def relay() -> None:
        while True:
            got = os.read(read_end, 64)
            if not got or wanted.intersection(got):
                stop.set()
                return

    threading.Thread(target=relay, name="stop-signal", daemon=True).start()
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    for signum in signums:
        signal.signal(signum, _noted)
    return stop


def _noted(_signum: int, _frame: object) -> None:
    """The Python side of a stop signal: nothing (the wakeup fd carried it to the relay)."""
