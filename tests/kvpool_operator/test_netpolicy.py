"""A KVPool's NetworkPolicies (pure builders in kvpool_operator.netpolicy, and the reconcile that
applies, updates and prunes them)."""

from __future__ import annotations

from typing import Any

from kvpool_operator import netpolicy
from kvpool_operator.main import build_parser, settings_from
from kvpool_operator.model import POOL_LABEL, STORE_POOL_LABEL, parse_pool, parse_tenant
from kvpool_operator.reconcile import PoolObserved, plan_pool
from kvpool_operator.settings import Settings
from kvpool_operator.tenancy import Credentials
from kvpool_operator.testing import apply_merge_patch, pool_body, tenant_body

S = Settings(namespace="kvpool-system")
NS_KEY = netpolicy.NAMESPACE_NAME_LABEL


def _tenant(name: str, namespaces: list[str], pool: str = "ns.p") -> Any:
    return parse_tenant(tenant_body(name, name, namespaces, [{"pool": pool}]))


def _rules(policy: dict[str, Any]) -> dict[tuple[str, ...], list[dict[str, Any]]]:
    """Ingress rules by their port names."""
    return {tuple(p["port"] for p in r["ports"]): r["from"] for r in policy["spec"]["ingress"]}


def _values(selector: dict[str, Any]) -> tuple[str, list[str]]:
    (expr,) = selector["matchExpressions"]
    assert expr["operator"] == "In"
    return expr["key"], expr["values"]


def test_store_ports_admit_the_pools_injected_pods_of_bound_namespaces_its_nodes_and_the_operator() -> None:
    pool = parse_pool(pool_body())
    tenants = [_tenant("a", ["team-a", "ns"]), _tenant("b", ["team-b"]), _tenant("c", ["team-c"], pool="ns.other")]
    (policy,) = netpolicy.network_policies(pool, tenants, S)
    assert policy["kind"] == "NetworkPolicy" and policy["metadata"]["namespace"] == "ns"
    assert policy["metadata"]["ownerReferences"][0]["kind"] == "KVPool"
    assert policy["spec"]["podSelector"] == {"matchLabels": {
        "app.kubernetes.io/name": "kvpool", "app.kubernetes.io/component": "store",
        "app.kubernetes.io/instance": "p", STORE_POOL_LABEL: "p"}}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    rules = _rules(policy)
    local, remote, stores = rules[("control", "transfer")]
    # In the pool's namespace the label may say "p" or "ns.p"; elsewhere only "ns.p" is this pool.
    assert set(local) == {"podSelector"} and _values(local["podSelector"]) == (POOL_LABEL, ["ns.p", "p"])
    assert _values(remote["namespaceSelector"]) == (NS_KEY, ["team-a", "team-b"])  # not team-c: another pool
    assert _values(remote["podSelector"]) == (POOL_LABEL, ["ns.p"])
    assert stores == {"podSelector": policy["spec"]["podSelector"]}  # drain and warm-up pushes
    (op,) = rules[("control",)]
    assert _values(op["namespaceSelector"]) == (NS_KEY, ["kvpool-system"])
    assert op["podSelector"]["matchLabels"] == S.operator_pod_labels
    assert rules[("metrics",)] == [{"namespaceSelector": {"matchLabels": {NS_KEY: "monitoring"}}}]
    assert set(rules) == {("control", "transfer"), ("control",), ("metrics",)}  # no events, no router


def test_no_bound_namespace_leaves_only_the_nodes_and_the_operator() -> None:
    (policy,) = netpolicy.network_policies(parse_pool(pool_body()), [], S)
    assert _rules(policy)[("control", "transfer")] == [{"podSelector": policy["spec"]["podSelector"]}]
    # No rule with an empty "from" anywhere: that would admit every pod of the cluster.
    assert all(r["from"] for r in policy["spec"]["ingress"])


def test_allowed_namespaces_bound_the_tenants_and_a_default_tenant_admits_them() -> None:
    pool = parse_pool(pool_body(sidecar={"namespaces": ["team-a", "free"]}))
    assert netpolicy.bound_namespaces(pool, [_tenant("a", ["team-a", "team-b"])]) == ("team-a",)
    pool = parse_pool(pool_body(sidecar={"namespaces": ["free", "ns"]}, tenancy={"defaultTenant": "shared"}))
    peers = netpolicy.injected_peers(pool, ["team-a"])
    assert peers[0] == {"podSelector": {"matchExpressions": [
        {"key": POOL_LABEL, "operator": "In", "values": ["ns.p", "p"]}]}}
    assert _values(peers[1]["namespaceSelector"]) == (NS_KEY, ["free", "team-a"])
    # A default tenant and no namespace list: injected pods of every namespace.
    pool = parse_pool(pool_body(tenancy={"defaultTenant": "shared"}))
    peers = netpolicy.injected_peers(pool, [])
    assert {"namespaceSelector": {}, "podSelector": {"matchExpressions": [
        {"key": POOL_LABEL, "operator": "In", "values": ["ns.p"]}]}} in peers


