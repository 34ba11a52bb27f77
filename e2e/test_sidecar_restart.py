"""A native sidecar killed in a running engine pod (issue 19, finding 1 and goal 2, on the harness).

The operator injects its sidecar (an init container with ``restartPolicy: Always``) into an
engine pod whose container runs a client program (``ENGINE`` below, the harness's Python): it
puts objects whose bytes derive from their keys, then reads them in a loop — ``match``, ``get``
and ``get_into`` into ``alloc_buffer`` memory — comparing every byte, and counts per phase.  The
test SIGKILLs the sidecar container's process group, as a container runtime does; the node agent
restarts it in the same pod (``initContainerStatuses[].restartCount``, read through the API
server), with the pod's shared-memory ``emptyDir`` (``kvpool-shm``) untouched.

Phases are set by the test through files in an ``emptyDir`` of the engine pod (the engine
acknowledges, between two calls, that it saw the kill coming): *before* the kill, the *outage*
(kill until the new sidecar printed READY) and *after*.  Every call before and after must
succeed; no byte may be wrong in any phase.  The cache is kept when the new life's counters show
the arena adopted (``restart_adopted_objects``) and every read after the restart served locally
(``read_hits_pool`` and ``hit_blocks_pool`` stay 0).  A second scenario removes the arena files
first: the new life starts empty, the engine still reads right bytes, now from the pool — which
shows the hit counters tell the two apart.

The node agent does not enforce a memory-backed ``emptyDir``'s ``sizeLimit`` (the volume is a
directory of the host's /dev/shm, not a tmpfs of that size as a kubelet mounts), so the test
measures what the processes put in the volumes against the limit the operator computed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.cluster import Cluster
from e2e.nodeagent import POD_MARKER_ENV
from e2e.test_operator_pool import (  # noqa: F401 (fixtures used by name)
    API,
    Operator,
    create,
    create_pod_injected,
    kube,
    kvpool,
    operator,
    wait_status,
)
from e2e.testutil import python_cmd, wait_for
from kvpool.wire.counters import SidecarCounter
from kvpool_operator.kube import Kube
from kvpool_operator.units import parse_bytes

pytestmark = pytest.mark.cluster

SIDECAR = "kvpool-sidecar"
OBJECTS = 64
VALUE_BYTES = 64 << 10
BATCH = 16
AFTER_ROUNDS = 5
LOCAL_BYTES = 32 << 20
REPORT_PREFIX = "ENGINE "

# The engine's client program.  Single-threaded on purpose: when it acknowledges a phase change
# no call is in flight, so each call is counted in the phase it started in.
ENGINE = r'''
import hashlib, json, os, time
import numpy as np
from kvpool.core import errors
from kvpool.client.client import Client

env = os.environ
ADDR, CTL, SALT = env["KVPOOL_ADDRESS"], env["ENGINE_CTL"], env["ENGINE_SALT"].encode()
N, SIZE, BATCH = int(env["ENGINE_OBJECTS"]), int(env["ENGINE_VALUE_BYTES"]), int(env["ENGINE_BATCH"])
AFTER, WARM = int(env["ENGINE_AFTER_ROUNDS"]), 3
DEADLINE = time.monotonic() + float(env.get("ENGINE_DEADLINE", "600"))


def report(kind, **kw):
    print("ENGINE " + json.dumps({"kind": kind, **kw}, sort_keys=True), flush=True)


def touch(name):
    with open(os.path.join(CTL, name), "w"):
        pass


keys = [hashlib.sha256(SALT + b"/%d" % i).digest() for i in range(N)]
# Each object's bytes derive from its key alone: any byte of another object is caught.
expected = [np.random.default_rng(int.from_bytes(k[:16], "little")).integers(0, 256, SIZE, dtype=np.uint8)
            for k in keys]
batches = [list(range(i, min(i + BATCH, N))) for i in range(0, N, BATCH)]
tally = {p: {"ops": 0, "ok_ops": 0, "objects": 0, "wrong_objects": 0, "wrong_bytes": 0, "errors": 0,
             "short_matches": 0, "missing": 0, "error_kinds": {}, "error_samples": []}
         for p in ("before", "outage", "after")}
acked = False


def phase():
    global acked
    if os.path.exists(os.path.join(CTL, "restarted")):
        return "after"
    if os.path.exists(os.path.join(CTL, "killed")):
        if not acked:
            touch("killed.ack")  # between two calls: none is in flight
            acked = True
        return "outage"
    return "before"


def check(t, view, i):
    got, want = np.frombuffer(view, np.uint8), expected[i]
    wrong = int(np.count_nonzero(got != want)) if got.size == want.size else max(got.size, want.size)
    t["objects"] += 1
    if wrong:
        t["wrong_objects"] += 1
        t["wrong_bytes"] += wrong


def op(name, fn):
    p = phase()
    t = tally[p]
    t["ops"] += 1
    try:
        fn(t)
    except Exception as exc:  # every failure is counted by kind; a bug's kind shows in the report
        t["errors"] += 1
        kind = f"{name}:{type(exc).__name__}"
        t["error_kinds"][kind] = t["error_kinds"].get(kind, 0) + 1
        if len(t["error_samples"]) < 3:
            t["error_samples"].append(f"{kind}: {exc}"[:300])
        time.sleep(0.05)
        return p
    t["ok_ops"] += 1
    return p


def connect():
    while True:
        try:
            return Client(ADDR)
        except errors.KvpoolError:
            if time.monotonic() > DEADLINE:
                raise
            time.sleep(0.2)


c = connect()
codes = []
for b in batches:
    codes += c.put([keys[i] for i in b], [expected[i] for i in b])
c.flush(timeout_ms=30000)
while c.stats().pending_pool_bytes and time.monotonic() < DEADLINE:
    time.sleep(0.05)  # in the pool too: a sidecar that lost its arena can still serve them
buf = c.alloc_buffer(BATCH * SIZE)
report("put", put_failed=sum(1 for x in codes if x != 0),
       registered=c.is_registered(buf[:SIZE]), pending=c.stats().pending_pool_bytes)


def match(b):
    def f(t):
        if c.match([keys[i] for i in b]) != len(b):
            t["short_matches"] += 1
    return f


def get(b):
    def f(t):
        with c.get([keys[i] for i in b]) as got:
            for view, i in zip(got, b):
                check(t, view, i)
    return f


def get_into(b):
    def f(t):
        buf[:] = 0  # nothing of an earlier read can pass for this one
        views = [buf[j * SIZE:(j + 1) * SIZE] for j in range(len(b))]
        sizes = c.get_into([keys[i] for i in b], views)
        for j, (size, i) in enumerate(zip(sizes, b)):
            if size < 0:
                t["missing"] += 1
            else:
                check(t, views[j][:size], i)
    return f


rounds = {"before": 0, "outage": 0, "after": 0}
last_progress = time.monotonic()
while time.monotonic() < DEADLINE:
    started = phase()
    for b in batches:
        op("match", match(b))
        op("get", get(b))
        op("get_into", get_into(b))
    rounds[started] += 1
    if started == "before" and rounds["before"] == WARM:
        report("warm", tally=tally, counters=dict(c.stats().counters))
    if started == "after" and rounds["after"] >= AFTER:
        break
    if time.monotonic() - last_progress > 5:
        report("progress", tally=tally, rounds=rounds)
        last_progress = time.monotonic()
    time.sleep(0.02)
st = c.stats()
report("final", tally=tally, rounds=rounds, counters=dict(st.counters), local_objects=st.local_objects,
       restarts_seen=getattr(c, "restarts_seen", None),
       registered=c.is_registered(buf[:SIZE]))
touch("done")
while time.monotonic() < DEADLINE:
    time.sleep(1)  # held, so the pod stays Running while the test reads its status
'''


# ------------------------------------------------------------------------------------ helpers


@pytest.fixture(scope="module")
def pool_ns(operator: Operator, kube: Kube) -> Iterator[str]:  # noqa: F811 (the imported fixtures)
    """A namespace with a KVPool of one store node (a small DRAM tier), ready, for this module."""
    ns = f"e2e-restart-{uuid.uuid4().hex[:6]}"
    tier = f"t-{ns}"
    # The label: the webhook serves the harness's test namespaces only.
    kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": {"kvpool-e2e/test": ns}}})
    kube.apply({"apiVersion": API, "kind": "KVTier", "metadata": {"name": tier},
                "spec": {"medium": "dram", "capacity": {"bytes": "64Mi"}}})
    try:
        wait_for(lambda: kube.get("v1", "ServiceAccount", "default", ns), 30, "the default ServiceAccount")
        create(kube, kvpool("p", storage={"replicas": 1, "tiers": [tier]}, sidecar={"localBytes": str(LOCAL_BYTES)},
                            tenancy={"defaultTenant": "public"}), ns)
        wait_status(kube, ns, "p", lambda s: s.get("readyReplicas") == 1
                    and len((s.get("ring") or {}).get("members", [])) == 1, 120, "the store node ready in the ring")
        yield ns
    finally:
        kube.delete("v1", "Namespace", ns)
        kube.delete(API, "KVTier", tier)


def engine_pod(name: str, salt: str) -> dict[str, Any]:
    env = {"ENGINE_CTL": "/ctl", "ENGINE_SALT": salt, "ENGINE_OBJECTS": str(OBJECTS),
           "ENGINE_VALUE_BYTES": str(VALUE_BYTES), "ENGINE_BATCH": str(BATCH),
           "ENGINE_AFTER_ROUNDS": str(AFTER_ROUNDS), "ENGINE_DEADLINE": "300"}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"kvpool.io/pool": "p"}},
            # Never: a restarted engine would hide a client that stopped working.
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "volumes": [{"name": "ctl", "emptyDir": {}}],
                     "containers": [{"name": "engine", "image": "unused", "command": python_cmd(ENGINE),
                                     "env": [{"name": k, "value": v} for k, v in env.items()],
                                     "volumeMounts": [{"name": "ctl", "mountPath": "/ctl"}]}]}}


def reports(log: Path) -> list[dict[str, Any]]:
    text = log.read_text(errors="replace") if log.exists() else ""
    return [json.loads(line[len(REPORT_PREFIX):]) for line in text.splitlines() if line.startswith(REPORT_PREFIX)]


def wait_report(log: Path, kind: str, timeout: float) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        return next((r for r in reports(log) if r["kind"] == kind), None)

    try:
        return wait_for(found, timeout, f"the engine's {kind!r} report", interval=0.2)
    except AssertionError:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:]) if log.exists() else "(no log)"
        raise AssertionError(f"no {kind!r} report from the engine after {timeout}s; its log:\n{tail}") from None


def container_root_pids(uid: str, arg: bytes) -> list[int]:
    """The processes that are a container of pod ``uid`` whose argv has ``arg``: each container
    is a session (and process group) of its own started by the node agent, its leader the
    container's command (``unshare`` and ``sh`` exec it)."""
    marker = f"{POD_MARKER_ENV}={uid}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            leader = os.getsid(pid) == pid
        except OSError:  # gone already, or a kernel thread
            continue
        if marker in environ and arg in argv and leader:
            found.append(pid)
    return found


