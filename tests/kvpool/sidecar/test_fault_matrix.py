"""The fault matrix of issue 19 on real processes: a checked load of 4 clients over 2 sidecars
and 2 store nodes, and one fault per test (SIGKILL + restart, SIGSTOP + SIGCONT; of a sidecar
and of a store node).  The driver is ``bench/faults.py`` (its docstring says what is run and
counted); ``python bench/faults.py`` runs the same over several rounds and prints latencies.

Asserted: no wrong byte; no hang (every call, match, get or put, returns, none after more than
HANG_BOUND_S — the latency targets of the issue, p99 ≤ 250 ms and max ≤ 1 s during a SIGSTOP,
are measured by the bench, not asserted here); every client reads correctly again after the
fault; across a sidecar SIGKILL at least 90 % of the objects in its
local tier are served from that tier again (adopted, without a pool read).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:  # --import-mode=importlib does not put the rootdir on sys.path
    sys.path.insert(0, str(ROOT))

from bench import faults  # noqa: E402

HANG_BOUND_S = 2.5
"""No call may take longer, whatever the fault: the issue's target is 1 s during a SIGSTOP; this is
a hang bound for a loaded 2-core CI machine, above a client-side match bound of 2 s."""
KEPT_SHARE = 0.9


@pytest.mark.parametrize("name", list(faults.FAULTS))
def test_fault_matrix(name: str) -> None:
    fault = faults.FAULTS[name]
    o = faults.run_fault(fault)
    detail = f"{faults.summary_line(o)}\n{json.dumps(o.to_json(), default=str)}"
    # The setup did what it says: the probe was in sidecar 0's local tier, nothing was evicted
    # before the fault, the exposed clients were calling during the fault window, and sidecar 1's
    # reads went to the store nodes.
    assert o.probe_local_before == o.probe_objects, detail
    assert o.evicted_before == 0, detail
    assert o.match_exposed.n > 0 and o.read_objects > 0, detail
    assert o.reader_pool_hits > 0, detail  # sidecar 1's clients read from the store nodes
    assert o.wrong_bytes == 0 and o.probe_wrong_bytes == 0, detail
    assert not o.hung, detail
    assert o.max_call_ms <= HANG_BOUND_S * 1e3, detail
    assert all(o.recovered), detail
    if fault.name == "sidecar-kill":
        assert o.kept_share is not None and o.kept_share >= KEPT_SHARE, detail


# -- the harness's own pure parts (what the assertions above rest on) -----------------------------


def test_wrong_bytes_sees_another_objects_bytes_and_a_wrong_size() -> None:
    sizes = faults.Settings().sizes
    a, b = faults.chain(0, "x", 2)
    right = faults.expected(a, sizes)
    assert faults.wrong_bytes(a, right, sizes) == 0
    assert faults.wrong_bytes(a, faults.expected(b, sizes), sizes) > 0
    assert faults.wrong_bytes(a, np.resize(faults.expected(b, sizes), len(right)), sizes) > 0
    assert faults.wrong_bytes(a, right[:-1], sizes) == 1
    flipped = right.copy()
    flipped[100] ^= 1
    assert faults.wrong_bytes(a, flipped, sizes) == 1


def test_window_takes_calls_that_overlap_it_and_recovery_needs_a_right_read_and_no_wrong_one() -> None:
    c = faults.Call
    calls = [c(0, 0, "get", 0.0, 1.0, True), c(0, 0, "get", 9.0, 5.0, False, "InFlight"),
             c(0, 0, "match", 4.0, 0.1, True), c(0, 0, "get", 11.0, 0.1, True)]
    assert faults.in_window(calls, 5.0, 10.0) == [calls[1]]
    assert faults.in_window(calls, 0.5, 4.0) == [calls[0], calls[2]]
    assert faults.recovered(calls, 10.0)
    assert not faults.recovered([*calls, c(0, 0, "get", 12.0, 0.1, False, "WrongBytes")], 10.0)
    assert not faults.recovered(calls[:3], 10.0)
    lat = faults.latency([0.001, 0.002, 0.003])
    assert lat.n == 3 and lat.p50_ms == 2.0 and lat.max_ms == 3.0
