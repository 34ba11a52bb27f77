"""The edge of a KVPool reconcile: observe (Kubernetes + store nodes), plan, act.

Everything decided here comes from :func:`kvpool_operator.reconcile.plan_pool`; this module only
gathers its inputs and applies its output, in the order that keeps a half-applied plan safe:
ring to the nodes → drain and warm-up calls → policy and tenants → children (so the StatefulSet shrinks only
after the ring no longer names the leaving nodes) → status → Events.
"""

from __future__ import annotations

import base64
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvpool.core.push_status import DrainStatus, WarmStatus

from . import children, metrics
from .drain import DrainState
from .encryption import master_key_problem
from .kube import Kube
from .membership import StorePod, observe_pods
from .model import (
    API_VERSION,
    PoolSpec,
    SpecError,
    TenantSpec,
    TierSpec,
    parse_pool,
    parse_tenant,
    parse_tier,
    secret_name,
    wants_encryption,
)
from .nodes import NodeUnreachable
from .pool_tls import cert_policy, pool_tls_or_problem
from .rebalance import RebalanceState
from .reconcile import PoolObserved, PoolPlan, plan_pool
from .runtime import Runtime
from .status import NodeStats
from .tenancy import Credentials, credentials_from_secret, new_admin_token
from .units import format_time

log = logging.getLogger("kvpool.operator.pools")
T = TypeVar("T")


def _now() -> tuple[int, str]:
    ms = int(time.time() * 1000)
    return ms, format_time(ms)


def admin_token(kube: Kube, pool_body: Mapping[str, Any]) -> str:
    """The pool's admin token, minting its Secret on first use (never re-minted: nodes hold it)."""
    pool = parse_pool(pool_body)
    name = children.admin_secret_name(pool)
    sec = kube.get("v1", "Secret", name, pool.namespace)
    if sec is None:
        kube.create(children.admin_secret(pool, new_admin_token()))
        sec = kube.get("v1", "Secret", name, pool.namespace)
    raw = ((sec or {}).get("data") or {}).get(children.ADMIN_KEY)
    if not raw:
        raise RuntimeError(f"Secret {pool.namespace}/{name} has no {children.ADMIN_KEY}")
    return base64.b64decode(raw).decode()


def ensure_master_key(kube: Kube, pool: PoolSpec, tiers: Mapping[str, TierSpec | SpecError]) -> tuple[str, str] | None:
    """Mint the pool's master-key Secret on first need (never re-minted: sealed files need it).
    A Secret the user named is the user's: it is mounted, never created.  Returns why the Secret
    cannot be used (None: it can, or encryption at rest is off)."""
    if not wants_encryption(pool, {k: t for k, t in tiers.items() if isinstance(t, TierSpec)}):
        return None
    name = children.master_key_secret_name(pool)
    secret = kube.get("v1", "Secret", name, pool.namespace)
    if secret is None and not pool.encryption_secret:
        # None: another reconcile created it first; read that one.
        secret = (kube.create(children.master_key_secret(pool, secrets.token_urlsafe(32)))
                  or kube.get("v1", "Secret", name, pool.namespace))
    return master_key_problem(secret, name, pool.namespace)


def _parallel(items: list[T], fn: Callable[[T], Any]) -> list[Any]:
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(items)), thread_name_prefix="nodes") as ex:
        return list(ex.map(fn, items))


def tenants_of(kube: Kube, pool_key: str) -> list[tuple[TenantSpec, Credentials]]:
    """TenantNamespaces (not being deleted) listing the pool, with their credentials."""
    out = []
    for body in kube.list(API_VERSION, "TenantNamespace"):
        if (body.get("metadata") or {}).get("deletionTimestamp"):
            continue  # its token is revoked by leaving it out (SetTenants replace)
        try:
            tn = parse_tenant(body)
        except SpecError:
            continue
        if tn.pool(pool_key) is None:
            continue
        for ns in tn.namespaces:
            sec = kube.get("v1", "Secret", secret_name(tn.tenant_id), ns)
            creds = credentials_from_secret(sec, tn.tenant_id) if sec else None
            if creds is not None:
                out.append((tn, creds))
                break
    return out