def container_status(pod: dict[str, Any], name: str) -> dict[str, Any]:
    st = pod.get("status") or {}
    for c in (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or []):
        if c["name"] == name:
            return dict(c)
    return {}


def memory_volume(cluster: Cluster, pod: dict[str, Any], volume: str) -> dict[str, int]:
    """What the files in a pod's memory-backed ``emptyDir`` take (apparent size: what they can
    grow to without a write beyond their end; allocated: pages in use now) and its sizeLimit.

    The files are those in the volume's directory and those the pod's processes map from it
    after unlinking them (a store node's arena: gone from the directory, still in the tmpfs)."""
    spec = next(v for v in pod["spec"]["volumes"] if v["name"] == volume)["emptyDir"]
    assert spec.get("medium") == "Memory", spec
    uid = pod["metadata"]["uid"]
    root = Path(f"/dev/shm/kvpool-e2e-{cluster.run_id}") / uid / volume
    files = {(st.st_dev, st.st_ino): st for st in (p.stat() for p in root.rglob("*") if p.is_file())}
    mounts = {m["mountPath"] for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]
              for m in c.get("volumeMounts") or [] if m["name"] == volume}
    for pid in pod_pids(uid):
        files.update(mapped_files(pid, mounts))
    return {"files": len(files), "apparent": sum(st.st_size for st in files.values()),
            "allocated": sum(st.st_blocks * 512 for st in files.values()),
            "limit": parse_bytes(spec["sizeLimit"], "sizeLimit")}


