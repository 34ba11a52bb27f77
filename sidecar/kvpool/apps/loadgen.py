"""`kvpool loadgen`: a small engine stand-in that puts and gets KV blocks through its sidecar.

It replays ``--prompts`` prompts of ``--prompt-blocks`` full blocks each, drawn from a fixed
seed (``numpy.random.default_rng([seed, i])``), so that two loadgens with the same seed and
model ask for the same blocks. Per prompt, as an engine would: compute the prefix-chained keys
(:class:`kvpool.KeySpace`), ``match`` them, ``get`` the matched prefix and verify it byte-exact
against the value derived from each key, then ``put`` the blocks it did not match (unless
``--read-only``). With ``--states`` each prompt also has a state object at its end (what a
hybrid-attention engine keeps; it stays local to the sidecar until eviction or drain): looked up,
read and verified, and put when absent. ``--rounds`` repeats the replay, ``--duration`` keeps it going for so many
seconds (load for scale-down tests). At the end it can ``flush`` the sidecar's pending writes
to the pool, prints one summary line ``KVPOOL_LOADGEN {json}`` (also written to ``--report``),
and with ``--hold`` stays up until SIGTERM (so that a Deployment's pod stays Running).

    kvpool loadgen [--address unix:///run/kvpool/kvpool.sock] [--model M] [--seed S]
                   [--prompts N] [--prompt-blocks B] [--block-tokens T] [--value-bytes V] [--traffic-class C]
                   [--rounds R | --duration SEC] [--read-only] [--states [--state-bytes N]]
                   [--flush] [--report PATH] [--hold]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvpool.core import errors
from kvpool.core.keys import KeySpace
from kvpool.core.signals import stop_on_signals
from kvpool.core.traffic import DEFAULT_TRAFFIC_CLASS

VOCAB = 32000
PREFIX = "KVPOOL_LOADGEN "


def value_for(key: bytes, size: int) -> bytes:
    """The value stored under ``key``: the key repeated (any reader can verify it)."""
    return (key * (size // len(key) + 1))[:size]


def state_value_for(key: bytes, size: int) -> bytes:
    """The state object stored at the block ``key``: distinct from the block's own value."""
    return value_for(hashlib.sha256(b"kvpool.apps.loadgen.state" + key).digest(), size)


@dataclass
class Report:
    prompts: int = 0
    blocks: int = 0
    hit_blocks: int = 0
    put_blocks: int = 0
    put_ok: int = 0
    verified: int = 0
    mismatches: int = 0
    state_hits: int = 0
    state_puts: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    rounds: int = 0
    seconds: float = 0.0
    flushed: bool = False
    tenant: str = ""

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "hit_rate": round(self.hit_rate, 4)}


def prompt_keys(space: KeySpace, seed: int, index: int, blocks: int) -> list[bytes]:
    rng = np.random.default_rng([seed, index])
    tokens = rng.integers(0, VOCAB, size=blocks * space.block_tokens, dtype=np.uint32)
    return space.block_keys(tokens)


def connect(address: str, block_tokens: int, timeout: float) -> Any:
    """Connect, retrying while the sidecar is not up yet (its socket appears when it is)."""
    from kvpool.client.client import connect as _connect

    deadline = time.monotonic() + timeout
    while True:
        try:
            return _connect(address, block_tokens=block_tokens)
        except (errors.KvpoolError, OSError) as exc:
            if time.monotonic() > deadline:
                raise SystemExit(f"kvpool loadgen: cannot connect to {address}: {exc}") from None
            time.sleep(0.5)


def run_state(client: Any, keys: Sequence[bytes], state_bytes: int, read_only: bool, rep: Report,
              refused: Counter[str]) -> None:
    key, position = keys[-1], len(keys) * client.block_tokens
    got = client.get_state(key, position) if client.has_states([key])[0] else None
    if got is not None:
        rep.state_hits += 1
        if bytes(got) != state_value_for(key, state_bytes):
            rep.mismatches += 1
        del got
        return
    if not read_only:
        code = client.put_state(key, position, state_value_for(key, state_bytes))
        if code == 0:
            rep.state_puts += 1
        else:
            refused[f"state:{errors.code_name(code)}"] += 1


