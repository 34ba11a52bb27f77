"""kopf handlers of KVTier: validate it, list the pools using it, re-reconcile them on change."""

from __future__ import annotations

import datetime as dt
from typing import Any

import kopf

from .. import pools
from ..kube import KubeError
from ..model import API_VERSION, GROUP, VERSION, SpecError, parse_pool, parse_tier
from ..runtime import Runtime
from ..status import Condition, merge_conditions


def users(rt: Runtime, tier: str) -> list[tuple[str, str]]:
    out = []
    for body in rt.kube.list(API_VERSION, "KVPool"):
        try:
            p = parse_pool(body)
        except SpecError:
            continue
        if tier in p.tiers:
            out.append((p.namespace, p.name))
    return sorted(out)


def register(registry: Any, rt: Runtime) -> None:
    @kopf.on.resume(GROUP, VERSION, "kvtiers", registry=registry, id="changed")
    @kopf.on.create(GROUP, VERSION, "kvtiers", registry=registry, id="changed")
    @kopf.on.update(GROUP, VERSION, "kvtiers", registry=registry, id="changed")
    @kopf.on.delete(GROUP, VERSION, "kvtiers", registry=registry, id="changed", optional=True)
    def changed(name: str | None, body: Any, reason: Any = None, **_: Any) -> None:
        if not name:
            return
        try:
            using = users(rt, name)
            for ns, pool in using:
                pools.reconcile(rt, ns, pool)  # a tier change (or deletion) re-reconciles its pools
            if str(reason) == "delete":
                return
            try:
                parse_tier(body)
                cond = Condition("Valid", True, "Valid", "the tier is usable")
            except SpecError as err:
                cond = Condition("Valid", False, err.reason, err.message)
            st = body.get("status") or {}
            now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            conds, _events = merge_conditions(st.get("conditions"), [cond], now)
            rt.kube.merge_patch(API_VERSION, "KVTier", name, None, {"status": {
                "pools": [f"{ns}.{p}" for ns, p in using], "poolCount": len(using), "conditions": conds,
                "observedGeneration": int(body.get("metadata", {}).get("generation", 0))}}, "status")
        except KubeError as exc:
            raise kopf.TemporaryError(f"Kubernetes API: {exc}", delay=5) from exc
