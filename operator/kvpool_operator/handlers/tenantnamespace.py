"""kopf handlers of TenantNamespace: Secrets and status; the pools it names re-reconcile when
credentials change, and on deletion (which revokes the tenant's token at their nodes)."""

from __future__ import annotations

from typing import Any

import kopf

from .. import pools, tenants
from ..kube import KubeError
from ..model import GROUP, VERSION
from ..runtime import Runtime


def register(registry: Any, rt: Runtime) -> None:
    def repool(keys: list[tuple[str, str]]) -> None:
        for ns, name in keys:
            pools.reconcile(rt, ns, name)

    def run(name: str | None, body: Any) -> None:
        if not name:
            return
        try:
            touched = tenants.reconcile(rt, name)
            repool([(k.partition(".")[0], k.partition(".")[2]) for k in touched])
        except KubeError as exc:
            raise kopf.TemporaryError(f"Kubernetes API: {exc}", delay=2 if exc.conflict else 5) from exc

    @kopf.on.resume(GROUP, VERSION, "tenantnamespaces", registry=registry, id="changed")
    @kopf.on.create(GROUP, VERSION, "tenantnamespaces", registry=registry, id="changed")
    @kopf.on.update(GROUP, VERSION, "tenantnamespaces", registry=registry, id="changed")
    def changed(name: str | None, body: Any, old: Any = None, **_: Any) -> None:
        run(name, body)
        if old:  # pools dropped from the list lose this tenant
            repool([r for r in tenants.pools_listed(old) if r not in tenants.pools_listed(body)])

    @kopf.timer(GROUP, VERSION, "tenantnamespaces", interval=rt.settings.tenant_interval_seconds, id="tick",
                initial_delay=rt.settings.tenant_interval_seconds / 2, registry=registry)
    def tick(name: str | None, body: Any, **_: Any) -> None:
        run(name, body)

    @kopf.on.delete(GROUP, VERSION, "tenantnamespaces", registry=registry, id="deleted")
    def deleted(body: Any, **_: Any) -> None:
        # The object is still there with a deletionTimestamp: pool reconciles leave it out, so
        # SetTenants(replace) revokes its token. Its Secrets go with it (ownerReferences).
        try:
            repool(tenants.pools_listed(body))
        except KubeError as exc:
            raise kopf.TemporaryError(f"Kubernetes API: {exc}", delay=5) from exc