def run_prompt(client: Any, keys: Sequence[bytes], value_bytes: int, read_only: bool, rep: Report,
               refused: Counter[str], errs: Counter[str], state_bytes: int = 0,
               traffic_class: str = DEFAULT_TRAFFIC_CLASS) -> None:
    rep.prompts += 1
    rep.blocks += len(keys)
    try:
        if state_bytes and keys:
            run_state(client, keys, state_bytes, read_only, rep, refused)
        matched = client.match(keys)
        if matched:
            try:
                with client.get(keys[:matched]) as views:
                    for k, v in zip(keys[:matched], views, strict=True):
                        if bytes(v) == value_for(k, value_bytes):
                            rep.verified += 1
                        else:
                            rep.mismatches += 1
                rep.hit_blocks += matched
            except errors.NotFound:
                # Evicted between match and get: the engine would recompute those blocks.
                errs["NotFoundAfterMatch"] += 1
                matched = 0
        if read_only or matched >= len(keys):
            return
        todo = list(keys[matched:])
        codes = client.put(todo, [value_for(k, value_bytes) for k in todo], traffic_class=traffic_class)
        rep.put_blocks += len(todo)
        for c in codes:
            if c == 0:
                rep.put_ok += 1
            else:
                refused[errors.code_name(c)] += 1
    except errors.KvpoolError as exc:
        errs[type(exc).__name__] += 1


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvpool loadgen", description=__doc__.split("\n\n")[0])
    conn = ap.add_argument_group("sidecar connection")
    conn.add_argument("--address", default=os.environ.get("KVPOOL_ADDRESS", "unix:///run/kvpool/kvpool.sock"),
                      help="address of the sidecar (default: $KVPOOL_ADDRESS or unix:///run/kvpool/kvpool.sock)")
    conn.add_argument("--connect-timeout", type=float, default=60.0,
                      help="seconds to keep trying to connect while the sidecar starts (default 60)")
    work = ap.add_argument_group("workload")
    work.add_argument("--model", default="loadgen", help="model name: part of every key (default loadgen)")
    work.add_argument("--seed", type=int, default=0, help="seed of the prompts (same seed, same blocks)")
    work.add_argument("--prompts", type=int, default=32, help="prompts per round (default 32)")
    work.add_argument("--prompt-blocks", type=int, default=8, help="full blocks per prompt (default 8)")
    work.add_argument("--block-tokens", type=int, default=int(os.environ.get("KVPOOL_BLOCK_TOKENS", "16")),
                      help="tokens per block (default: $KVPOOL_BLOCK_TOKENS or 16)")
    work.add_argument("--value-bytes", type=int, default=4096, help="bytes per block value (default 4096)")
    work.add_argument("--read-only", action="store_true", help="match and get only, never put")
    work.add_argument("--traffic-class", default=DEFAULT_TRAFFIC_CLASS,
                      help=f"traffic class of the blocks put, which picks their TTL (default {DEFAULT_TRAFFIC_CLASS})")
    work.add_argument("--states", action="store_true", help="a state object at the end of each prompt too")
    work.add_argument("--state-bytes", type=int, default=8192, help="bytes per state object (default 8192)")
    dur = ap.add_argument_group("duration")
    dur.add_argument("--rounds", type=int, default=1, help="replays of the prompts (default 1)")
    dur.add_argument("--duration", type=float, default=0.0, help="repeat rounds for this many seconds")
    dur.add_argument("--interval", type=float, default=0.0, help="pause between prompts (seconds)")
    end = ap.add_argument_group("end of the run")
    end.add_argument("--flush", action="store_true", help="flush the sidecar's pending writes at the end")
    end.add_argument("--report", default=None, help="also write the summary JSON here")
    end.add_argument("--hold", action="store_true", help="stay up after the run until SIGTERM")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    stop = stop_on_signals([signal.SIGTERM])
    space = KeySpace(args.model, block_tokens=args.block_tokens)
    keys = [prompt_keys(space, args.seed, i, args.prompt_blocks) for i in range(args.prompts)]
    client = connect(args.address, args.block_tokens, args.connect_timeout)
    rep = Report(tenant=str(client.tenant_id))
    refused: Counter[str] = Counter()
    errs: Counter[str] = Counter()
    start = time.monotonic()
    try:
        while not stop.is_set():
            for ks in keys:
                if stop.is_set():
                    break
                run_prompt(client, ks, args.value_bytes, args.read_only, rep, refused, errs,
                           args.state_bytes if args.states else 0, args.traffic_class)
                if args.interval:
                    stop.wait(args.interval)
            rep.rounds += 1
            rep.refused, rep.errors = dict(refused), dict(errs)
            print(f"kvpool loadgen: round {rep.rounds}: {json.dumps(rep.as_dict())}", flush=True)
            if rep.rounds >= args.rounds and time.monotonic() - start >= args.duration:
                break
        if args.flush:
            try:
                client.flush()
                rep.flushed = True
            except errors.KvpoolError as exc:
                errs[f"Flush{type(exc).__name__}"] += 1
    finally:
        rep.seconds = round(time.monotonic() - start, 3)
        rep.refused, rep.errors = dict(refused), dict(errs)
        client.close()
    line = json.dumps(rep.as_dict(), sort_keys=True)
    print(PREFIX + line, flush=True)
    if args.report:
        with open(args.report, "w") as f:
            f.write(line + "\n")
    if args.hold:
        stop.wait()
    return 1 if rep.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
