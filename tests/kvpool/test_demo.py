"""`kvpool demo` at reduced size on real LocalClusters (ISSUE 3 §4): the shape of the result.

Random routing without the pool recomputes far more than the workload's floor; with the shared
pool every cell sits at the floor whatever the routing and local capacity; session-sticky
routing without the pool gets worse when local capacity shrinks; every block read back is
byte-exact.  No mocks: store nodes and sidecars are real processes.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from kvpool import KeySpace
from kvpool.apps import demo
from kvpool.wire.counters import SidecarCounter
from kvpool.wire.proto import store_pb2 as pb

SESSIONS = 40  # capacities scale with sessions/300: 1067 and 267 blocks


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any], str, str]:
    """`kvpool demo` at reduced size, once, in its own process as a user runs it."""
    d = tmp_path_factory.mktemp("demo")
    path = d / "demo.json"
    proc = subprocess.run([sys.executable, "-m", "kvpool", "demo", "--sessions", str(SESSIONS), "--verify-every", "1",
                           "--json", str(path)], capture_output=True, text=True, timeout=280)
    assert path.exists(), proc.stderr[-3000:]
    return proc.returncode, json.loads(path.read_text()), proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def result(run: tuple[int, dict[str, Any], str, str]) -> dict[str, Any]:
    return run[1]


def _cells(out: dict[str, Any], **match: object) -> list[dict[str, Any]]:
    return [c for c in out["cells"] if all(c[k] == v for k, v in match.items())]


def test_workload_is_deterministic_and_as_specified() -> None:
    a, b = demo.build_workload(SESSIONS), demo.build_workload(SESSIONS)
    assert a.order == b.order
    assert a.keys() == b.keys()
    assert demo.build_workload(SESSIONS, seed=1).order != a.order
    assert all(demo.MIN_TURNS <= t <= demo.MAX_TURNS for t in a.turns_of)
    assert len(a.order) == int(a.turns_of.sum())
    # Each session's turns arrive in order, interleaved with other sessions'.
    seen: dict[int, int] = {}
    for s, k in a.order:
        assert k == seen.get(s, -1) + 1
        seen[s] = k
    assert any(a.order[i][0] != a.order[i + 1][0] for i in range(len(a.order) - 1))
    # Keys of the chained history equal keys of the whole history hashed at once.
    space = KeySpace("kvpool-demo/chat-8b", block_tokens=demo.BLOCK_TOKENS)
    s = 0
    full = np.concatenate([a.system[int(a.system_of[s])], a.bodies[s]])
    assert space.block_keys(full) == a.keys()[s]
    assert len(a.keys()[s]) == (demo.SYSTEM_TOKENS + int(a.turns_of[s]) * 384) // demo.BLOCK_TOKENS


def test_floor_is_what_each_turn_adds(result: dict[str, Any]) -> None:
    wl = demo.build_workload(SESSIONS)
    prompts_used = len({int(p) for p in wl.system_of})
    # 128 new user tokens per turn, and each system prompt once (its first turn computes it all).
    assert result["floor_tokens"] == len(wl.order) * demo.USER_TOKENS + prompts_used * demo.SYSTEM_TOKENS
    assert result["workload"]["prompt_tokens"] == wl.total_prompt_tokens
    assert 0.05 < result["floor_share"] < 0.2


def test_shape(result: dict[str, Any]) -> None:
    floor = result["floor_share"]
    assert len(result["cells"]) == 8
    report = {c["name"]: round(c["recompute_share"], 3) for c in result["cells"]}
    for c in _cells(result, routing="random", pool=False):
        assert c["recompute_share"] > 1.6 * floor, report
    for c in _cells(result, pool=True):
        assert floor - 1e-9 <= c["recompute_share"] <= floor + 0.05, report
    big, small = sorted(_cells(result, routing="sticky", pool=False), key=lambda c: -c["local_blocks"])
    assert small["recompute_share"] > big["recompute_share"] + 0.1, report
    # Every cell replays the same workload.
    assert {c["prompt_tokens"] for c in result["cells"]} == {result["workload"]["prompt_tokens"]}


def test_bytes_exact_and_moved(result: dict[str, Any]) -> None:
    assert result["mismatches"] == 0
    assert result["local_leftovers"] == 0
    for c in result["cells"]:
        assert c["verified_blocks"] > 0, c["name"]
        assert c["get_failures"] == 0 and c["put_failures"] == 0, c
        assert c["local_read_bytes"] > 0, c["name"]
        if c["pool"]:
            # Write-through: every block put reached the pool (deferred ones included) by the end.
            pool = {k: v for k, v in c["counters"].items() if k.startswith(("pool_", "local_only", "put_"))}
            written, put = c["counters"].get(SidecarCounter.POOL_WRITES, 0), c["counters"][SidecarCounter.PUT_BLOCKS]
            assert written >= put > 0, (c["name"], pool)
        else:
            assert c["pool_read_bytes"] == 0 and c["pool_write_bytes"] == 0, c
    # With tight local tiers and random routing, the pool serves a large part of the hits.
    rnd_small = min(_cells(result, routing="random", pool=True), key=lambda c: c["local_blocks"])
    assert rnd_small["pool_read_bytes"] > rnd_small["local_read_bytes"]
    text = demo.format_report(result)
    assert "floor" in text and "mismatches: 0" in text and len(text.splitlines()) >= 15


def test_read_codes_are_shed_or_failed() -> None:
    """Issue 24: a block a store node did not deliver in time (UNAVAILABLE) is a shed read, any
    other block missing from a matched prefix a failure; the engine loads the leading run."""
    ok, gone, slow = pb.OK, pb.NOT_FOUND, pb.UNAVAILABLE
    assert demo.classify_read([ok] * 3) == (3, {}, 0)
    assert demo.classify_read([ok, slow, ok, slow]) == (1, {"UNAVAILABLE": 2}, 0)
    assert demo.classify_read([slow, gone, ok]) == (0, {"UNAVAILABLE": 1}, 1)
    for code in (pb.NOT_FOUND, pb.LEASE_EXPIRED, pb.CHECKSUM, pb.NO_SPACE, pb.INVALID):
        assert demo.classify_read([ok, code]) == (1, {}, 1), code


def test_shed_reads_are_reported_and_do_not_fail_the_run(result: dict[str, Any]) -> None:
    out = copy.deepcopy(result)
    assert not demo.failed(out)
    cell = _cells(out, routing="sticky", pool=True)[0]
    cell.update(shed_reads=2, shed_blocks={"UNAVAILABLE": 7, "DeadlineExceeded": 3}, shed_calls={"put: Suspect": 1})
    assert not demo.failed(out)
    text = demo.format_report(out)
    assert "2 reads shed at a deadline (3 DeadlineExceeded, 7 UNAVAILABLE blocks" in text
    assert "calls shed at the client's deadline: 1 put: Suspect" in text
    cell["get_failures"] = 1
    assert demo.failed(out) and "get_failures=1" in demo.format_report(out)


def test_cli(run: tuple[int, dict[str, Any], str, str]) -> None:
    rc, out, stdout, stderr = run
    assert rc == 0, stderr[-3000:]  # 0: no mismatches, failed gets or puts; local tiers emptied between cells
    assert stdout == demo.format_report(out) + "\n"
    assert "recomputed" in stderr and "done]" in stderr  # the progress lines
    assert "Traceback" not in stderr and "fork_posix" not in stderr
    cells = demo.select_cells(demo.all_cells([1067, 267]), "sticky/no-pool,random/pool/267")
    assert [c.name for c in cells] == ["random/pool/267", "sticky/no-pool/1067", "sticky/no-pool/267"]
    assert demo.main(["--cells", "nonesuch", "--no-progress"]) == 2
    assert demo.main(["--sessions", "0", "--no-progress"]) == 2
