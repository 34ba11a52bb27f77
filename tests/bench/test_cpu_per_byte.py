"""The benchmark's CPU per byte: CpuMeter counts the CPU of a process's threads inside its
windows only (the measuring thread's own reads of /proc left out), and run.py forms the CPU
ratios and keeps cpu_s_per_gb over rounds."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # --import-mode=importlib does not put the rootdir on sys.path
    sys.path.insert(0, str(ROOT))

from bench.common import CpuMeter, MiB, Row, with_cpu  # noqa: E402
from bench.run import merge_rounds, ratio_values  # noqa: E402


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _spin_in_thread(seconds: float) -> None:
    t = threading.Thread(target=_spin, args=(seconds,))
    t.start()
    t.join(timeout=30)


class _Worker:
    """A thread that spins when told to and lives on (as the measured systems' workers do)."""

    def __init__(self) -> None:
        self.go, self.done, self.quit = threading.Event(), threading.Event(), False
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        while self.go.wait(30) and not self.quit:
            self.go.clear()
            _spin(0.05)
            self.done.set()

    def spin(self) -> None:
        self.done.clear()
        self.go.set()
        assert self.done.wait(30)

    def close(self) -> None:
        self.quit = True
        self.go.set()
        self.thread.join(timeout=30)


def test_a_window_counts_the_cpu_of_the_threads_of_its_processes_and_nothing_outside() -> None:
    meter = CpuMeter({"client": [os.getpid()]})
    worker = _Worker()
    try:
        _spin_in_thread(0.05)  # before any window: not counted
        worker.spin()
        meter.start()
        _spin(0.05)  # the measuring thread
        worker.spin()  # a worker thread of the process
        meter.stop()
        _spin(0.05)  # after the window: not counted
        worker.spin()
    finally:
        worker.close()
    got = meter.seconds()["client"]
    assert 0.09 <= got < 0.2, got


def test_an_empty_window_counts_almost_nothing_though_reading_proc_costs_cpu() -> None:
    meter = CpuMeter({"client": [os.getpid()], "other": [os.getppid()]})
    for _ in range(20):
        meter.start()
        meter.stop()
    assert meter.seconds()["client"] < 0.005


def test_with_cpu_divides_by_the_bytes_moved() -> None:
    meter = CpuMeter({"client": [os.getpid()]})
    meter.start()
    _spin(0.02)
    meter.stop()
    row = with_cpu(Row("s", "get", MiB, 16, gbps=1.0), meter, 10**8)
    assert row.cpu_s_per_gb is not None and row.cpu_split is not None
    assert row.cpu_s_per_gb == pytest.approx(10 * meter.seconds()["client"], rel=0.01)
    assert set(row.cpu_split) == {"client"}


def _row(system: str, op: str, cpu: float | None) -> Row:
    return Row(system, op, MiB, 16, gbps=1.0, p50_ms=16.0, reps=5, cpu_s_per_gb=cpu,
               cpu_split=None if cpu is None else {"client": cpu})


def test_cpu_ratios_divide_cpu_per_gb_and_say_when_a_side_has_none() -> None:
    table = {"x_cpu": ("cpu", ("kvpool_sidecar", "remote_get"), ("tcp_stream_2conn", "get"), "<= 1.5", "")}
    values, missing = ratio_values([_row("kvpool_sidecar", "remote_get", 0.6),
                                    _row("tcp_stream_2conn", "get", 0.4)], table)
    assert values["x_cpu"] == pytest.approx(1.5)
    values, missing = ratio_values([_row("kvpool_sidecar", "remote_get", None),
                                    _row("tcp_stream_2conn", "get", 0.4)], table)
    assert values["x_cpu"] is None and "x_cpu" in missing


def test_rounds_keep_the_median_cpu_per_gb() -> None:
    rows = merge_rounds([[_row("s", "get", c)] for c in (0.3, 0.9, 0.5)])
    assert rows[0].cpu_s_per_gb == pytest.approx(0.5)
    assert rows[0].cpu_split == {"client": pytest.approx(0.5)}
