"""Test helpers (like kvpool.transfer.testing): custom-resource bodies and the merge-patch rule
the API server applies to a webhook's patch. Pure; used by the unit and the e2e tests."""

from __future__ import annotations

import copy
from typing import Any


def pool_body(name: str = "p", namespace: str = "ns", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"apiVersion": "kvpool.io/v1alpha1", "kind": "KVPool",
                            "metadata": {"name": name, "namespace": namespace, "uid": "uid-1", "generation": 1},
                            "spec": copy.deepcopy(spec)}
    return body


def tier_body(name: str, medium: str = "dram", **spec: Any) -> dict[str, Any]:
    s: dict[str, Any] = {"medium": medium, "capacity": {"bytes": "1Gi"}}
    s.update(spec)
    return {"apiVersion": "kvpool.io/v1alpha1", "kind": "KVTier", "metadata": {"name": name}, "spec": s}


def tenant_body(name: str, tenant_id: str, namespaces: list[str], pools: list[dict[str, Any]] | None = None
                ) -> dict[str, Any]:
    return {"apiVersion": "kvpool.io/v1alpha1", "kind": "TenantNamespace",
            "metadata": {"name": name, "uid": f"uid-{name}", "generation": 1},
            "spec": {"tenantId": tenant_id, "namespaces": namespaces, "pools": pools or []}}


def apply_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 merge patch, as the API server applies kopf's patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = apply_merge_patch(out.get(k), v)
    return out
