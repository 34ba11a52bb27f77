"""The rest of the user's path on the real node (issue 24, part 3), after test_realnode_userpath:
the chart's scenarios of the node agent tier, run here on the real kubelet with the local image
(the ``release`` fixture of ``e2e.test_e2e_chart`` installs for the module's tier), plus a drain
cut short by its deadline, which shows that a scale-down moves the hottest objects first.

* ``test_2_minimal_pool_from_the_example``: examples/minimal.yaml Ready (the pool of test_8);
* ``test_8_deleted_engine_pod_drains_its_local_state_to_the_pool``: an engine pod deleted flushes
  its sidecar's local state objects to the pool within its grace period (read back from another
  pod);
* ``test_autoscaling_grows_refuses_a_too_full_shrink_and_shrinks_when_idle``: spec.autoscaling on
  the real control plane (grow past the target, a shrink above 0.8 refused with its reason, the
  idle pool shrunk through the drain);
* ``test_a_drain_cut_short_moves_the_hottest_first``: below.

Every step is asserted through the API (the pool's status and Events, the StatefulSet) and the
data path through ``kvpool loadgen`` in the engine containers, against their injected sidecars.
"""

from __future__ import annotations

import pytest

from e2e.test_e2e_chart import (  # noqa: F401 (fixtures and tests, collected here on the real node)
    Release,
    kvpool_doc,
    kvtier,
    pool_events,
    release,
    run_engine,
    sts_replicas,
    test_2_minimal_pool_from_the_example,
    test_8_deleted_engine_pod_drains_its_local_state_to_the_pool,
    wait_injection_ready,
)
from e2e.test_operator_autoscale import (  # noqa: F401
    test_autoscaling_grows_refuses_a_too_full_shrink_and_shrinks_when_idle,
)
from e2e.testutil import wait_for

pytestmark = pytest.mark.realnode

BLOCK = 64 << 10
COLD = ["--seed", "3", "--prompts", "256", "--prompt-blocks", "1", "--value-bytes", str(BLOCK)]
"""256 blocks (16Mi), written first: about 8Mi of them on the node that leaves."""
HOT = ["--seed", "4", "--prompts", "16", "--prompt-blocks", "1", "--value-bytes", str(BLOCK)]
"""16 blocks (1Mi), written last: the most recently used objects of every node."""
BANDWIDTH = 512 << 10
GRACE_SECONDS = 10
"""The drain may push at most 512Ki/s for at most 10 s (5Mi, less the time the operator takes to
make the new ring): never all of the leaving node's 8.5Mi, always its hot 0.5Mi first."""


def test_a_drain_cut_short_moves_the_hottest_first(release: Release) -> None:  # noqa: F811
    rel = release
    tier, pool = f"hot-{rel.apps}", "hot"
    rel.kubectl("apply", "-f", "-", input=kvtier(tier, "64Mi"))
    rel.kubectl("apply", "-n", rel.apps, "-f", "-", input=kvpool_doc(
        pool, storage={"replicas": 2, "tiers": [tier]},
        scaleDown={"gracePeriodSeconds": GRACE_SECONDS, "drainBandwidth": f"{BANDWIDTH >> 10}Ki"},
        sidecar={"localBytes": "2Mi"}, tenancy={"defaultTenant": "public"}))
    rel.wait_pool(pool, lambda s: s.get("readyReplicas") == 2, 180, "two ready store nodes")
    wait_injection_ready(rel, pool)
    rep = run_engine(rel, pool, "cold", [*COLD, "--flush", "--hold"])
    assert rep["put_ok"] == 256 and rep["flushed"], rep
    rep = run_engine(rel, pool, "hot", [*HOT, "--flush", "--hold"])
    assert rep["put_ok"] == 16 and rep["flushed"], rep

    rel.kubectl("patch", "kvpools.kvpool.io", pool, "-n", rel.apps, "--type=merge",
                "-p", '{"spec":{"storage":{"replicas":1}}}')
    st = rel.wait_pool(pool, lambda s: bool(s.get("lastDrain")) and not s.get("drain"), 120, "the drain finished")
    last = st["lastDrain"]
    assert last["result"] == "Completed" and last["leaving"] == [f"{pool}-store-1"], last
    # Cut short by its deadline: some moved, the rest dropped, and counted.
    assert last["movedObjects"] > 0 and last["droppedObjects"] > 0, last
    assert last["movedBytes"] <= (GRACE_SECONDS + 2) * BANDWIDTH, last
    wait_for(lambda: sts_replicas(rel, f"{pool}-store") == 1, 60, "the StatefulSet lowered", interval=0.5)
    assert [m["id"] for m in st["ring"]["members"]] == [f"{pool}-store-0"]
    events = pool_events(rel, pool)
    assert f"dropped {last['droppedObjects']} (" in events.get("DrainCompleted", ""), events

    # Fresh engines (empty local tiers): every hot block is still in the pool, byte-exact; of the
    # cold ones, those the deadline dropped are misses, never wrong bytes.
    hot = run_engine(rel, pool, "hot-reader", [*HOT, "--read-only", "--hold"])
    assert hot["hit_blocks"] == 16 and hot["verified"] == 16 and hot["mismatches"] == 0, hot
    cold = run_engine(rel, pool, "cold-reader", [*COLD, "--read-only", "--hold"])
    assert cold["mismatches"] == 0 and cold["verified"] == cold["hit_blocks"], cold
    assert 0 < 256 - cold["hit_blocks"] <= last["droppedObjects"], (cold, last)
    print(f"drain cut short at {GRACE_SECONDS}s, {BANDWIDTH >> 10}Ki/s: {last}; cold hits {cold['hit_blocks']}/256")
    rel.kubectl("delete", "kvpools.kvpool.io", pool, "-n", rel.apps, "--timeout=60s", timeout=90)
    rel.kubectl("delete", "kvtiers.kvpool.io", tier, "--timeout=60s")
