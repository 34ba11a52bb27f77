"""Autoscaling (a KVPool's spec.autoscaling) as a user meets it (issue 24 §3): installed with the
chart, driven by `kvpool loadgen` engines through their injected sidecars, and checked through the
API only (the pool's status, its conditions and Events, the StatefulSet).

One pool of 16Mi store nodes aiming at 35 % use, at most 4 nodes:
  1. a load of 12.5Mi on its one node (78 %), written while maxReplicas holds the pool at one,
     grows it to three in one step once maxReplicas allows four, and it stays there while the
     load is unchanged (the copies the scale-up's warm-up leaves behind are no new load).  Left
     free during the load, the autoscaler would follow it as it ramps (1 -> 2 -> 3, seen on the
     real node, whose engine pod writes slower): right too, but not one step;
  2. lowering autoscaling.maxReplicas to 1 while full: the pool steps down one node at a time
     through a drain (3 → 2, the two left 44 % full), and the next step is refused with a reason:
     one node would be 88 % full, above the 80 % limit (ScaleDownBlocked UtilizationTooHigh, a
     Warning Event), and nothing shrinks;
  3. the load has stopped and its bulk expires (its traffic class's TTL lowered to a second): the
     idle pool shrinks to one node through a drain, and every hot block, written after the growth,
     reads back byte-exact from the node left.

The release (and its fast reconcile intervals) comes from ``e2e.test_e2e_chart``.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from e2e.test_e2e_chart import (  # noqa: F401 (release: the chart tests' module fixture, a release of our own)
    AUTOSCALE_COOLDOWN_SECONDS,
    Release,
    cond,
    kvpool_doc,
    kvtier,
    pool_events,
    release,
    run_engine,
    sts_replicas,
    wait_injection_ready,
)
from e2e.testutil import wait_for

pytestmark = pytest.mark.cluster

POOL = "auto"
BLOCK = 64 << 10
COLD = ["--seed", "2", "--prompts", "50", "--prompt-blocks", "4", "--value-bytes", str(BLOCK),
        "--traffic-class", "agent"]
"""200 blocks, 12.5Mi of the class whose TTL the test lowers: 78 % of a 16Mi node; at a 35 % target
that wants 3 nodes (26 % each, 29 % with the hot blocks: far from wanting a fourth)."""
HOT = ["--seed", "1", "--prompts", "24", "--prompt-blocks", "1", "--value-bytes", str(BLOCK)]
"""24 blocks (1.5Mi) of the default class (7 d), written once there are three nodes."""
STORE = f"{POOL}-store"


def patch_pool(rel: Release, spec: dict[str, Any]) -> None:
    rel.kubectl("patch", "kvpools.kvpool.io", POOL, "-n", rel.apps, "--type=merge", "-p", json.dumps({"spec": spec}))


def event_messages(rel: Release, reason: str) -> list[str]:
    got = rel.get("events", "-n", rel.apps, "--field-selector",
                  f"involvedObject.kind=KVPool,involvedObject.name={POOL},reason={reason}")
    return sorted(e["message"] for e in (got or {}).get("items", []))


def holds(rel: Release, seconds: float, replicas: int) -> None:
    """The StatefulSet stays at ``replicas`` for ``seconds`` (several autoscaler cooldowns)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = sts_replicas(rel, STORE)
        assert got == replicas, f"the StatefulSet moved to {got}; status: {json.dumps(rel.pool_status(POOL))}"
        time.sleep(1)