def test_router_accepts_what_the_pool_names_and_its_events_ports_too() -> None:
    named = [{"namespaceSelector": {"matchLabels": {NS_KEY: "routers"}},
              "podSelector": {"matchLabels": {"app": "llm-d-router"}}}]
    pool = parse_pool(pool_body(router={"enabled": True, "allowedFrom": named,
                                        "events": {"enabled": True, "tenant": "t"}}))
    store, router = netpolicy.network_policies(pool, [], S)
    assert router["metadata"]["name"] == "p-router-ingress"
    assert router["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
    assert _rules(router) == {("grpc", "http"): named}
    rules = _rules(store)
    assert rules[("events", "events-replay")] == named  # ZMQ authenticates nobody
    # The router pods themselves reach the store nodes (they hold no credential of their own).
    assert {"podSelector": {"matchLabels": router["spec"]["podSelector"]["matchLabels"]}} in rules[
        ("control", "transfer")]
    # Unset: the pool's own namespace.
    pool = parse_pool(pool_body(router={"enabled": True}))
    assert _rules(netpolicy.network_policies(pool, [], S)[1]) == {("grpc", "http"): [{"podSelector": {}}]}


def test_router_allowed_from_empty_admits_nobody() -> None:
    pool = parse_pool(pool_body(router={"enabled": True, "allowedFrom": []}))
    _, router = netpolicy.network_policies(pool, [], S)
    # An ingress rule with an empty "from" would admit everyone: no rule at all admits nobody.
    assert router["spec"]["ingress"] == [] and router["spec"]["policyTypes"] == ["Ingress"]


def test_the_switch_and_the_metrics_peers() -> None:
    pool = parse_pool(pool_body(router={"enabled": True}))
    assert netpolicy.network_policies(pool, [], Settings(network_policy=False)) == []
    (store, _) = netpolicy.network_policies(pool, [], Settings(metrics_from=()))
    assert ("metrics",) not in _rules(store)
    args = build_parser().parse_args(["--no-network-policy", "--operator-pod-labels", "app=op,tier=ctl",
                                      "--metrics-from", '[{"podSelector": {"matchLabels": {"app": "prom"}}}]'])
    s = settings_from(args)
    assert not s.network_policy and s.operator_pod_labels == {"app": "op", "tier": "ctl"}
    assert s.metrics_from == ({"podSelector": {"matchLabels": {"app": "prom"}}},)
    defaults = settings_from(build_parser().parse_args([]))
    assert defaults.network_policy and defaults.metrics_from == Settings().metrics_from


def test_reconcile_applies_updates_and_prunes_the_policies() -> None:
    creds = Credentials(tenant_id="a", token="tok", salt=b"s")
    body = pool_body(router={"enabled": True})
    plan = plan_pool(PoolObserved(body=body, now_ms=1, now_iso="t", tenants=[(_tenant("a", ["team-a"]), creds)]), S)
    kinds = [(m["kind"], m["metadata"]["name"]) for m in plan.children]
    assert ("NetworkPolicy", "p-store-ingress") in kinds and ("NetworkPolicy", "p-router-ingress") in kinds
    assert plan.children[-1]["kind"] == "StatefulSet"
    assert plan.status["networkPolicies"] == ["p-store-ingress", "p-router-ingress"]
    store = next(m for m in plan.children if m["metadata"]["name"] == "p-store-ingress")
    assert _values(_rules(store)[("control", "transfer")][0]["namespaceSelector"])[1] == ["team-a"]
    # A second TenantNamespace binding the pool: the same policy, one more namespace.
    more = [(_tenant("a", ["team-a"]), creds), (_tenant("b", ["team-b"]), creds)]
    plan = plan_pool(PoolObserved(body=body, now_ms=2, now_iso="t", tenants=more), S)
    store = next(m for m in plan.children if m["metadata"]["name"] == "p-store-ingress")
    assert _values(_rules(store)[("control", "transfer")][0]["namespaceSelector"])[1] == ["team-a", "team-b"]
    # The operator's switch goes off: both policies are pruned once, and status forgets them.
    body = dict(body, status=apply_merge_patch({}, plan.status))
    plan = plan_pool(PoolObserved(body=body, now_ms=3, now_iso="t"), Settings(network_policy=False))
    assert {p for p in plan.prune if p[1] == "NetworkPolicy"} == {
        ("networking.k8s.io/v1", "NetworkPolicy", "p-store-ingress"),
        ("networking.k8s.io/v1", "NetworkPolicy", "p-router-ingress")}
    assert not any(m["kind"] == "NetworkPolicy" for m in plan.children)
    after = dict(body, status=apply_merge_patch(body["status"], plan.status))
    assert "networkPolicies" not in after["status"]
    assert not any(p[1] == "NetworkPolicy" for p in plan_pool(
        PoolObserved(body=after, now_ms=4, now_iso="t"), Settings(network_policy=False)).prune)


def test_drift_of_a_policy_is_watched_only_with_the_switch_on() -> None:
    import kopf

    from kvpool_operator.handlers import register_all
    from kvpool_operator.kube import Kube
    from kvpool_operator.nodes import Nodes
    from kvpool_operator.runtime import Runtime

    def watched(settings: Settings) -> set[str]:
        reg = kopf.OperatorRegistry()
        register_all(reg, Runtime(settings, Kube(None), Nodes()), with_webhook=False)
        return {str(h.id) for h in reg._watching.get_all_handlers()}

    assert "network_policy" in watched(Settings())
    assert "network_policy" not in watched(Settings(network_policy=False))  # no RBAC to watch them then


def test_the_policy_ports_are_the_names_the_pods_declare() -> None:
    """Policies name ports (a port a pod does not declare matches nothing, silently): the names
    must be those of the store and router containers that children.py builds."""
    from kvpool_operator import children
    from kvpool_operator.model import resolve_layout

    pool = parse_pool(pool_body(router={"enabled": True, "events": {"enabled": True, "tenant": "t"}}))
    layout = resolve_layout(pool, {}, S.default_dram_bytes, S.store_memory_overhead_bytes)
    store = {p["name"] for p in children.store_container(pool, layout, S)["ports"]}
    router = {p["name"] for p in children.router_deployment(pool, S)["spec"]["template"]["spec"]["containers"][0][
        "ports"]}
    assert {*netpolicy.STORE_CLIENT_PORTS, *netpolicy.EVENT_PORTS} <= store
    assert set(netpolicy.ROUTER_PORTS) <= router
