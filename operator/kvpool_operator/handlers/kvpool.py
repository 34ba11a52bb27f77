"""kopf handlers of KVPool: every cause (create, update, resume, timer, a store pod or the
StatefulSet changing) asks for the same idempotent reconcile (kvpool_operator.pools)."""

from __future__ import annotations

from typing import Any

import kopf

from .. import metrics, pool_tls, pools
from ..kube import KubeError
from ..model import GROUP, STORE_POOL_LABEL, VERSION
from ..runtime import Runtime


def register(registry: Any, rt: Runtime) -> None:
    def run(namespace: str | None, name: str | None) -> None:
        if not namespace or not name:
            return
        try:
            pools.reconcile(rt, namespace, name)
        except KubeError as exc:
            # Conflicts and API hiccups are not failures: re-read and retry shortly.
            raise kopf.TemporaryError(f"Kubernetes API: {exc}", delay=2 if exc.conflict else 5) from exc

    def repair(namespace: str | None, pool: str | None, type: str | None) -> None:
        # Drift repair of a child: an edit or a deletion re-reconciles its pool (not the listing, not an add).
        if type in ("MODIFIED", "DELETED"):
            run(namespace, pool)

    @kopf.on.resume(GROUP, VERSION, "kvpools", registry=registry, id="changed")
    @kopf.on.create(GROUP, VERSION, "kvpools", registry=registry, id="changed")
    @kopf.on.update(GROUP, VERSION, "kvpools", registry=registry, id="changed")
    def changed(namespace: str | None, name: str | None, **_: Any) -> None:
        run(namespace, name)

    @kopf.timer(GROUP, VERSION, "kvpools", interval=rt.settings.reconcile_interval_seconds, registry=registry,
                id="tick", initial_delay=rt.settings.reconcile_interval_seconds / 2)
    def tick(namespace: str | None, name: str | None, **_: Any) -> None:
        run(namespace, name)

    @kopf.on.delete(GROUP, VERSION, "kvpools", registry=registry, id="deleted", optional=True)
    def deleted(body: Any, **_: Any) -> None:
        metrics.POOLS.dec()
        pool_tls.forget_pool(rt.kube if rt.settings.tls else None, body)
        # Children go with the pool (ownerReferences); nothing to undo at the nodes.

    @kopf.on.create(GROUP, VERSION, "kvpools", registry=registry, id="count")
    @kopf.on.resume(GROUP, VERSION, "kvpools", registry=registry, id="count")
    def counted(**_: Any) -> None:
        metrics.POOLS.inc()

    # A store pod becoming ready (or going away) changes the ring: do not wait for the timer.
    @kopf.on.event("v1", "pods", labels={STORE_POOL_LABEL: kopf.PRESENT}, registry=registry, id="store_pod")
    def store_pod(namespace: str | None, labels: Any, type: str | None, **_: Any) -> None:
        if type is not None:  # None: the initial listing, which the resume handlers cover
            run(namespace, labels.get(STORE_POOL_LABEL))

    # Drift repair: someone edited or deleted a child StatefulSet.
    @kopf.on.event("apps", "v1", "statefulsets", labels={STORE_POOL_LABEL: kopf.PRESENT}, registry=registry,
                   id="store_set")
    def store_set(namespace: str | None, labels: Any, type: str | None, **_: Any) -> None:
        repair(namespace, labels.get(STORE_POOL_LABEL), type)

    if rt.settings.network_policy:
        # Drift repair: someone edited or deleted one of a pool's NetworkPolicies (TenantNamespace
        # changes re-reconcile the pools they name, see handlers.tenantnamespace).
        @kopf.on.event("networking.k8s.io", "v1", "networkpolicies", registry=registry, id="network_policy",
                       labels={"app.kubernetes.io/managed-by": "kvpool-operator",
                               "app.kubernetes.io/instance": kopf.PRESENT})
        def network_policy(namespace: str | None, labels: Any, type: str | None, **_: Any) -> None:
            repair(namespace, labels.get("app.kubernetes.io/instance"), type)
