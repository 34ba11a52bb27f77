"""The router API and KV events children of a KVPool (pure builders and the reconcile's prune)."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool_operator import children
from kvpool_operator.model import STORE_POOL_LABEL, SpecError, parse_pool, resolve_layout
from kvpool_operator.reconcile import PoolObserved, plan_pool
from kvpool_operator.settings import Settings
from kvpool_operator.testing import apply_merge_patch, pool_body

# Plaintext; what TLS (the default) adds is test_router_with_tls_serves_its_certificate_....
S = Settings(tls=False)


def _kinds(manifests: Any) -> list[tuple[str, str]]:
    return [(m["kind"], m["metadata"]["name"]) for m in manifests]


def _build(**spec: Any) -> tuple[Any, list[dict[str, Any]]]:
    pool = parse_pool(pool_body(**spec))
    layout = resolve_layout(pool, {}, S.default_dram_bytes, S.store_memory_overhead_bytes)
    return pool, children.children(pool, layout, S, 2)


def test_router_off_by_default_and_on_when_asked() -> None:
    pool, manifests = _build()
    assert not pool.router_enabled and ("Deployment", "p-router") not in _kinds(manifests)
    assert children.router_status(pool, S) is None
    pool, manifests = _build(router={"enabled": True, "replicas": 2})
    kinds = _kinds(manifests)
    assert ("Deployment", "p-router") in kinds and ("Service", "p-router") in kinds
    assert manifests[-1]["kind"] == "StatefulSet"  # the reconcile edits the last one's claims
    dep = next(m for m in manifests if m["kind"] == "Deployment")
    assert dep["spec"]["replicas"] == 2
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["command"][-1] == "router-api"
    assert c["args"][c["args"].index("--pool") + 1] == "p-store.ns.svc:7400"
    assert "--http" in c["args"] and "$(POD_IP):7451" in c["args"]
    assert dep["metadata"]["ownerReferences"][0]["kind"] == "KVPool"
    st = children.router_status(pool, S)
    assert st == {"enabled": True, "grpc": "p-router.ns.svc:7450", "http": "http://p-router.ns.svc:7451/v1/pool/match",
                  "caBundle": None, "events": None}
    assert "--tls-dir" not in c["args"] and "volumes" not in dep["spec"]["template"]["spec"]


def test_router_with_tls_serves_its_certificate_and_says_where_the_bundle_is() -> None:
    """With TLS the router mounts <pool>-router-tls as --tls-dir (checking store nodes by their
    shared name) and the status tells callers its HTTPS URL and the CA bundle's ConfigMap."""
    tls = Settings(tls=True)
    pool = parse_pool(pool_body(router={"enabled": True}))
    dep = children.router_deployment(pool, tls)
    spec = dep["spec"]["template"]["spec"]
    c = spec["containers"][0]
    assert c["args"][c["args"].index("--tls-dir") + 1] == children.TLS_DIR
    assert c["args"][c["args"].index("--tls-server-name") + 1] == "p-store.ns.svc"
    assert spec["volumes"] == [{"name": "tls", "secret": {"secretName": "p-router-tls", "defaultMode": 0o400}}]
    assert c["volumeMounts"] == [{"name": "tls", "mountPath": children.TLS_DIR, "readOnly": True}]
    from kvpool.apps.router_api import build_parser
    parsed = build_parser().parse_args(c["args"])  # the router takes the flags rendered
    assert (parsed.tls_dir, parsed.tls_server_name) == (children.TLS_DIR, "p-store.ns.svc")
    st = children.router_status(pool, tls)
    assert st is not None and st["http"] == "https://p-router.ns.svc:7451/v1/pool/match"
    assert st["caBundle"] == {"configMap": "p-ca-bundle", "key": "ca.crt"}


