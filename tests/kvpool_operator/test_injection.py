"""The injection patch: what a pod gets, idempotence, never overwriting, every skip reason."""

import dataclasses
from typing import Any

import pytest

from kvpool.sidecar.main import build_parser, config_from_args
from kvpool_operator.injection import (
    SIDECAR_NAME,
    Injection,
    PoolView,
    deadline_args,
    plan_injection,
    pool_view_from_body,
)
from kvpool_operator.model import SidecarDeadlines, SpecError, TenantSpec, parse_pool, parse_tenant
from kvpool_operator.settings import Settings
from kvpool_operator.testing import apply_merge_patch, pool_body, tenant_body

# Plaintext: the arguments and mounts without TLS; what TLS (the default) adds is tested in the
# test_tls_* tests.
S = Settings(tls=False)
POOL = PoolView("pools", "shared", local_bytes=64 << 20, drain_seconds=20, default_tenant="public",
                seeds=("127.0.0.10:7400", "shared-store.pools.svc:7400"))
CLOSED = PoolView("pools", "closed", local_bytes=64 << 20, drain_seconds=20, seeds=("svc:7400",))
POOLS = {("pools", "shared"): POOL, ("pools", "closed"): CLOSED, ("app", "local"): PoolView("app", "local", 1, 0)}
TEAM_A = parse_tenant(tenant_body("a", "team-a", ["app"], [{"pool": "pools.shared"}, {"pool": "pools.closed"}]))


def _pod(label: str = "pools.shared", **spec: Any) -> dict[str, Any]:
    s: dict[str, Any] = {"containers": [{"name": "engine", "image": "e"}, {"name": "helper", "image": "h"}]}
    s.update(spec)
    return {"metadata": {"name": "e-1", "labels": {"kvpool.io/pool": label}}, "spec": s}


def _plan(pod: dict[str, Any], bindings: list[TenantSpec] | None = None, ns: str = "app",
          settings: Settings = S) -> Injection:
    return plan_injection(pod, ns, POOLS, bindings or [], settings)


