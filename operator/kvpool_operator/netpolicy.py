"""Builders of a KVPool's NetworkPolicies. Pure: (pool, bound namespaces, settings) → manifests.

Two ingress policies per pool, both owned by the pool (deleted with it):

* ``<pool>-store-ingress`` selects the store pods. Control and transfer ports: pods injected for this
  pool (label ``kvpool.io/pool``, as the webhook reads it) in the namespaces its TenantNamespaces
  bind (or, for a default tenant, the namespaces the pool admits), the pool's own store nodes
  (drain and warm-up pushes), its router API pods, and the operator (control only). KV-event
  ports: what ``spec.router.allowedFrom`` names (ZMQ authenticates nobody). The ``metrics`` port:
  the operator's ``metrics_from`` peers (the monitoring namespace by default).
* ``<pool>-router-ingress`` (with ``spec.router.enabled``) selects the router API pods: ``spec.router.allowedFrom``.

Ports are named (``control``, ``transfer``, ``metrics``...): a policy then follows the pod spec
without repeating its numbers, and a port a pod does not declare simply matches nothing.
Only ingress: egress stays open (store nodes reach each other and DNS). The kubelet's probes
come from the node itself, which network plugins admit to its pods whatever the policies say. The policies select
store and router pods only, never the tenants' pods (a policy selecting a pod denies every
other ingress to it, the application's own ports included).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .children import Manifest, owner_reference, router_labels, selector_labels, store_name
from .children import common_labels as store_common_labels
from .model import POOL_LABEL, PoolSpec, TenantSpec
from .settings import Settings

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
"""Set by the API server on every namespace (immutable): the safe key for a namespaceSelector."""
STORE_CLIENT_PORTS = ("control", "transfer")
EVENT_PORTS = ("events", "events-replay")
ROUTER_PORTS = ("grpc", "http")
METRICS_PORT = "metrics"

Peer = dict[str, Any]


def store_policy_name(pool: PoolSpec) -> str:
    return f"{store_name(pool)}-ingress"


def router_policy_name(pool: PoolSpec) -> str:
    return f"{pool.name}-router-ingress"


def bound_namespaces(pool: PoolSpec, tenants: Iterable[TenantSpec]) -> tuple[str, ...]:
    """Namespaces whose injected pods may reach the store nodes: those of every TenantNamespace
    listing the pool, kept to ``spec.sidecar.namespaces`` when the pool names some (the webhook
    injects nowhere else)."""
    out = {ns for tn in tenants if tn.pool(pool.key) is not None for ns in tn.namespaces}
    if pool.allowed_namespaces:
        out &= set(pool.allowed_namespaces)
    return tuple(sorted(out))


def _ports(names: Sequence[str]) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": n} for n in names]


def _in(key: str, values: Iterable[str]) -> dict[str, Any]:
    return {"matchExpressions": [{"key": key, "operator": "In", "values": sorted(set(values))}]}


def injected_peers(pool: PoolSpec, namespaces: Sequence[str]) -> list[Peer]:
    """Pods the webhook injects for this pool. In the pool's namespace the label may name the
    pool as ``name`` or ``namespace.name``; elsewhere only ``namespace.name`` means this pool."""
    local, remote = pool.namespace in namespaces, [ns for ns in namespaces if ns != pool.namespace]
    if pool.default_tenant is not None:
        # A default tenant admits unbound namespaces too: the allowed ones, or every namespace.
        if not pool.allowed_namespaces:
            return [{"podSelector": _in(POOL_LABEL, [pool.name, pool.key])},
                    {"namespaceSelector": {}, "podSelector": _in(POOL_LABEL, [pool.key])}]
        local = local or pool.namespace in pool.allowed_namespaces
        remote = sorted({*remote, *(ns for ns in pool.allowed_namespaces if ns != pool.namespace)})
    peers: list[Peer] = []
    if local:
        peers.append({"podSelector": _in(POOL_LABEL, [pool.name, pool.key])})
    if remote:
        peers.append({"namespaceSelector": _in(NAMESPACE_NAME_LABEL, remote),
                      "podSelector": _in(POOL_LABEL, [pool.key])})
    return peers


def operator_peer(settings: Settings) -> Peer:
    return {"namespaceSelector": _in(NAMESPACE_NAME_LABEL, [settings.namespace]),
            "podSelector": {"matchLabels": dict(settings.operator_pod_labels)}}


def router_clients(pool: PoolSpec) -> list[Peer]:
    """``spec.router.allowedFrom``; unset: pods of the pool's own namespace."""
    if pool.router_allowed_from is None:
        return [{"podSelector": {}}]
    return [dict(p) for p in pool.router_allowed_from]


def _meta(pool: PoolSpec, name: str, labels: Mapping[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": pool.namespace,
            "labels": {**labels, "app.kubernetes.io/managed-by": "kvpool-operator"},
            "ownerReferences": [owner_reference(pool)]}


def _rules(*rules: tuple[Sequence[Peer], Sequence[str]]) -> list[dict[str, Any]]:
    """Ingress rules (peers, port names); a rule without peers is left out, because an empty
    ``from`` admits every source."""
    return [{"from": list(peers), "ports": _ports(ports)} for peers, ports in rules if peers]


def store_policy(pool: PoolSpec, namespaces: Sequence[str], settings: Settings) -> Manifest:
    """Ingress of the store pods."""
    clients: list[Peer] = [*injected_peers(pool, namespaces), {"podSelector": {"matchLabels": selector_labels(pool)}}]
    if pool.router_enabled:
        clients.append({"podSelector": {"matchLabels": router_labels(pool)}})
    events = router_clients(pool) if pool.events_tenant is not None else []
    rules = _rules((clients, STORE_CLIENT_PORTS), ([operator_peer(settings)], ["control"]), (events, EVENT_PORTS),
                   ([dict(p) for p in settings.metrics_from], [METRICS_PORT]))
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(pool, store_policy_name(pool), store_common_labels(pool)),
            "spec": {"podSelector": {"matchLabels": selector_labels(pool)}, "policyTypes": ["Ingress"],
                     "ingress": rules}}


def router_policy(pool: PoolSpec) -> Manifest:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(pool, router_policy_name(pool), router_labels(pool)),
            "spec": {"podSelector": {"matchLabels": router_labels(pool)}, "policyTypes": ["Ingress"],
                     "ingress": _rules((router_clients(pool), ROUTER_PORTS))}}


def network_policies(pool: PoolSpec, tenants: Iterable[TenantSpec], settings: Settings) -> list[Manifest]:
    """The pool's NetworkPolicies (none when the operator's ``network_policy`` setting is off)."""
    if not settings.network_policy:
        return []
    out = [store_policy(pool, bound_namespaces(pool, tenants), settings)]
    if pool.router_enabled:
        out.append(router_policy(pool))
    return out


def pruned_policies(listed: Iterable[str], wanted: Iterable[Manifest]) -> tuple[tuple[str, str, str], ...]:
    """Policies named in status (``listed``) that the pool no longer wants, as (apiVersion, kind,
    name) to delete: the router's when the router goes, both when the operator's switch is off."""
    keep = {m["metadata"]["name"] for m in wanted}
    return tuple(("networking.k8s.io/v1", "NetworkPolicy", n) for n in listed if n not in keep)