def pod_pids(uid: str) -> list[int]:
    marker = f"{POD_MARKER_ENV}={uid}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
    return pids


def mapped_files(pid: int, mount_paths: set[str]) -> dict[tuple[int, int], os.stat_result]:
    """The files under ``mount_paths`` (as the process sees them) that ``pid`` maps, by inode,
    deleted ones too (``/proc/<pid>/map_files`` opens them)."""
    out = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or not any(parts[5].startswith(m.rstrip("/") + "/") for m in mount_paths):
                continue
            with contextlib.suppress(OSError):
                st = os.stat(f"/proc/{pid}/map_files/{parts[0]}")
                out[(st.st_dev, st.st_ino)] = st
    return out


def ready_lines(log: Path) -> list[str]:
    return re.findall(r"^READY .*$", log.read_text(errors="replace"), re.M) if log.exists() else []


def kill_and_restart_sidecar(cluster: Cluster, k8s: Kube, ns: str, name: str, drop_arena: bool) -> dict[str, Any]:
    """Run the engine pod, SIGKILL its sidecar once it is warm, let the node agent restart it, and
    return what was seen: the engine's reports, the sidecar's READY lines, the pod's statuses."""
    pod = create_pod_injected(k8s, ns, engine_pod(name, f"{ns}/{name}"))
    uid = pod["metadata"]["uid"]
    assert pod["metadata"]["annotations"]["kvpool.io/injected"] == f"{ns}.p"
    side = pod["spec"]["initContainers"][0]
    assert side["name"] == SIDECAR and side["restartPolicy"] == "Always"
    pod_dir = cluster.pod_dir(ns, name, uid)
    engine_log, sidecar_log, ctl = pod_dir / "engine.log", pod_dir / f"{SIDECAR}.log", pod_dir / "volumes" / "ctl"

    put = wait_report(engine_log, "put", 120)
    assert put["put_failed"] == 0 and put["pending"] == 0, put
    warm = wait_report(engine_log, "warm", 60)
    (old_pid,) = wait_for(lambda: container_root_pids(uid, b"sidecar"), 10, "the sidecar's process")
    got = k8s.get("v1", "Pod", name, ns) or {}
    before = container_status(got, SIDECAR)
    assert before.get("restartCount") == 0 and "running" in before.get("state", {}), before
    assert len(ready_lines(sidecar_log)) == 1
    shm_root = Path(f"/dev/shm/kvpool-e2e-{cluster.run_id}") / uid / "kvpool-shm"
    arena_files = sorted(p.name for p in shm_root.iterdir() if p.suffix in (".tier", ".journal"))
    volume = memory_volume(cluster, got, "kvpool-shm")

    (ctl / "killed").touch()
    wait_for(lambda: (ctl / "killed.ack").exists(), 30, "the engine to acknowledge the kill")
    if drop_arena:
        for n in arena_files:  # the running sidecar keeps its mappings; the next one finds nothing
            (shm_root / n).unlink()
    killed_at = time.monotonic()
    os.killpg(old_pid, signal.SIGKILL)  # the container's process group, as a runtime kills it
    wait_for(lambda: not Path(f"/proc/{old_pid}").exists() or _zombie(old_pid), 10, "the old sidecar gone")

    def restarted() -> dict[str, Any] | None:
        p = k8s.get("v1", "Pod", name, ns) or {}
        s = container_status(p, SIDECAR)
        return p if s.get("restartCount", 0) >= 1 and "running" in s.get("state", {}) and s.get("started") else None

    after_pod = wait_for(restarted, 60, "the node agent to restart the sidecar (restartCount 1, running, started)")
    wait_for(lambda: len(ready_lines(sidecar_log)) >= 2, 90, "the restarted sidecar's READY line")
    ready_s = time.monotonic() - killed_at
    (new_pid,) = container_root_pids(uid, b"sidecar")
    (ctl / "restarted").touch()
    final = wait_report(engine_log, "final", 120)
    end_pod = k8s.get("v1", "Pod", name, ns) or {}
    return {"warm": warm, "final": final, "ready": ready_lines(sidecar_log), "ready_seconds": ready_s,
            "old_pid": old_pid, "new_pid": new_pid, "before": before, "pod_after": after_pod, "pod_end": end_pod,
            "arena_files": arena_files, "volume_before": volume,
            "volume_after": memory_volume(cluster, end_pod, "kvpool-shm")}


