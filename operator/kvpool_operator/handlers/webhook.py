"""The mutating admission webhook that injects sidecars (kopf admission).

Every replica answers, the active one and the standbys alike (the webhook Service sends each
pod to any of them), so the webhook decides from what the API server says at admission time:
the KVPool the pod's label names and the TenantNamespaces that list the pod's namespace, read
then.  Not from kopf indexes: kopf fills them from its watches, and a standby replica (paused by
peering) watches nothing, so its indexes are empty, or stale from when it was last active; a
standby then refused every pod as NoSuchPool.  Fails open: an error here admits the pod
unchanged (and says why in its annotation)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import kopf

from .. import metrics
from ..injection import PoolView, plan_injection, pool_view_from_body
from ..kube import Kube, KubeError, path
from ..model import API_VERSION, POOL_LABEL, SKIP_ANNOTATION, SpecError, TenantSpec, parse_pool_ref, parse_tenant
from ..runtime import Runtime

log = logging.getLogger("kvpool.operator.webhook")
READ_TIMEOUT_SECONDS = 2.0
"""Per API read at admission: two reads stay within the webhook's own timeout (5 s by default),
so a slow API server turns into an InternalError annotation, not a timed-out admission."""


def admission_pools(kube: Kube, ref: tuple[str, str] | None) -> dict[tuple[str, str], PoolView]:
    """The pool a pod's label names, as ``plan_injection`` takes pools: {} when there is none
    (or the operator may not read it: a pool outside its watched namespaces is no pool of its)."""
    if ref is None:
        return {}
    try:
        body = kube.request("GET", path(API_VERSION, "KVPool", ref[0], ref[1]),
                            timeout=READ_TIMEOUT_SECONDS)
    except KubeError as exc:
        if exc.status in (403, 404):
            return {}
        raise
    try:
        return {ref: pool_view_from_body(body)}
    except SpecError:
        return {}


def tenant_bindings(items: list[dict[str, Any]], namespace: str) -> list[TenantSpec]:
    """The TenantNamespaces (API objects) that list ``namespace``; deleted and malformed ones
    bind nothing."""
    out = []
    for body in items:
        if (body.get("metadata") or {}).get("deletionTimestamp"):
            continue
        try:
            tn = parse_tenant(body)
        except SpecError:
            continue
        if namespace in tn.namespaces:
            out.append(tn)
    return out


def admission_bindings(kube: Kube, namespace: str) -> list[TenantSpec]:
    doc = kube.request("GET", path(API_VERSION, "TenantNamespace"), timeout=READ_TIMEOUT_SECONDS)
    return tenant_bindings(list(doc.get("items") or []), namespace)


def register(registry: Any, rt: Runtime) -> None:
    @kopf.on.mutate("v1", "pods", id="kvpool-inject", operations=["CREATE"], labels={POOL_LABEL: kopf.PRESENT},
                    ignore_failures=True, side_effects=False, registry=registry)
    def inject(**kw: Any) -> None:
        body, patch, dryrun = kw["body"], kw["patch"], bool(kw.get("dryrun"))
        ns = str((body.get("metadata") or {}).get("namespace") or kw.get("namespace") or "default")
        try:
            labels = (body.get("metadata") or {}).get("labels") or {}
            pools = admission_pools(rt.kube, parse_pool_ref(str(labels.get(POOL_LABEL, "")), ns))
            result = plan_injection(body, ns, pools, admission_bindings(rt.kube, ns), rt.settings)
        except Exception as exc:  # fail open: the pod runs without the pool
            log.exception("injection failed for a pod in %s", ns)
            metrics.INJECTIONS.labels("InternalError").inc()
            patch.setdefault("metadata", {}).setdefault("annotations", {})[SKIP_ANNOTATION] = \
                f"InternalError: {type(exc).__name__}"
            return
        if not dryrun:
            metrics.INJECTIONS.labels(result.reason).inc()
        _merge(patch, result.patch)


def _merge(patch: Any, doc: Mapping[str, Any]) -> None:
    for k, v in doc.items():
        if isinstance(v, Mapping) and k == "metadata":
            patch.setdefault(k, {})
            _merge(patch[k], v)
        else:
            patch[k] = v
