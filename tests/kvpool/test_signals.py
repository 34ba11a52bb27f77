"""A stop signal stops a command's serving loop wherever it lands (kvpool.core.signals).

Two ways a Python handler calling ``stop.set()`` fails, each reproduced here: the signal lands on
another thread than the main one, which then sleeps on in ``Event.wait()`` (a handler runs only
on the main thread); or the handler runs between the bytecodes of the main thread's own
``stop.wait`` that hold the event's non-reentrant lock, and deadlocks.  With such a handler put
back, the first test hung every time and the second on some attempts.  Real processes, real
signals.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

CHILD = """
import threading
from kvpool.core.signals import stop_on_signals
stop = stop_on_signals()
print("up", flush=True)
while not stop.wait(0):  # as much time as possible inside Event.wait's lock
    pass
print("stopped", flush=True)
"""


ON_ANOTHER_THREAD = """
import signal, threading, time
from kvpool.core.signals import stop_on_signals
stop = stop_on_signals()

def poke() -> None:  # the signal lands on this thread, as the kernel may choose (gRPC's threads)
    time.sleep(0.2)
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

threading.Thread(target=poke).start()
stop.wait()  # as the commands wait: no timeout
print("stopped", flush=True)
"""


def test_a_stop_signal_on_another_thread_wakes_the_main_thread() -> None:
    child = subprocess.Popen([sys.executable, "-c", ON_ANOTHER_THREAD], stdout=subprocess.PIPE, text=True)
    try:
        out, _ = child.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail("still waiting 10 s after a SIGTERM delivered to another thread")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    assert child.returncode == 0 and out.strip() == "stopped"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_inside_the_wait_stops_the_loop_every_time(signum: int) -> None:
    for attempt in range(8):
        child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "up"
            time.sleep(0.05 * (attempt % 3))  # land at different points of the loop
            child.send_signal(signum)
            try:
                out, _ = child.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                pytest.fail(f"attempt {attempt}: still running 10 s after signal {signum}: deadlocked")
            assert child.returncode == 0 and out.strip() == "stopped"
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(10)


def test_a_burst_of_signals_neither_blocks_nor_kills_the_process() -> None:
    """More signals than the pipe holds: the handler never blocks (the pipe is non-blocking) and the
    loop stops once."""
    child = subprocess.Popen([sys.executable, "-c", CHILD.replace("while not", "import os, signal\n"
                              "for _ in range(100000): os.kill(os.getpid(), signal.SIGTERM)\nwhile not")],
                             stdout=subprocess.PIPE, text=True)
    try:
        out, _ = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    assert child.returncode == 0 and out.split() == ["up", "stopped"]
