"""A KVPool's NetworkPolicies on the real control plane: the operator creates them, the API server
admits them (its NetworkPolicy validation, not ours), and they follow the TenantNamespaces that
bind the pool, the router switch and a deletion by hand.

The harness's node agent does not enforce NetworkPolicies (it runs pods as processes on one
loopback): this shows the objects, not the packet filtering, which is the network plugin's job.
"""

from __future__ import annotations

from typing import Any

import pytest

from e2e.test_operator_pool import (  # noqa: F401 (fixtures used by name)
    API,
    Operator,
    create,
    kube,
    kvpool,
    operator,
)
from e2e.testutil import wait_for
from kvpool_operator.kube import Kube

pytestmark = pytest.mark.cluster

NP = "networking.k8s.io/v1"


def _policy(k: Kube, ns: str, name: str) -> dict[str, Any] | None:
    return k.get(NP, "NetworkPolicy", name, ns)


def _tenant_namespaces(policy: dict[str, Any]) -> list[str]:
    """The namespaces whose injected pods the store policy admits (besides the pool's own)."""
    (clients,) = [r["from"] for r in policy["spec"]["ingress"]
                  if [p["port"] for p in r["ports"]] == ["control", "transfer"]]
    return sorted(v for p in clients if "namespaceSelector" in p
                  for e in p["namespaceSelector"].get("matchExpressions", []) for v in e["values"])


def test_policies_created_admitted_and_following_tenants(operator: Operator, kube: Kube,  # noqa: F811
                                                         namespace: str) -> None:
    extra = [f"{namespace}-a", f"{namespace}-b"]
    for ns in extra:
        kube.create({"apiVersion": "v1", "kind": "Namespace",
                     "metadata": {"name": ns, "labels": {"kvpool-e2e/test": ns}}})
    tenants = [f"np-{namespace}-a", f"np-{namespace}-b"]
    try:
        # No store pods (replicas 0): the policies do not depend on them, and the cores are shared.
        pool = create(kube, kvpool("guarded", storage={"replicas": 0}), namespace)
        store = wait_for(lambda: _policy(kube, namespace, "guarded-store-ingress"), 60, "the store policy")
        (owner,) = store["metadata"]["ownerReferences"]
        assert owner["kind"] == "KVPool" and owner["uid"] == pool["metadata"]["uid"]
        assert store["spec"]["policyTypes"] == ["Ingress"]
        assert _tenant_namespaces(store) == []  # no tenant yet: only the nodes and the operator

        # A TenantNamespace binding the pool: its namespace is admitted.
        create(kube, {"apiVersion": API, "kind": "TenantNamespace", "metadata": {"name": tenants[0]},
                      "spec": {"tenantId": tenants[0], "namespaces": [extra[0]],
                               "pools": [{"pool": f"{namespace}.guarded"}]}})
        wait_for(lambda: _tenant_namespaces(_policy(kube, namespace, "guarded-store-ingress") or store) == [extra[0]],
                 60, "the first tenant's namespace in the policy")
        # A second one: the same policy, updated in place.
        create(kube, {"apiVersion": API, "kind": "TenantNamespace", "metadata": {"name": tenants[1]},
                      "spec": {"tenantId": tenants[1], "namespaces": [extra[1]],
                               "pools": [{"pool": f"{namespace}.guarded"}]}})
        def with_both() -> dict[str, Any] | None:
            p = _policy(kube, namespace, "guarded-store-ingress")
            return p if p is not None and _tenant_namespaces(p) == sorted(extra) else None

        updated = wait_for(with_both, 60, "both tenants in the policy")
        assert updated["metadata"]["uid"] == store["metadata"]["uid"]
        st = wait_for(lambda: (kube.get(API, "KVPool", "guarded", namespace) or {}).get("status", {}).get(
            "networkPolicies"), 30, "status.networkPolicies")
        assert st == ["guarded-store-ingress"]

        # The router, open to what the pool names: its own policy, admitted with those peers.
        named = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": extra[1]}},
                  "podSelector": {"matchLabels": {"app": "router"}}}]
        kube.merge_patch(API, "KVPool", "guarded", namespace, {"spec": {"router": {"enabled": True,
                                                                                   "allowedFrom": named}}})
        router = wait_for(lambda: _policy(kube, namespace, "guarded-router-ingress"), 60, "the router policy")
        assert router["spec"]["ingress"][0]["from"] == named
        kube.merge_patch(API, "KVPool", "guarded", namespace, {"spec": {"router": {"enabled": False}}})
        wait_for(lambda: _policy(kube, namespace, "guarded-router-ingress") is None, 60, "the router policy gone")

        # Deleted by hand: put back (drift repair).
        kube.delete(NP, "NetworkPolicy", "guarded-store-ingress", namespace)
        back = wait_for(lambda: _policy(kube, namespace, "guarded-store-ingress"), 60, "the store policy back")
        assert _tenant_namespaces(back) == sorted(extra)

        # A tenant leaving: its namespace goes from the policy.
        kube.delete(API, "TenantNamespace", tenants[1])
        wait_for(lambda: _tenant_namespaces(_policy(kube, namespace, "guarded-store-ingress") or back) == [extra[0]],
                 60, "the second tenant's namespace gone from the policy")
    finally:
        for tn in tenants:
            kube.delete(API, "TenantNamespace", tn)
        for ns in extra:
            kube.delete("v1", "Namespace", ns)
