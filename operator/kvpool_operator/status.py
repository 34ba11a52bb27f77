"""A pool's status, readable by a person (STYLE 7): conditions with CamelCase reasons, a phase,
one sentence, capacity and block-weighted hit rate aggregated from the nodes' stats.

Pure. :func:`pool_conditions` derives the conditions from what a reconcile observed;
:func:`merge_conditions` keeps each condition's ``lastTransitionTime`` unless its status changed
and returns one Event per transition.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.store.quota import pool_usage
from kvpool.wire.counters import EVICTIONS, REFUSALS, total

from .drain import DrainState, Event
from .rebalance import RebalanceState
from .scaling import ScaleDecision
from .units import format_bytes, format_percent

CONDITION_TYPES = ("Ready", "Progressing", "Draining", "Degraded", "ScaleDownBlocked", "Rebalancing")


# ------------------------------------------------------------------------------- aggregation


@dataclass(frozen=True)
class TenantUsage:
    """A tenant's usage as one store node reports it (bytes and objects on that node; every
    replica counts there) or, out of :func:`aggregate`, as the pool's.

    Pool quota and pool usage are in one unit, logical bytes (``kvpool.store.quota``): an object
    counts once however many replicas the ring keeps, so ``used_bytes`` of the pool is the bytes
    on all nodes divided by the copies kept (min(R, nodes)), and ``physical_bytes`` the bytes on
    all nodes.  ``quota_bytes`` is the tenant's quota for the whole pool (each node reports it,
    and admits its share of it)."""

    tenant_id: str
    used_bytes: int = 0
    quota_bytes: int = 0
    objects: int = 0
    counters: Mapping[str, int] = field(default_factory=dict)
    physical_bytes: int = 0
    """Pool only: the bytes on all nodes (a node's report: its ``used_bytes``)."""


@dataclass(frozen=True)
class NodeStats:
    """A store node's Stats answer, without protobuf."""

    node_id: str
    epoch: int = 0
    capacity_bytes: int = 0
    used_bytes: int = 0
    hit_blocks: int = 0
    lookup_blocks: int = 0
    draining: bool = False
    tenants: tuple[TenantUsage, ...] = ()
    counters: Mapping[str, int] = field(default_factory=dict)
    foreign_bytes: int = 0
    """Of ``used_bytes``: objects the node holds but does not own under its ring (a warm-up's
    sources keep their copies; a draining node owns nothing)."""


@dataclass(frozen=True)
class PoolUsage:
    capacity_bytes: int = 0
    used_bytes: int = 0
    hit_blocks: int = 0
    lookup_blocks: int = 0
    tenants: Mapping[str, TenantUsage] = field(default_factory=dict)
    foreign_bytes: int = 0

    @property
    def owned_bytes(self) -> int:
        """What the pool must hold: every node's objects under the current ring, without the
        copies held by nodes that no longer own them (evictable, counted again at their owner).
        The autoscaler and the scale-down limit go by this, so a scale-up's warm-up is no new load."""
        return max(0, self.used_bytes - self.foreign_bytes)

    @property
    def utilization(self) -> float:
        return self.used_bytes / self.capacity_bytes if self.capacity_bytes else 0.0

    @property
    def hit_rate(self) -> float:
        """Block-weighted: every looked-up block counts once, whichever request asked for it."""
        return self.hit_blocks / self.lookup_blocks if self.lookup_blocks else 0.0


def aggregate(stats: Iterable[NodeStats], replicas: int = 1) -> PoolUsage:
    """The pool's usage from the nodes' reports; ``replicas``: the ring's replication (R).

    Capacity and ``used_bytes`` of the pool are physical (what the nodes hold: autoscaling and
    utilization).  A tenant's usage is in its quota's unit (:class:`TenantUsage`): the bytes on
    all nodes over the copies kept, min(R, nodes that answered), rounded up; its quota is the
    pool quota the nodes report (the largest, should one still have an older configuration)."""
    cap = used = hits = lookups = nodes = foreign = 0
    physical: dict[str, int] = {}
    objects: dict[str, int] = {}
    quotas: dict[str, int] = {}
    counters: dict[str, dict[str, int]] = {}
    for s in stats:
        nodes += 1
        cap += s.capacity_bytes
        used += s.used_bytes
        foreign += s.foreign_bytes
        hits += s.hit_blocks
        lookups += s.lookup_blocks
        for t in s.tenants:
            physical[t.tenant_id] = physical.get(t.tenant_id, 0) + t.used_bytes
            objects[t.tenant_id] = objects.get(t.tenant_id, 0) + t.objects
            quotas[t.tenant_id] = max(quotas.get(t.tenant_id, 0), t.quota_bytes)
            mine = counters.setdefault(t.tenant_id, {})
            for k, v in t.counters.items():
                mine[k] = mine.get(k, 0) + int(v)
    tenants = {tid: TenantUsage(tid, pool_usage(b, replicas, nodes), quotas[tid],
                                pool_usage(objects[tid], replicas, nodes), counters[tid], physical_bytes=b)
               for tid, b in physical.items()}
    return PoolUsage(cap, used, hits, lookups, tenants, foreign)


def tenant_status(u: TenantUsage) -> dict[str, Any]:
    return {"tenantId": u.tenant_id, "usedBytes": u.used_bytes, "physicalBytes": u.physical_bytes,
            "quotaBytes": u.quota_bytes, "objects": u.objects,
            "refusals": total(u.counters, REFUSALS),
            "evictions": total(u.counters, EVICTIONS)}


def usage_status(u: PoolUsage) -> dict[str, Any]:
    return {"capacityBytes": u.capacity_bytes, "usedBytes": u.used_bytes, "foreignBytes": u.foreign_bytes,
            "capacity": format_bytes(u.capacity_bytes), "used": format_bytes(u.used_bytes),
            "utilization": round(u.utilization, 4), "utilizationPercent": format_percent(u.utilization),
            "hitRate": round(u.hit_rate, 4), "hitRatePercent": format_percent(u.hit_rate),
            "tenants": [tenant_status(t) for _, t in sorted(u.tenants.items())]}


# -------------------------------------------------------------------------------- conditions


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool
    reason: str
    message: str

    def to_dict(self, now: str, generation: int = 0) -> dict[str, Any]:
        d: dict[str, Any] = {"type": self.type, "status": "True" if self.status else "False", "reason": self.reason,
                             "message": self.message, "lastTransitionTime": now}
        if generation:
            d["observedGeneration"] = generation
        return d


@dataclass(frozen=True)
class PoolObservation:
    """What one reconcile saw and decided."""

    desired: int
    pods: int = 0
    ready_pods: int = 0
    active_members: int = 0
    unreachable: Sequence[str] = ()
    spec_error: tuple[str, str] | None = None
    """(reason, message) of a SpecError."""
    decision: ScaleDecision | None = None
    drain: DrainState | None = None
    now_ms: int = 0
    updating: bool = False
    """The StatefulSet is rolling out a new template."""
    problem: tuple[str, str] | None = None
    """(reason, message) of a part of the spec that could not be applied (the rest was)."""
    rebalance: RebalanceState | None = None
    """The scale-up warm-up in progress."""


@dataclass(frozen=True)
class PoolStatusView:
    conditions: tuple[Condition, ...]
    phase: str
    message: str


def pool_conditions(o: PoolObservation) -> PoolStatusView:
    if o.spec_error is not None:
        reason, msg = o.spec_error
        conds = (Condition("Ready", o.active_members > 0, reason if not o.active_members else "NodesReady",
                           msg if not o.active_members else "the existing nodes keep serving"),
                 Condition("Progressing", False, reason, "waiting for the spec to be fixed"),
                 Condition("Draining", False, "NotDraining", "no scale-down in progress"),
                 Condition("Degraded", True, reason, msg),
                 Condition("ScaleDownBlocked", False, "NotBlocked", "no scale-down refused"),
                 Condition("Rebalancing", False, "Balanced", "no scale-up rebalance in progress"))
        return PoolStatusView(conds, "Failed", f"The pool cannot be reconciled: {msg}.")
    ready = o.desired > 0 and o.active_members >= o.desired
    if ready:
        c_ready = Condition("Ready", True, "NodesReady",
                            f"{o.active_members}/{o.desired} store nodes ready in the ring")
    elif o.desired == 0:
        c_ready = Condition("Ready", False, "NoNodes", "the pool has 0 store nodes")
    else:
        c_ready = Condition("Ready", False, "NodesNotReady",
                            f"{o.active_members}/{o.desired} store nodes ready in the ring")
    if o.drain is not None:
        c_prog = Condition("Progressing", True, "ScalingDown", f"scaling down to {o.drain.to_replicas} store nodes")
    elif o.decision is not None and o.decision.action == "up":
        c_prog = Condition("Progressing", True, "ScalingUp", o.decision.message)
    elif o.updating:
        c_prog = Condition("Progressing", True, "RollingUpdate", "store nodes are being updated")
    elif not ready and o.desired > 0:
        c_prog = Condition("Progressing", True, "NodesStarting", f"{o.ready_pods}/{o.desired} store pods ready")
    else:
        c_prog = Condition("Progressing", False, "Stable", "nothing to change")
    if o.drain is not None:
        c_drain = Condition("Draining", True, "ScaleDown", o.drain.progress_message(o.now_ms))
    else:
        c_drain = Condition("Draining", False, "NotDraining", "no scale-down in progress")
    if o.unreachable:
        c_deg = Condition("Degraded", True, "NodesUnreachable",
                          f"store nodes not answering admin calls: {', '.join(o.unreachable)}")
    elif o.problem is not None:
        c_deg = Condition("Degraded", True, o.problem[0], o.problem[1])
    else:
        c_deg = Condition("Degraded", False, "AsExpected", "all ready store nodes answer")
    if o.decision is not None and o.decision.action == "blocked":
        c_block = Condition("ScaleDownBlocked", True, o.decision.reason, o.decision.message)
    else:
        c_block = Condition("ScaleDownBlocked", False, "NotBlocked", "no scale-down refused")
    if o.rebalance is not None:
        c_rebal = Condition("Rebalancing", True, o.rebalance.reason, o.rebalance.progress_message(o.now_ms))
    else:
        c_rebal = Condition("Rebalancing", False, "Balanced", "no scale-up rebalance in progress")
    conds = (c_ready, c_prog, c_drain, c_deg, c_block, c_rebal)
    if c_drain.status:
        phase, msg = "Draining", c_drain.message
    elif c_block.status:
        phase, msg = "Blocked", c_block.message
    elif c_deg.status:
        phase, msg = "Degraded", c_deg.message
    elif c_rebal.status:
        phase, msg = "Rebalancing", c_rebal.message
    elif c_prog.status:
        phase, msg = "Progressing", c_prog.message
    elif ready:
        phase, msg = "Ready", c_ready.message
    else:
        phase, msg = "Pending", c_ready.message
    return PoolStatusView(conds, phase, _sentence(msg))


def _sentence(msg: str) -> str:
    msg = msg.strip()
    if not msg:
        return msg
    msg = msg[0].upper() + msg[1:]
    return msg if msg.endswith(".") else msg + "."


_WARN_WHEN_TRUE = {"Degraded", "ScaleDownBlocked"}
_WARN_WHEN_FALSE = {"Ready"}


def merge_conditions(old: Iterable[Mapping[str, Any]] | None, new: Iterable[Condition], now: str,
                     generation: int = 0, kind: str = "") -> tuple[list[dict[str, Any]], list[Event]]:
    """New conditions, keeping ``lastTransitionTime`` of unchanged statuses; one Event per change
    of status (the first observation of a condition is an event only when it is not the good state)."""
    before = {c.get("type"): c for c in old or ()}
    out: list[dict[str, Any]] = []
    events: list[Event] = []
    for c in new:
        d = c.to_dict(now, generation)
        prev = before.get(c.type)
        if prev is not None and prev.get("status") == d["status"]:
            d["lastTransitionTime"] = prev.get("lastTransitionTime", now)
            if prev.get("reason") != d["reason"] and c.status and c.type in _WARN_WHEN_TRUE:
                events.append(Event("Warning", c.reason, c.message))
        else:
            bad = (c.status and c.type in _WARN_WHEN_TRUE) or (not c.status and c.type in _WARN_WHEN_FALSE)
            # A new object starts not ready and not degraded: only say so when it is news.
            quiet = prev is None and (not c.status or c.type not in ("Ready", "Draining", *_WARN_WHEN_TRUE))
            if not quiet:
                events.append(Event("Warning" if bad else "Normal", c.reason,
                                    f"{kind + ' ' if kind else ''}{c.type}={d['status']}: {c.message}"))
        out.append(d)
    return out, events