def test_router_pods_are_never_taken_for_store_nodes() -> None:
    pool, manifests = _build(router={"enabled": True})
    dep = next(m for m in manifests if m["kind"] == "Deployment")
    svc = next(m for m in manifests if m["kind"] == "Service" and m["metadata"]["name"] == "p-router")
    store_selector = children.selector_labels(pool)
    for labels in (dep["spec"]["template"]["metadata"]["labels"], dep["spec"]["selector"]["matchLabels"],
                   dep["metadata"]["labels"], svc["spec"]["selector"]):
        assert STORE_POOL_LABEL not in labels
        assert not all(labels.get(k) == v for k, v in store_selector.items())
    tmpl = dep["spec"]["template"]["metadata"]["labels"]
    assert all(tmpl.get(k) == v for k, v in svc["spec"]["selector"].items())


def test_events_of_one_tenant_on_the_store_nodes() -> None:
    pool, manifests = _build(router={"events": {"enabled": True, "tenant": "team-a"}})
    assert pool.events_tenant == "team-a" and not pool.router_enabled
    sts = manifests[-1]
    c = sts["spec"]["template"]["spec"]["containers"][0]
    args = c["args"]
    assert args[args.index("--events-endpoint") + 1] == "tcp://$(POD_IP):7402"
    assert args[args.index("--events-replay-endpoint") + 1] == "tcp://$(POD_IP):7403"
    assert args[args.index("--events-tenant") + 1] == "team-a"
    assert args[args.index("--events-block-size") + 1] == "128"
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {
        "control": 7400, "transfer": 7401, "events": 7402, "events-replay": 7403, "metrics": 7404}
    headless = next(m for m in manifests if m["kind"] == "Service" and m["metadata"]["name"] == "p-store")
    assert {p["name"] for p in headless["spec"]["ports"]} == {"control", "transfer", "events", "events-replay"}
    events = {"port": 7402, "replayPort": 7403, "service": "p-store.ns.svc"}
    assert children.router_status(pool, S) == {"enabled": False, "grpc": None, "http": None, "caBundle": None,
                                               "events": events}
    # The pool's default tenant is the store's tokenless "default" partition.
    pool, manifests = _build(router={"events": {"enabled": True, "tenant": "public"}},
                             tenancy={"defaultTenant": "public"})
    args = manifests[-1]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--events-tenant") + 1] == "default"
    # Off: nothing of it.
    pool, manifests = _build(router={"events": {"enabled": False, "tenant": "x"}})
    assert "--events-endpoint" not in manifests[-1]["spec"]["template"]["spec"]["containers"][0]["args"]


def test_events_without_a_tenant_are_refused() -> None:
    with pytest.raises(SpecError, match="needs a tenant"):
        parse_pool(pool_body(router={"events": {"enabled": True}}))


def test_switching_the_router_off_prunes_it_once() -> None:
    body = pool_body(router={"enabled": True})
    plan = plan_pool(PoolObserved(body=body, now_ms=1, now_iso="t"), S)
    assert plan.prune == () and plan.status["router"]["enabled"]
    body = dict(body, status=apply_merge_patch({}, plan.status))
    # Off but events on: the router fields leave the status (merge patch), the events stay.
    ev = dict(body, spec={**body["spec"], "router": {"enabled": False, "events": {"enabled": True, "tenant": "t"}}})
    plan = plan_pool(PoolObserved(body=ev, now_ms=2, now_iso="t"), S)
    assert len(plan.prune) == 4  # the Deployment, the Service, its certificate and its NetworkPolicy
    shown = apply_merge_patch(body["status"], plan.status)["router"]
    assert shown == {"enabled": False, "events": {"port": 7402, "replayPort": 7403, "service": "p-store.ns.svc"}}
    off = dict(body, spec={**body["spec"], "router": {"enabled": False}})
    plan = plan_pool(PoolObserved(body=off, now_ms=2, now_iso="t"), S)
    assert set(plan.prune) == {("apps/v1", "Deployment", "p-router"), ("v1", "Service", "p-router"),
                               ("v1", "Secret", "p-router-tls"),
                               ("networking.k8s.io/v1", "NetworkPolicy", "p-router-ingress")}
    assert plan.status["router"] is None
    after = dict(off, status=apply_merge_patch(off["status"], plan.status))
    assert "router" not in after["status"]
    assert plan_pool(PoolObserved(body=after, now_ms=3, now_iso="t"), S).prune == ()