def test_injects_everything_for_the_default_tenant() -> None:
    r = _plan(_pod())
    assert r.injected and r.reason == "Injected" and r.tenant == "public"
    pod = apply_merge_patch(_pod(), r.patch)
    side = pod["spec"]["initContainers"][0]
    assert side["name"] == SIDECAR_NAME and side["restartPolicy"] == "Always"
    assert side["command"] == ["kvpool", "sidecar"]
    assert side["args"] == ["--socket", "/run/kvpool/kvpool.sock", "--pool",
                            "127.0.0.10:7400,shared-store.pools.svc:7400", "--local", str(64 << 20),
                            "--drain-seconds", "20", "--metrics-port", "7461", "--metrics-addr", "$(POD_IP)",
                            "--handoff-listen", "$(POD_IP):7460", "--handoff-advertise", "$(POD_IP):7460"]
    # The prefill → decode handoff exports state objects on the pod IP, and the metrics (on by
    # default) are served there too.
    assert side["env"][0] == {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    assert side["ports"] == [{"name": "kvpool-metrics", "containerPort": 7461},
                             {"name": "kvpool-handoff", "containerPort": 7460}]
    assert side["startupProbe"]["exec"]["command"] == ["test", "-S", "/run/kvpool/kvpool.sock"]
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    # The arena (64Mi below the 0.95 watermark: 67.4Mi) + its journal (1.6Mi) + 16Mi slack, in MiB.
    assert vols["kvpool-shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "85Mi"}
    assert "kvpool-tenant" not in vols
    for c in pod["spec"]["containers"]:
        assert {"name": "kvpool-shm", "mountPath": "/run/kvpool"} in c["volumeMounts"]
        assert {"name": "KVPOOL_ADDRESS", "value": "unix:///run/kvpool/kvpool.sock"} in c["env"]
    assert "terminationGracePeriodSeconds" not in pod["spec"]  # the default 30 s already covers 20 + 5
    assert pod["metadata"]["annotations"]["kvpool.io/injected"] == "pools.shared"


def test_tenant_credentials_are_mounted() -> None:
    r = _plan(_pod("pools.closed"), [TEAM_A])
    assert r.injected and r.tenant == "team-a"
    pod = apply_merge_patch(_pod("pools.closed"), r.patch)
    side = pod["spec"]["initContainers"][0]
    i = side["args"].index("--tenant")
    assert side["args"][i:i + 4] == ["--tenant", "team-a", "--credentials", "/etc/kvpool/tenant/credentials.json"]
    assert {"name": "kvpool-tenant", "mountPath": "/etc/kvpool/tenant", "readOnly": True} in side["volumeMounts"]
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert vols["kvpool-tenant"]["secret"]["secretName"] == "kvpool-tenant-team-a"
    # The app containers never see the credentials.
    assert all("kvpool-tenant" not in {m["name"] for m in c["volumeMounts"]} for c in pod["spec"]["containers"])


def test_tls_mounts_the_tenant_certificate_of_the_pool() -> None:
    """With --tls the sidecar gets its tenant's certificate of this pool (and the pool's CA bundle)
    as --tls-dir, and checks the store nodes by the name their shared certificate serves."""
    tls = dataclasses.replace(S, tls=True)
    pod = apply_merge_patch(_pod("pools.closed"), _plan(_pod("pools.closed"), [TEAM_A], settings=tls).patch)
    side = pod["spec"]["initContainers"][0]
    args = side["args"]
    assert args[args.index("--tls-dir") + 1] == "/etc/kvpool/tls"
    assert args[args.index("--tls-server-name") + 1] == "closed-store.pools.svc"
    assert {"name": "kvpool-tls", "mountPath": "/etc/kvpool/tls", "readOnly": True} in side["volumeMounts"]
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert vols["kvpool-tls"]["secret"]["secretName"] == "kvpool-tls-pools.closed"
    assert all("kvpool-tls" not in {m["name"] for m in c["volumeMounts"]} for c in pod["spec"]["containers"])
    parsed = build_parser().parse_args(args)  # the sidecar takes the flags rendered
    assert (parsed.tls_dir, parsed.tls_server_name) == ("/etc/kvpool/tls", "closed-store.pools.svc")
    off = apply_merge_patch(_pod("pools.closed"), _plan(_pod("pools.closed"), [TEAM_A]).patch)
    assert "--tls-dir" not in off["spec"]["initContainers"][0]["args"]


def test_tls_default_tenant_gets_the_pools_default_certificate_where_it_is_issued() -> None:
    """A default-tenant sidecar mounts the pool's default-tenant certificate in the namespaces the
    pool issues it to (its own, or spec.sidecar.namespaces); anywhere else no sidecar is injected
    (it could not reach a TLS store node), and the skip says why."""
    tls = dataclasses.replace(S, tls=True)
    here = _plan(_pod(), ns="pools", settings=tls)
    assert here.injected and here.tenant == "public"
    pod = apply_merge_patch(_pod(), here.patch)
    side = pod["spec"]["initContainers"][0]
    assert side["args"][side["args"].index("--tls-dir") + 1] == "/etc/kvpool/tls"
    assert "--tenant" not in side["args"]
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert vols["kvpool-tls"]["secret"]["secretName"] == "kvpool-default-tls-pools.shared"
    elsewhere = _plan(_pod(), ns="app", settings=tls)
    assert not elsewhere.injected and elsewhere.reason == "NoCertificate"
    assert "spec.sidecar.namespaces" in elsewhere.patch["metadata"]["annotations"]["kvpool.io/skip-reason"]
    listed = {("pools", "shared"): dataclasses.replace(POOL, allowed_namespaces=("app",))}
    assert plan_injection(_pod(), "app", listed, [], tls).injected
    assert _plan(_pod(), ns="app").injected  # without TLS nothing changes


def test_idempotent() -> None:
    first = apply_merge_patch(_pod(), _plan(_pod()).patch)
    again = _plan(first)
    assert not again.injected and again.reason == "AlreadyInjected"
    assert apply_merge_patch(first, again.patch)["spec"] == first["spec"]
    # Even without the annotation, an existing sidecar container is not added twice.
    del first["metadata"]["annotations"]["kvpool.io/injected"]
    assert _plan(first).reason == "AlreadyInjected"


def test_never_overwrites_user_values() -> None:
    user = _pod(terminationGracePeriodSeconds=300,
                volumes=[{"name": "kvpool-shm", "emptyDir": {}}],
                initContainers=[{"name": "setup", "image": "s"}])
    user["spec"]["containers"][0]["env"] = [{"name": "KVPOOL_ADDRESS", "value": "unix:///mine.sock"}]
    user["spec"]["containers"][1]["volumeMounts"] = [{"name": "other", "mountPath": "/run/kvpool"}]
    pod = apply_merge_patch(user, _plan(user).patch)
    spec = pod["spec"]
    assert spec["terminationGracePeriodSeconds"] == 300
    assert [v for v in spec["volumes"] if v["name"] == "kvpool-shm"] == [{"name": "kvpool-shm", "emptyDir": {}}]
    assert [c["name"] for c in spec["initContainers"]] == [SIDECAR_NAME, "setup"]
    env0 = spec["containers"][0]["env"]
    assert [e for e in env0 if e["name"] == "KVPOOL_ADDRESS"] == [{"name": "KVPOOL_ADDRESS", "value": "unix:///mine.sock"}]
    assert spec["containers"][1]["volumeMounts"] == [{"name": "other", "mountPath": "/run/kvpool"}]


def test_grace_raised_to_cover_the_drain() -> None:
    pod = apply_merge_patch(_pod(terminationGracePeriodSeconds=5), _plan(_pod(terminationGracePeriodSeconds=5)).patch)
    assert pod["spec"]["terminationGracePeriodSeconds"] == 25
    slow = PoolView("pools", "shared", 1, drain_seconds=120, default_tenant="x")
    r = plan_injection(_pod(), "app", {("pools", "shared"): slow}, [], S)
    assert r.patch["spec"]["terminationGracePeriodSeconds"] == 125


def test_clears_a_copied_skip_reason() -> None:
    pod = _pod()
    pod["metadata"]["annotations"] = {"kvpool.io/skip-reason": "NoSuchPool: old"}
    out = apply_merge_patch(pod, _plan(pod).patch)
    assert "kvpool.io/skip-reason" not in out["metadata"]["annotations"]


@pytest.mark.parametrize(("label", "bindings", "ns", "reason"), [
    ("nope", [], "app", "NoSuchPool"),
    ("pools.nope", [], "app", "NoSuchPool"),
    ("pools.", [], "app", "InvalidPoolLabel"),
    ("pools.closed", [], "app", "NoTenant"),
    ("pools.shared", [TEAM_A, parse_tenant(tenant_body("b", "team-b", ["app"]))], "app", "TenantConflict"),
    ("app.local", [TEAM_A], "app", "TenantNotAdmitted"),
])
def test_skip_reasons(label: str, bindings: list[TenantSpec], ns: str, reason: str) -> None:
    r = _plan(_pod(label), bindings, ns)
    assert not r.injected and r.reason == reason
    value = r.patch["metadata"]["annotations"]["kvpool.io/skip-reason"]
    assert value.startswith(f"{reason}: ") and len(value) > len(reason) + 10
    assert "spec" not in r.patch


def test_skip_opt_out_and_namespace_not_allowed() -> None:
    pod = _pod()
    pod["metadata"]["annotations"] = {"kvpool.io/inject": "false"}
    assert _plan(pod).reason == "OptedOut"
    only = PoolView("pools", "shared", 1, 0, default_tenant="x", allowed_namespaces=("prod",))
    assert plan_injection(_pod(), "app", {("pools", "shared"): only}, [], S).reason == "NamespaceNotAllowed"


def test_skip_annotation_is_not_rewritten() -> None:
    r = _plan(_pod("nope"))
    pod = apply_merge_patch(_pod("nope"), r.patch)
    assert _plan(pod).patch == {}


def test_pool_view_from_a_pool_body() -> None:
    body = pool_body("shared", "pools", sidecar={"localBytes": "1Gi", "drainSeconds": 7},
                     tenancy={"defaultTenant": "public"})
    body["status"] = {"ring": {"epoch": 2, "members": [{"id": "a", "address": "1.2.3.4:7400"}]}}
    v = pool_view_from_body(body)
    assert (v.local_bytes, v.drain_seconds, v.default_tenant) == (1 << 30, 7, "public")
    assert v.seeds == ("1.2.3.4:7400", "shared-store.pools.svc:7400")


def test_handoff_export_and_metrics_can_be_switched_off() -> None:
    r = _plan(_pod(), settings=dataclasses.replace(S, sidecar_handoff_port=0))
    side = apply_merge_patch(_pod(), r.patch)["spec"]["initContainers"][0]
    assert "--handoff-listen" not in side["args"] and side["ports"] == [{"name": "kvpool-metrics",
                                                                         "containerPort": 7461}]
    r = _plan(_pod(), settings=dataclasses.replace(S, sidecar_handoff_port=0, sidecar_metrics_port=0))
    side = apply_merge_patch(_pod(), r.patch)["spec"]["initContainers"][0]
    assert "--handoff-listen" not in side["args"] and "--metrics-port" not in side["args"] and "ports" not in side
    assert all(e["name"] != "POD_IP" for e in side["env"])


def test_pool_deadlines_reach_the_sidecar_args() -> None:
    """spec.sidecar.deadlines → the injected sidecar's flags (only those that differ from its defaults)."""
    body = {"metadata": {"namespace": "pools", "name": "shared"},
            "spec": {"tenancy": {"defaultTenant": "public"},
                     "sidecar": {"localBytes": "64Mi", "deadlines": {"matchMs": 250, "readMs": 100,
                                                                      "readBytesPerSecond": 50_000_000,
                                                                      "suspectBackoffMs": 500}}}}
    view = pool_view_from_body(body)
    assert view.deadlines == SidecarDeadlines(match_ms=250, read_bytes_per_second=50_000_000, suspect_backoff_ms=500)
    pools = {("pools", "shared"): view}
    r = plan_injection(_pod(), "app", pools, [], S)
    args = apply_merge_patch(_pod(), r.patch)["spec"]["initContainers"][0]["args"]
    i = args.index("--match-deadline-ms")
    assert args[i:i + 6] == ["--match-deadline-ms", "250", "--read-bytes-per-second", "50000000",
                             "--suspect-backoff-ms", "500"]
    assert "--read-deadline-ms" not in args and "--probe-deadline-ms" not in args
    # The sidecar takes what the operator renders.
    cfg = config_from_args(build_parser().parse_args(args))
    assert (cfg.match_deadline_ms, cfg.read_deadline_ms, cfg.read_bytes_per_second, cfg.suspect_backoff_ms) == (
        250, 100, 50_000_000, 500)
    # Defaults (what the CRD fills in) add no argument.
    assert deadline_args(SidecarDeadlines()) == []
    with pytest.raises(SpecError):
        parse_pool({**body, "spec": {"sidecar": {"deadlines": {"matchMs": 0}}}})


def test_pool_deadline_defaults_are_the_sidecars() -> None:
    """``deadline_args`` leaves out a setting equal to the operator's default, so that default must
    be the sidecar's own (its config and its command line): if they drifted apart, a pool asking
    for the operator's default would silently get the sidecar's."""
    from kvpool.sidecar.config import SidecarConfig
    from kvpool.sidecar.main import build_parser, config_from_args
    from kvpool_operator.model import SidecarDeadlines
    d = SidecarDeadlines()
    want = (d.match_ms, d.read_ms, d.read_bytes_per_second, d.probe_ms, d.suspect_backoff_ms)
    for cfg in (SidecarConfig(socket="/s", pool=[]),
                config_from_args(build_parser().parse_args(["--socket", "/s", "--pool", ""]))):
        assert (cfg.match_deadline_ms, cfg.read_deadline_ms, cfg.read_bytes_per_second, cfg.probe_deadline_ms,
                cfg.suspect_backoff_ms) == want
