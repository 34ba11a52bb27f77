"""The mutating admission webhook that injects sidecars (kopf admission), and the indexes it
reads. Stateless: every replica keeps the same indexes from its own watches, so any replica may
answer. Fails open: an error here admits the pod unchanged (and says why in its annotation)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import kopf

from .. import metrics
from ..injection import PoolView, plan_injection, pool_view_from_body
from ..model import GROUP, POOL_LABEL, SKIP_ANNOTATION, VERSION, SpecError, TenantSpec, parse_tenant
from ..runtime import Runtime

log = logging.getLogger("kvpool.operator.webhook")


def _first(index: Any) -> dict[Any, Any]:
    """kopf indexes map a key to a store of values (one per object); take one each."""
    out = {}
    for k, store in (index or {}).items():
        for v in store:
            out[k] = v
            break
    return out


def register_indexes(registry: Any, rt: Runtime) -> None:
    @kopf.index(GROUP, VERSION, "kvpools", id="kvpool_pools", registry=registry)
    def kvpool_pools(body: Any, namespace: str | None, name: str | None, **_: Any) -> dict[tuple[str, str], PoolView]:
        try:
            return {(str(namespace), str(name)): pool_view_from_body(body)}
        except SpecError:
            return {}

    @kopf.index(GROUP, VERSION, "tenantnamespaces", id="kvpool_tenants", registry=registry)
    def kvpool_tenants(body: Any, meta: Any, **_: Any) -> dict[str, TenantSpec]:
        if meta.get("deletionTimestamp"):
            return {}
        try:
            tn = parse_tenant(body)
        except SpecError:
            return {}
        return {ns: tn for ns in tn.namespaces}


def register(registry: Any, rt: Runtime) -> None:
    @kopf.on.mutate("v1", "pods", id="kvpool-inject", operations=["CREATE"], labels={POOL_LABEL: kopf.PRESENT},
                    ignore_failures=True, side_effects=False, registry=registry)
    def inject(**kw: Any) -> None:
        body, patch, dryrun = kw["body"], kw["patch"], bool(kw.get("dryrun"))
        kvpool_pools, kvpool_tenants = kw.get("kvpool_pools"), kw.get("kvpool_tenants")
        ns = str((body.get("metadata") or {}).get("namespace") or kw.get("namespace") or "default")
        try:
            bindings = list((kvpool_tenants or {}).get(ns, []))
            result = plan_injection(body, ns, _first(kvpool_pools), bindings, rt.settings)
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
