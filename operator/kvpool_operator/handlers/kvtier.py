"""kopf handlers of KVTier: validate it, list the pools using it, re-reconcile them on change.

The tier's ``status.pools`` is a view of other objects (the KVPools naming the tier), so it is
written from three places: the tier's own handlers, every KVPool create/update/delete (a new
pool must show up on its tiers at once, not when the tier next changes), and a timer that
repairs anything missed (a pool edited while the operator was down).
"""

from __future__ import annotations

import time
from typing import Any

import kopf

from .. import pools
from ..kube import KubeError
from ..model import API_VERSION, GROUP, VERSION, SpecError, parse_pool, parse_tier
from ..runtime import Runtime
from ..status import Condition, merge_conditions
from ..units import format_time


def users(rt: Runtime, tier: str) -> list[tuple[str, str]]:
    out = []
    for body in rt.kube.list(API_VERSION, "KVPool"):
        if (body.get("metadata") or {}).get("deletionTimestamp"):
            continue
        try:
            p = parse_pool(body)
        except SpecError:
            continue
        if tier in p.tiers:
            out.append((p.namespace, p.name))
    return sorted(out)


def tier_status(body: Any, using: list[tuple[str, str]], now: str) -> dict[str, Any]:
    """The tier's status for the pools ``using`` it (pure)."""
    try:
        parse_tier(body)
        cond = Condition("Valid", True, "Valid", "the tier is usable")
    except SpecError as err:
        cond = Condition("Valid", False, err.reason, err.message)
    st = body.get("status") or {}
    conds, _events = merge_conditions(st.get("conditions"), [cond], now)
    return {"pools": [f"{ns}.{p}" for ns, p in using], "poolCount": len(using), "conditions": conds,
            "observedGeneration": int((body.get("metadata") or {}).get("generation", 0))}


def _same(old: dict[str, Any], new: dict[str, Any]) -> bool:
    def strip(conds: Any) -> list[Any]:
        return [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in conds or ()]
    return (old.get("pools") == new["pools"] and old.get("observedGeneration") == new["observedGeneration"]
            and strip(old.get("conditions")) == strip(new["conditions"]))


def publish(rt: Runtime, name: str, body: Any = None) -> list[tuple[str, str]]:
    """Write the tier's status when it changed; returns the pools using the tier."""
    if body is None:
        body = rt.kube.get(API_VERSION, "KVTier", name)
    using = users(rt, name)
    if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
        return using
    now = format_time(int(time.time() * 1000))
    new = tier_status(body, using, now)
    if not _same(body.get("status") or {}, new):
        rt.kube.merge_patch(API_VERSION, "KVTier", name, None, {"status": new}, "status")
    return using


def register(registry: Any, rt: Runtime) -> None:
    @kopf.on.resume(GROUP, VERSION, "kvtiers", registry=registry, id="changed")
    @kopf.on.create(GROUP, VERSION, "kvtiers", registry=registry, id="changed")
    @kopf.on.update(GROUP, VERSION, "kvtiers", registry=registry, id="changed")
    @kopf.on.delete(GROUP, VERSION, "kvtiers", registry=registry, id="changed", optional=True)
    def changed(name: str | None, body: Any, reason: Any = None, **_: Any) -> None:
        if not name:
            return
        try:
            for ns, pool in users(rt, name):
                pools.reconcile(rt, ns, pool)  # a tier change (or deletion) re-reconciles its pools
            if str(reason) != "delete":
                publish(rt, name, body)
        except KubeError as exc:
            raise kopf.TemporaryError(f"Kubernetes API: {exc}", delay=5) from exc

    @kopf.timer(GROUP, VERSION, "kvtiers", interval=rt.settings.reconcile_interval_seconds * 3, registry=registry,
                id="tick", initial_delay=rt.settings.reconcile_interval_seconds)
    def tick(name: str | None, **_: Any) -> None:
        if name:
            try:
                publish(rt, name)
            except KubeError as exc:
                raise kopf.TemporaryError(f"Kubernetes API: {exc}", delay=5) from exc

    # A pool naming tiers changes what those tiers list.
    @kopf.on.create(GROUP, VERSION, "kvpools", registry=registry, id="tiers")
    @kopf.on.update(GROUP, VERSION, "kvpools", registry=registry, id="tiers")
    @kopf.on.delete(GROUP, VERSION, "kvpools", registry=registry, id="tiers", optional=True)
    def pool_tiers(old: Any, new: Any, body: Any, **_: Any) -> None:
        names: set[str] = set()
        for b in (old, new, body):
            tiers = ((b or {}).get("spec") or {}).get("storage", {}).get("tiers") or []
            names.update(t for t in tiers if isinstance(t, str))
        try:
            for t in sorted(names):
                publish(rt, t)
        except KubeError as exc:
            raise kopf.TemporaryError(f"Kubernetes API: {exc}", delay=5) from exc