def _zombie(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return " Z " in Path(f"/proc/{pid}/stat").read_text().split(")", 1)[1][:4]
    return True


def _adopted(line: str) -> tuple[int, int] | None:
    m = re.search(r"adopted=(\d+) dropped=(\d+)", line)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _summary(seen: dict[str, Any]) -> str:
    t, final = seen["final"]["tally"], seen["final"]
    keep = ("ops", "objects", "wrong_objects", "wrong_bytes", "errors", "short_matches", "missing", "error_kinds")
    counters = {k: v for k, v in final["counters"].items() if k.startswith(("read_", "hit_blocks", "restart_"))}
    return json.dumps({"phases": {p: {k: t[p][k] for k in keep} for p in t}, "rounds": final["rounds"],
                       "new_life_counters": counters, "restarts_seen": final["restarts_seen"],
                       "ready_after_kill_s": round(seen["ready_seconds"], 2), "ready": seen["ready"][-1],
                       "shm_volume": seen["volume_after"]})


def _client_kept_working(seen: dict[str, Any]) -> None:
    """The promises every restart keeps, whether the cache survived it or not."""
    t = seen["final"]["tally"]
    for p in ("before", "outage", "after"):
        assert t[p]["wrong_bytes"] == 0 and t[p]["wrong_objects"] == 0, f"wrong bytes in phase {p}: {_summary(seen)}"
    assert t["before"]["errors"] == 0, _summary(seen)
    # The client keeps working: every call after the new sidecar said READY succeeded.
    assert t["after"]["errors"] == 0 and t["after"]["missing"] == 0, _summary(seen)
    assert t["after"]["short_matches"] == 0, _summary(seen)
    assert seen["final"]["rounds"]["after"] >= AFTER_ROUNDS
    assert t["after"]["objects"] >= 2 * AFTER_ROUNDS * OBJECTS, _summary(seen)  # get and get_into, all verified
    assert seen["final"]["registered"], seen["final"]
    # The node agent restarted the sidecar in the same pod; the engine container never restarted.
    end = seen["pod_end"]
    side, engine = container_status(end, SIDECAR), container_status(end, "engine")
    assert side["restartCount"] == 1 and "running" in side["state"] and side["started"], side
    assert side["lastState"]["terminated"]["exitCode"] == 128 + signal.SIGKILL, side["lastState"]
    assert engine["restartCount"] == 0 and "running" in engine["state"], engine
    assert end["status"]["phase"] == "Running"
    assert seen["new_pid"] != seen["old_pid"]
    assert seen["final"]["restarts_seen"] == 1, _summary(seen)


# ------------------------------------------------------------------------------------ tests


def test_a_killed_sidecar_is_restarted_in_the_pod_and_keeps_the_cache(cluster: Cluster, kube: Kube,  # noqa: F811
                                                                       pool_ns: str) -> None:
    seen = kill_and_restart_sidecar(cluster, kube, pool_ns, "engine", drop_arena=False)
    print(f"sidecar SIGKILLed and restarted in the pod, cache kept: {_summary(seen)}")
    _client_kept_working(seen)
    # The cache was kept: the new life adopted every object of the old arena and served every read
    # after the restart from it, none from the pool.
    assert seen["arena_files"] and all(n.startswith("kvpool-sidecar-") for n in seen["arena_files"])
    assert _adopted(seen["ready"][-1]) == (OBJECTS, 0), seen["ready"][-1]
    counters = seen["final"]["counters"]
    assert counters.get(SidecarCounter.RESTART_ADOPTED_OBJECTS) == OBJECTS, _summary(seen)
    assert counters.get(SidecarCounter.RESTART_ADOPTED_BYTES) == OBJECTS * VALUE_BYTES, _summary(seen)
    assert counters.get(SidecarCounter.RESTART_ARENA_RESET, 0) == 0
    assert counters.get(SidecarCounter.READ_HITS_POOL, 0) == 0, _summary(seen)
    assert counters.get(SidecarCounter.HIT_BLOCKS_POOL, 0) == 0, _summary(seen)
    assert counters.get(SidecarCounter.READ_MISSES, 0) == 0, _summary(seen)
    reads_after = seen["final"]["tally"]["after"]["objects"]
    assert counters.get(SidecarCounter.READ_HITS_LOCAL, 0) >= reads_after, _summary(seen)
    assert counters.get(SidecarCounter.HIT_BLOCKS_LOCAL, 0) >= AFTER_ROUNDS * OBJECTS, _summary(seen)
    assert seen["final"]["local_objects"] == OBJECTS
    # The old life's reads were local hits too (what the new life continues).
    assert seen["warm"]["counters"].get(SidecarCounter.READ_HITS_LOCAL, 0) > 0
    # The kept arena and its journal fit in the volume the operator sized for them (the node agent
    # does not enforce sizeLimit: a kubelet's tmpfs of that size would).
    for vol in (seen["volume_before"], seen["volume_after"]):
        assert vol["files"] >= 2 and 0 < vol["apparent"] <= vol["limit"], vol
        assert vol["allocated"] <= vol["limit"], vol


def test_a_sidecar_restarted_without_its_arena_serves_right_bytes_from_the_pool(cluster: Cluster,
                                                                                kube: Kube,  # noqa: F811
                                                                                pool_ns: str) -> None:
    """The arena files removed before the kill: the new life cannot adopt anything and starts
    with a new arena; the engine's client remaps it and reads the same right bytes, now fetched
    from the pool (the hit counters show where they came from)."""
    seen = kill_and_restart_sidecar(cluster, kube, pool_ns, "engine-noarena", drop_arena=True)
    print(f"sidecar SIGKILLed and restarted without its arena: {_summary(seen)}")
    _client_kept_working(seen)
    assert _adopted(seen["ready"][-1]) == (0, 0), seen["ready"][-1]
    counters = seen["final"]["counters"]
    assert counters.get(SidecarCounter.RESTART_ADOPTED_OBJECTS, 0) == 0, _summary(seen)
    # Each object came from the pool once (promoted into the new arena), then locally.
    from_pool = counters.get(SidecarCounter.READ_HITS_POOL, 0) + counters.get(SidecarCounter.HIT_BLOCKS_POOL, 0)
    assert from_pool >= OBJECTS, _summary(seen)
    assert counters.get(SidecarCounter.READ_MISSES, 0) == 0, _summary(seen)


def test_the_store_memory_volume_holds_its_arena(cluster: Cluster, kube: Kube, pool_ns: str) -> None:  # noqa: F811
    """The store pod's memory-backed volume (sized by kvpool.core.sizing.store_shm_bytes) holds the
    DRAM arena the node created there."""
    pod = kube.get("v1", "Pod", "p-store-0", pool_ns)
    assert pod is not None
    vol = memory_volume(cluster, pod, "shm")
    print(f"store memory volume: {vol}")
    assert vol["files"] >= 1 and 0 < vol["apparent"] <= vol["limit"], vol
    assert vol["allocated"] <= vol["limit"], vol


def test_the_default_local_tier_fits_the_memory_volume_the_operator_sized(cluster: Cluster, kube: Kube,  # noqa: F811
                                                                          pool_ns: str) -> None:
    """The default local tier (256Mi): its arena below the 0.95 watermark and its journal take
    more than the payload + 16 MiB a volume used to get (kvpool.core.sizing, commit 128b5e1).  The
    node agent would not stop an overflow, so the files the sidecar made are measured."""
    from kvpool.core.sizing import sidecar_shm_bytes

    create(kube, kvpool("d", storage={"replicas": 1, "tiers": [f"t-{pool_ns}"]}, tenancy={"defaultTenant": "public"}),
           pool_ns)
    wait_status(kube, pool_ns, "d", lambda s: s.get("readyReplicas") == 1, 120, "the second pool's store node ready")
    pod = create_pod_injected(kube, pool_ns, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "default-tier", "labels": {"kvpool.io/pool": "d"}},
        "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                 "containers": [{"name": "engine", "image": "unused", "command": ["sleep", "600"]}]}})
    side = pod["spec"]["initContainers"][0]
    local = int(side["args"][side["args"].index("--local") + 1])
    assert local == 256 << 20
    log = cluster.pod_dir(pool_ns, "default-tier", pod["metadata"]["uid"]) / f"{SIDECAR}.log"
    wait_for(lambda: ready_lines(log), 90, "the sidecar's READY line")
    vol = memory_volume(cluster, kube.get("v1", "Pod", "default-tier", pool_ns) or {}, "kvpool-shm")
    print(f"default local tier's memory volume: {vol}")
    assert vol["apparent"] >= sidecar_shm_bytes(local) > local + (16 << 20), vol  # what the old sizing gave
    assert vol["apparent"] <= vol["limit"] and vol["allocated"] <= vol["limit"], vol
    kube.delete("v1", "Pod", "default-tier", pool_ns)
