"""The serving benchmark's pure half (bench/serving_workload.py): the seeded workload and its
routing, the floor, engine sizes, the per-arm summary and the output check, without engines."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # --import-mode=importlib does not put the rootdir on sys.path
    sys.path.insert(0, str(ROOT))

from bench.serving_workload import (  # noqa: E402
    Shape,
    engine_sizes,
    floor_tokens,
    make_workload,
    output_mismatches,
    per_turn,
    percentile,
    summarize,
    transfer_config,
)


def test_the_workload_is_seeded_and_its_tokens_do_not_depend_on_the_routing() -> None:
    s = Shape(conversations=3, turns=2, system_tokens=10, user_tokens=5, seed=7)
    w1, w2 = make_workload(s), make_workload(s)
    assert w1 == w2
    assert len(w1.system) == 10 and len(w1.turns) == 6
    assert [(t.conversation, t.turn) for t in w1.turns] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    sticky = make_workload(Shape(conversations=3, turns=2, system_tokens=10, user_tokens=5, seed=7,
                                 routing="sticky", spill=0.0))
    assert [t.user for t in sticky.turns] == [t.user for t in w1.turns]
    assert [t.instance for t in sticky.turns] == [0, 1, 0, 0, 1, 0]  # home = conversation mod 2, no spill
    assert make_workload(Shape(seed=8)).system != make_workload(Shape(seed=7)).system
    alt = make_workload(Shape(conversations=2, turns=3, routing="alternate"))
    assert [t.instance for t in alt.turns] == [0, 1, 1, 0, 0, 1]
    with pytest.raises(ValueError, match="routing"):
        make_workload(Shape(routing="nearest"))


def test_floor_and_engine_sizes() -> None:
    s = Shape(conversations=8, turns=5, system_tokens=256, user_tokens=256, answer_tokens=16)
    # the groundwork's run of this shape: floor 11008 tokens
    assert floor_tokens(s) == 256 + 8 * (5 * 256 + 4 * 16) == 11008
    assert engine_sizes(s) == (1792, 1792 // 32 + 8)  # longest request 1616 tokens, rounded up to 256
    assert engine_sizes(s, 2048, 72) == (2048, 72)


def test_summary_percentiles_and_per_turn_curves() -> None:
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0 and percentile([1.0, 2.0], 99) == 2.0
    recs = [{"turn": 0, "prompt": 100, "computed": 100, "ttft": 1.0, "local": 0, "connector": 0},
            {"turn": 1, "prompt": 200, "computed": 50, "ttft": 0.2, "local": 64, "connector": 86}]
    s = summarize(recs, floor=120)
    assert s["computed_tokens"] == 150 and s["recomputed_share"] == 0.5 and s["vs_floor"] == 1.25
    assert s["hit_tokens"] == {"local": 64, "connector": 86, "offload": 0, "tier": 0}
    assert per_turn(recs, 2) == {"recomputed_share": [1.0, 0.25], "ttft_p50": [1.0, 0.2]}


def test_output_check_names_the_request_and_the_first_differing_token() -> None:
    ref = [{"index": 0, "conversation": 0, "turn": 0, "out": [1, 2, 3]},
           {"index": 1, "conversation": 1, "turn": 0, "out": [4, 5]}]
    assert output_mismatches(ref, ref) == []
    got = [ref[0], {**ref[1], "out": [4, 6]}]
    assert output_mismatches(ref, got) == ["request 1 (conversation 1, turn 0): differs from token 1"]


def test_each_arm_configures_its_connector() -> None:
    assert transfer_config("a", "kv_both", "unix:///x", 1) is None
    b = transfer_config("b", "kv_both", "unix:///x", 1)
    assert b is not None and b["kv_connector"] == "KVPoolConnector"
    assert b["kv_connector_extra_config"] == {"address": "unix:///x"}
    pd = transfer_config("pd", "kv_producer", "unix:///x", 1)
    assert pd is not None and pd["kv_role"] == "kv_producer"
    c = transfer_config("c", "kv_both", "unix:///x", 64 << 20)
    assert c is not None and c["kv_connector_extra_config"]["cpu_bytes_to_use"] == 64 << 20
    assert "secondary_tiers" not in c["kv_connector_extra_config"]
    d = transfer_config("d", "kv_both", "unix:///x", 64 << 20)
    assert d is not None and d["kv_connector_extra_config"]["secondary_tiers"][0]["type"] == "KVPoolSecondaryTier"
    with pytest.raises(ValueError):
        transfer_config("e", "kv_both", "", 1)


def test_moved_turns_and_per_round_ratios() -> None:
    from bench.serving_workload import ratios_to

    alt = make_workload(Shape(conversations=2, turns=3, routing="alternate"))
    assert [t.moved for t in alt.turns] == [False, False, True, True, True, True]
    sticky = make_workload(Shape(conversations=2, turns=3, routing="sticky", spill=0.0))
    assert not any(t.moved for t in sticky.turns)
    recs = [{"turn": 1, "moved": True, "prompt": 10, "computed": 5, "ttft": 2.0},
            {"turn": 1, "moved": False, "prompt": 10, "computed": 1, "ttft": 1.0},
            {"turn": 0, "moved": False, "prompt": 10, "computed": 10, "ttft": 9.0}]
    s = summarize(recs, 6)
    assert s["moved"] == {"requests": 1, "recomputed_share": 0.5, "ttft_p50": 2.0}
    assert s["stayed"] == {"requests": 1, "recomputed_share": 0.1, "ttft_p50": 1.0}  # turn 0 is neither
    ref = [{"records": [{"ttft": 4.0}]}, {"records": [{"ttft": 6.0}]}]
    run = [{"records": [{"ttft": 2.0}]}, {"records": [{"ttft": 1.0}]}]
    assert ratios_to(ref, run) == [2.0, 6.0]


def test_an_arm_that_fails_every_round_is_reported_and_the_others_are_summarized(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """run_all's bookkeeping (bench/serving.py) with the engines' part, run_arm, standing in: the
    real engines are tests/integrations/test_serving.py's; a broken engine is not worth two cores."""
    from bench import serving

    wl = make_workload(Shape(conversations=1, turns=2, system_tokens=4, user_tokens=4, answer_tokens=2))

    def run_arm(cfg: object, cluster: object, arm: str, wl_: object, salt: str, probe: bool = False) -> dict:
        if arm == "a":
            raise serving.BenchError("engine 0 exited")
        recs = [{"index": t.index, "conversation": 0, "turn": t.turn, "moved": t.moved, "prompt": 8,
                 "computed": 4, "out": [1, 2], "ttft": 0.5, "e2e": 1.0} for t in wl.turns]
        return {"records": recs, "wall_s": 2.0, "wait_s": 0.0, "late_saves": [], "kvpool_cpu_s": 0.1, "probe": {},
                "sidecar": dict.fromkeys(serving.SIDECAR_COUNTERS, 3),
                "engine_counters": [{"host_stored_bytes": 10}, {"host_stored_bytes": 6}]}

    monkeypatch.setattr(serving, "run_arm", run_arm)
    out = serving.run_all(None, None, wl, ["a", "c"], rounds=2, probe=False, log=lambda *_: None)  # type: ignore[arg-type]
    assert list(out.failed) == ["a"] and "engine 0 exited" in out.failed["a"]
    assert list(out.summary) == ["c"] and out.runs["a"] == [] and len(out.runs["c"]) == 2
    assert out.mismatches == []  # c is its own reference when a never ran
    assert out.summary["c"]["offload_bytes"] == {"stored": 16, "loaded": 0}
    assert out.summary["c"]["computed_tokens"] == 16 and "ttft_p50_ratio_median" not in out.summary["c"]