def test_autoscaling_grows_refuses_a_too_full_shrink_and_shrinks_when_idle(
        release: Release) -> None:  # noqa: F811 (the imported fixture, by name)
    rel = release
    tier = f"auto-{rel.apps}"
    rel.kubectl("apply", "-f", "-", input=kvtier(tier, "16Mi"))
    rel.kubectl("apply", "-n", rel.apps, "-f", "-", input=kvpool_doc(
        POOL, storage={"replicas": 1, "tiers": [tier]},
        autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 1, "targetUtilization": 0.35},
        ttl={"agent": "1h", "chatbot": "7d"}, scaleDown={"gracePeriodSeconds": 30},
        sidecar={"localBytes": "4Mi"}, tenancy={"defaultTenant": "public"}))
    st = rel.wait_pool(POOL, lambda s: cond(s, "Ready") == ("True", "NodesReady"), 120, "one store node Ready")
    assert st["desiredReplicas"] == 1 and sts_replicas(rel, STORE) == 1
    wait_injection_ready(rel, POOL)

    # 1. The load fills the node past the target: the autoscaler grows the pool, in one step.
    rep = run_engine(rel, POOL, "cold", [*COLD, "--flush", "--hold"])
    assert rep["put_ok"] == 200 and rep["flushed"] and not rep["refused"], rep
    assert sts_replicas(rel, STORE) == 1  # held there by maxReplicas while the load was written
    patch_pool(rel, {"autoscaling": {"maxReplicas": 4}})
    st = rel.wait_pool(POOL, lambda s: s.get("desiredReplicas") == 3, 60, "the autoscaler asking for three nodes")
    assert st["usedBytes"] >= 200 * BLOCK, st
    wait_for(lambda: sts_replicas(rel, STORE) == 3, 30, "the StatefulSet grown", interval=0.5)
    st = rel.wait_pool(POOL, lambda s: s.get("readyReplicas") == 3 and s.get("phase") == "Ready"
                       and not s.get("rebalance"), 120, "three store nodes Ready, the warm-up done")
    assert sorted(m["id"] for m in st["ring"]["members"]) == [f"{STORE}-{i}" for i in range(3)]
    assert st["lastRebalance"]["movedObjects"] > 0 and st["foreignBytes"] > 0, st  # the warm-up's copies
    events = pool_events(rel, POOL)
    assert "from 1 to 3" in events.get("ScalingUp", ""), events
    # Nothing changed in the load: the pool stays at three through several cooldowns (it has room
    # for a fourth node, which counting the warm-up's copies as load would add).
    holds(rel, 3 * AUTOSCALE_COOLDOWN_SECONDS, 3)

    # The hot blocks, written now, land on all three nodes.
    rep = run_engine(rel, POOL, "hot", [*HOT, "--flush", "--hold"])
    assert rep["put_ok"] == 24 and rep["flushed"], rep

    # 2. maxReplicas lowered to 1 while full: down one node at a time, through a drain, until the
    #    next step would leave one node above 80 %: refused with the reason, nothing moves.
    patch_pool(rel, {"autoscaling": {"maxReplicas": 1}})
    st = rel.wait_pool(POOL, lambda s: cond(s, "ScaleDownBlocked") == ("True", "UtilizationTooHigh"), 90,
                       "3 -> 2 drained, then ScaleDownBlocked UtilizationTooHigh")
    first = st["lastDrain"]
    assert (first["result"], first["reason"], first["leaving"], first["fromReplicas"], first["toReplicas"]) == (
        "Completed", "Autoscaling", [f"{STORE}-2"], 3, 2), first
    assert first["droppedObjects"] == 0, first
    assert st["phase"] == "Blocked" and "Scale-down from 2 to 1 refused" in st["message"], st["message"]
    assert "limit 80.0%" in st["message"] and not st.get("drain"), st
    assert sorted(m["id"] for m in st["ring"]["members"]) == [f"{STORE}-0", f"{STORE}-1"]
    wait_for(lambda: sts_replicas(rel, STORE) == 2, 30, "the StatefulSet at two", interval=0.5)
    events = pool_events(rel, POOL)
    assert "UtilizationTooHigh" in events and "DrainCompleted" in events, events
    holds(rel, 2 * AUTOSCALE_COOLDOWN_SECONDS, 2)
    patch_pool(rel, {"autoscaling": {"maxReplicas": 2}})
    rel.wait_pool(POOL, lambda s: cond(s, "ScaleDownBlocked") == ("False", "NotBlocked"), 60, "no longer blocked")
    assert sts_replicas(rel, STORE) == 2

    # 3. The load has stopped; its bulk expires (the store nodes sweep every 30 s): the idle pool
    #    shrinks through a drain of the node that leaves.
    patch_pool(rel, {"ttl": {"agent": "1s"}})
    st = rel.wait_pool(POOL, lambda s: (s.get("lastDrain") or {}).get("fromReplicas") == 2
                       and not s.get("drain"), 150, "the idle pool's drain finished")
    last = st["lastDrain"]
    assert (last["result"], last["reason"], last["leaving"], last["toReplicas"]) == (
        "Completed", "Autoscaling", [f"{STORE}-1"], 1), last
    assert last["movedObjects"] > 0 and last["droppedObjects"] == 0, last
    wait_for(lambda: sts_replicas(rel, STORE) == 1, 60, "the StatefulSet shrunk", interval=0.5)
    assert [m["id"] for m in st["ring"]["members"]] == [f"{STORE}-0"] and st["desiredReplicas"] == 1
    # One node at a time: a drain per step, each named by the autoscaler's Events.
    started = event_messages(rel, "DrainStarted")
    assert [m.split(" before ")[1].split(";")[0] for m in started] == [
        "scaling from 2 to 1 store nodes", "scaling from 3 to 2 store nodes"], started

    # Every hot block reads back byte-exact from the node left (a fresh sidecar: all from the pool).
    rep = run_engine(rel, POOL, "reader", [*HOT, "--read-only", "--hold"])
    assert rep["hit_blocks"] == 24 and rep["verified"] == 24 and rep["mismatches"] == 0, rep
    rel.kubectl("delete", "kvpools.kvpool.io", POOL, "-n", rel.apps, "--timeout=60s", timeout=90)
    rel.kubectl("delete", "kvtiers.kvpool.io", tier, "--timeout=60s")
