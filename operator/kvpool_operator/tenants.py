"""The edge of a TenantNamespace reconcile: its Secrets, its status, and telling the pools.

Decisions come from :mod:`kvpool_operator.tenancy`; this module reads and writes the objects.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from . import metrics
from .drain import Event
from .kube import Kube, KubeError
from .model import API_VERSION, SpecError, TenantSpec, parse_pool_ref, parse_tenant
from .pool_tls import cert_policy, ensure_tenant_tls, prune_tenant_tls
from .runtime import Runtime
from .status import Condition, merge_conditions
from .tenancy import OWNER_LABEL, choose_credentials, new_credentials, plan_secrets, tenant_pool_status, tenant_secret
from .units import format_time

log = logging.getLogger("kvpool.operator.tenants")


def _now_iso() -> str:
    return format_time(int(time.time() * 1000))


def _conflicts(kube: Kube, tn: TenantSpec) -> list[str]:
    """Namespaces this TenantNamespace shares with another tenant's."""
    mine = set(tn.namespaces)
    out = set()
    for body in kube.list(API_VERSION, "TenantNamespace"):
        try:
            other = parse_tenant(body)
        except SpecError:
            continue
        if other.name != tn.name and other.tenant_id != tn.tenant_id:
            out |= mine & set(other.namespaces)
    return sorted(out)


def reconcile(rt: Runtime, name: str) -> list[str]:
    """Secrets and status of one TenantNamespace; returns the pools (namespace.name) to re-reconcile
    because what their nodes must know changed."""
    touched: list[str] = []

    def once() -> None:
        kube = rt.kube
        body = kube.get(API_VERSION, "TenantNamespace", name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return
        st = body.get("status") or {}
        generation = int((body.get("metadata") or {}).get("generation", 0))
        try:
            tn = parse_tenant(body)
        except SpecError as err:
            conds, events = merge_conditions(st.get("conditions"), [Condition("Ready", False, err.reason, err.message)],
                                             _now_iso(), generation)
            _write(kube, body, {"conditions": conds}, events)
            metrics.RECONCILES.labels("TenantNamespace", "failed").inc()
            return
        # Where our Secrets are: every listed namespace, and where status says we put them before.
        existing: dict[str, Mapping[str, Any]] = {}
        for ns in sorted(set(tn.namespaces) | set(st.get("secrets") or [])):
            sec = kube.get("v1", "Secret", tn.secret_name, ns)
            if sec is not None and ((sec.get("metadata") or {}).get("labels") or {}).get(OWNER_LABEL) == tn.name:
                existing[ns] = sec
        creds = choose_credentials(tn.tenant_id, existing.values())
        minted = creds is None
        if creds is None:
            creds = new_credentials(tn.tenant_id)
        plan = plan_secrets(tn, existing, creds)
        missing = []
        for ns in plan.apply:
            try:
                kube.apply(tenant_secret(tn, ns, creds))
            except KubeError as exc:
                if exc.status != 404:
                    raise
                missing.append(ns)  # the namespace does not exist (yet)
        for ns in plan.delete:
            kube.delete("v1", "Secret", tn.secret_name, ns)
        if minted or plan.apply or plan.delete:
            touched.extend(p.key for p in tn.pools)
        if rt.settings.tls:
            for p in tn.pools:
                missing += [ns for ns in ensure_tenant_tls(kube, tn, p.namespace, p.name, cert_policy(rt.settings))
                            if ns not in missing]
            prune_tenant_tls(kube, tn, st.get("secrets") or [],
                             [str(row.get("pool", "")) for row in st.get("pools") or [] if row.get("pool")])
        pool_statuses: dict[str, Mapping[str, Any] | None] = {}
        for p in tn.pools:
            pb = kube.get(API_VERSION, "KVPool", p.name, p.namespace)
            pool_statuses[p.key] = (pb or {}).get("status")
        conflicts = _conflicts(kube, tn)
        unknown = [p.key for p in tn.pools if pool_statuses.get(p.key) is None]
        if conflicts:
            ready = Condition("Ready", False, "NamespaceConflict",
                              f"namespaces also bound to another tenant: {', '.join(conflicts)}")
        elif missing:
            ready = Condition("Ready", False, "NamespaceNotFound", f"namespaces not found: {', '.join(missing)}")
        else:
            ready = Condition("Ready", True, "SecretsReady",
                              f"credentials in {len(tn.namespaces)} namespace(s)"
                              + (f"; pools not found yet: {', '.join(unknown)}" if unknown else ""))
        conds, events = merge_conditions(st.get("conditions"), [ready], _now_iso(), generation)
        holding = sorted(ns for ns in tn.namespaces if ns not in missing)
        _write(kube, body, {"observedGeneration": generation, "conditions": conds, "secretName": tn.secret_name,
                            "secrets": holding, "poolCount": len(tn.pools),
                            "pools": tenant_pool_status(tn, pool_statuses)}, events)
        metrics.RECONCILES.labels("TenantNamespace", "ok").inc()

    started = time.monotonic()
    try:
        rt.tenants.run(name, once)
    except Exception as exc:
        metrics.ERRORS.labels("TenantNamespace", type(exc).__name__).inc()
        raise
    finally:
        metrics.RECONCILE_SECONDS.labels("TenantNamespace").observe(time.monotonic() - started)
    return touched


def _write(kube: Kube, body: Mapping[str, Any], status: Mapping[str, Any], events: list[Event]) -> None:
    name = (body.get("metadata") or {})["name"]
    kube.merge_patch(API_VERSION, "TenantNamespace", name, None, {"status": dict(status)}, "status")
    for ev in events:
        try:
            kube.event(body, ev.type, ev.reason, ev.message)
        except KubeError as exc:
            log.info("event %s not posted: %s", ev.reason, exc)


def pools_listed(body: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(namespace, name) of the pools a TenantNamespace body lists, even when the rest is invalid."""
    out = []
    for p in ((body.get("spec") or {}).get("pools") or []):
        ref = parse_pool_ref(str(p.get("pool", "")), None)
        if ref is not None:
            out.append(ref)
    return out