def observe(rt: Runtime, body: Mapping[str, Any]) -> tuple[PoolObserved, str, dict[str, StorePod]]:
    kube, nodes = rt.kube, rt.nodes
    now_ms, now_iso = _now()
    try:
        pool = parse_pool(body)
    except SpecError:
        return PoolObserved(body=body, now_ms=now_ms, now_iso=now_iso), "", {}
    tiers: dict[str, TierSpec | SpecError] = {}
    for name in pool.tiers:
        tb = kube.get(API_VERSION, "KVTier", name)
        if tb is not None:
            try:
                tiers[name] = parse_tier(tb)
            except SpecError as err:
                tiers[name] = err
    token = admin_token(kube, body)
    key_problem = ensure_master_key(kube, pool, tiers)
    pods = observe_pods(kube.list("v1", "Pod", pool.namespace, children.selector_string(pool)))
    usable = {p.name: p for p in pods if p.usable}
    tls_problem = None
    if rt.settings.tls:
        # Before any admin call: the nodes take them only from the operator's certificate.
        cfg, tls_problem = pool_tls_or_problem(kube, pool, rt.settings.tls_dir, cert_policy(rt.settings), body=body)
        if cfg is not None:
            nodes.use_tls((f"{p.ip}:{pool.port}" for p in usable.values()), cfg)
    sts = kube.get("apps/v1", "StatefulSet", children.store_name(pool), pool.namespace)
    sts_replicas = None if sts is None else int((sts.get("spec") or {}).get("replicas", 0))
    sst = (sts or {}).get("status") or {}
    updating = bool(sst) and sst.get("currentRevision") != sst.get("updateRevision")

    def stats(p: StorePod) -> NodeStats | None:
        try:
            return nodes.stats(f"{p.ip}:{pool.port}", token)
        except NodeUnreachable as exc:
            log.info("%s", exc)
            return None

    got = _parallel(list(usable.values()), stats)
    state = DrainState.from_status((body.get("status") or {}).get("drain"))
    drains: dict[str, DrainStatus | None] = {}
    for node in state.leaving if state else ():
        p = usable.get(node)
        if p is None:
            continue
        try:
            drains[node] = nodes.drain_status(f"{p.ip}:{pool.port}", token)
        except NodeUnreachable:
            drains[node] = None
    rb = RebalanceState.from_status((body.get("status") or {}).get("rebalance"))
    warms: dict[str, WarmStatus | None] = {}
    for node in rb.sources if rb else ():
        p = usable.get(node)
        if p is None:
            continue
        try:
            warms[node] = nodes.warm_status(f"{p.ip}:{pool.port}", token)
        except NodeUnreachable:
            warms[node] = None
    return PoolObserved(
        body=body, tiers=tiers, pods=pods, sts_replicas=sts_replicas, sts_updating=updating,
        sts_claims=None if sts is None else list((sts.get("spec") or {}).get("volumeClaimTemplates") or []),
        stats=dict(zip(usable, got, strict=True)), drain_statuses=drains, warm_statuses=warms,
        tenants=tenants_of(kube, pool.key),
        now_ms=now_ms, now_iso=now_iso, master_key_problem=key_problem, tls_problem=tls_problem), token, usable


def act(rt: Runtime, body: Mapping[str, Any], plan: PoolPlan, token: str) -> None:
    kube, nodes = rt.kube, rt.nodes
    ring = plan.ring

    def guarded(what: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except NodeUnreachable as exc:
            # The next reconcile retries: nodes are told from the plan, which is recomputed.
            log.warning("%s: %s", what, exc)

    if ring is not None:
        for m in plan.push_ring:
            guarded("SetRing", lambda m=m: nodes.set_ring(m.address, token, ring))  # type: ignore[misc]
        rate = plan.pool.drain_bytes_per_second if plan.pool else 0
        for m in plan.drain_calls:
            guarded("Drain", lambda m=m: nodes.drain(m.address, token, ring, plan.drain_deadline_ms,  # type: ignore[misc]
                                                     rate))
        rb, warm = plan.rebalance, plan.warm
        if rb is not None:
            added, removed, deadline = rb.added, rb.removed, rb.deadline_unix_ms
            # Restoring copies pushes every block that lost one, not the warm-up's hottest share.
            fraction = 0.0 if removed else warm.fraction
            for m in plan.warm_calls:
                guarded("Warm", lambda m=m: nodes.warm(m.address, token, ring, added,  # type: ignore[misc]
                                                       deadline, warm.bytes_per_second, fraction, removed))
        if plan.policy is not None:
            policy = plan.policy
            _parallel(list(plan.configure), lambda m: guarded(
                "configure", lambda: nodes.configure(m.address, token, policy, plan.tenants)))
        nodes.forget(m.address for m in ring.members)  # channels of departed nodes
    for child in plan.children:
        kube.apply(child)
    for api_version, kind, name in plan.prune:
        if plan.pool is not None:
            kube.delete(api_version, kind, name, plan.pool.namespace)  # 404 (never created) is fine
    meta = body.get("metadata") or {}
    kube.merge_patch(API_VERSION, "KVPool", meta["name"], meta.get("namespace"), {"status": plan.status}, "status")
    for ev in plan.events:
        try:
            kube.event(body, ev.type, ev.reason, ev.message)
        except Exception as exc:  # an Event is worth less than the reconcile that made it
            log.info("event %s not posted: %s", ev.reason, exc)
        if ev.reason in ("DrainStarted", "DrainCompleted", "DrainDeadlineExceeded", "DrainCancelled"):
            metrics.DRAINS.labels(ev.reason.removeprefix("Drain") or "Started").inc()
        if ev.reason == "UtilizationTooHigh":
            metrics.SCALE_DOWN_BLOCKED.inc()
        if ev.reason in ("RebalanceStarted", "RebalanceCompleted", "RebalanceDeadlineExceeded", "RebalanceCancelled"):
            metrics.REBALANCES.labels(ev.reason.removeprefix("Rebalance")).inc()
    last = plan.status.get("lastDrain")
    if last:
        metrics.DRAIN_MOVED_BYTES.inc(int(last.get("movedBytes", 0)))
        metrics.DRAIN_DROPPED_BYTES.inc(int(last.get("droppedBytes", 0)))


def reconcile(rt: Runtime, namespace: str, name: str) -> PoolPlan | None:
    """Observe, plan and act for one pool (serialised per pool). None when the pool is gone."""
    result: list[PoolPlan] = []

    def once() -> None:
        body = rt.kube.get(API_VERSION, "KVPool", name, namespace)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return
        started = time.monotonic()
        try:
            obs, token, _ = observe(rt, body)
            plan = plan_pool(obs, rt.settings)
            act(rt, body, plan, token)
        except Exception as exc:
            metrics.ERRORS.labels("KVPool", type(exc).__name__).inc()
            metrics.RECONCILES.labels("KVPool", "error").inc()
            raise
        finally:
            metrics.RECONCILE_SECONDS.labels("KVPool").observe(time.monotonic() - started)
        metrics.RECONCILES.labels("KVPool", "failed" if plan.spec_error else "ok").inc()
        result.append(plan)

    rt.pools.run(f"{namespace}/{name}", once)
    return result[-1] if result else None
