"""One KVPool reconcile as a pure function: what was observed → what to do (STYLE 1).

:func:`plan_pool` composes the planners (layout, scaling, drain, ring, status) into a
:class:`PoolPlan`; the handler observes (Kubernetes objects, node stats, drain progress), calls
it, and applies the plan in a fixed order: ring to the nodes, drain calls, children, status,
Events. Because every part of the plan is recomputed from status and observations, applying a
plan twice, or half of one before a crash, is harmless.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvpool.core.push_status import DrainStatus, WarmStatus
from kvpool.core.ring import Member, Ring

from . import children, drain, membership, netpolicy, rebalance, scaling, status
from .drain import DrainState, Event
from .membership import StorePod
from .model import (
    STORE_DEFAULT_TENANT,
    NodeLayout,
    PoolSpec,
    SpecError,
    TenantSpec,
    TierSpec,
    parse_pool,
    resolve_layout,
)
from .rebalance import RebalanceState, WarmSettings
from .settings import Settings
from .status import NodeStats, PoolObservation
from .tenancy import Credentials, NodeTenant, node_tenants
from .units import format_bytes, parse_bytes


@dataclass(frozen=True)
class PoolObserved:
    body: Mapping[str, Any]
    tiers: Mapping[str, TierSpec | SpecError] = field(default_factory=dict)
    pods: Sequence[StorePod] = ()
    sts_replicas: int | None = None
    """Replicas of the existing StatefulSet (None: not created yet)."""
    sts_updating: bool = False
    sts_claims: Sequence[Mapping[str, Any]] | None = None
    """volumeClaimTemplates of the existing StatefulSet (immutable there)."""
    stats: Mapping[str, NodeStats | None] = field(default_factory=dict)
    """Per usable pod: its Stats (None: it did not answer)."""
    drain_statuses: Mapping[str, DrainStatus | None] = field(default_factory=dict)
    warm_statuses: Mapping[str, WarmStatus | None] = field(default_factory=dict)
    """The rebalance sources' GetWarmStatus answers (None: no answer)."""
    tenants: Sequence[tuple[TenantSpec, Credentials]] = ()
    now_ms: int = 0
    now_iso: str = ""
    master_key_problem: tuple[str, str] | None = None
    """Why the pool's master-key Secret cannot be used (encryption at rest on), else None."""
    tls_problem: tuple[str, str] | None = None
    """Why the pool's certificates could not be made current (:func:`pool_tls.pool_tls_or_problem`)."""

    @property
    def start_problem(self) -> tuple[str, str] | None:
        """A Secret the store pods mount that is not usable: new store nodes would only wait or
        crash-loop, so the StatefulSet is created once it is."""
        return self.master_key_problem or self.tls_problem


@dataclass(frozen=True)
class Policy:
    ttl_seconds: Mapping[str, float]
    high_watermark: float
    low_watermark: float


@dataclass(frozen=True)
class PoolPlan:
    pool: PoolSpec | None
    status: dict[str, Any]
    """Merge patch of the pool's status."""
    events: tuple[Event, ...] = ()
    layout: NodeLayout | None = None
    children: tuple[dict[str, Any], ...] = ()
    prune: tuple[tuple[str, str, str], ...] = ()
    """(apiVersion, kind, name) of children the spec no longer asks for (deleted if present)."""
    ring: Ring | None = None
    push_ring: tuple[Member, ...] = ()
    """Usable members whose ring epoch differs from :attr:`ring` (get SetRing first)."""
    drain_calls: tuple[Member, ...] = ()
    drain_deadline_ms: int = 0
    policy: Policy | None = None
    tenants: tuple[NodeTenant, ...] = ()
    configure: tuple[Member, ...] = ()
    """Members that get SetPolicy and SetTenants (all usable ones)."""
    replicas: int | None = None
    spec_error: SpecError | None = None
    scale: scaling.ScaleDecision | None = None
    warm_calls: tuple[Member, ...] = ()
    """Previous owners that get Warm (after SetRing) for :attr:`rebalance`."""
    rebalance: RebalanceState | None = None
    warm: WarmSettings = WarmSettings()


def _failed(body: Mapping[str, Any], err: SpecError, obs: PoolObserved, pool: PoolSpec | None) -> PoolPlan:
    st = body.get("status") or {}
    view = status.pool_conditions(PoolObservation(
        desired=pool.replicas if pool else 0, active_members=len((membership.ring_from_status(st) or Ring(0)).active),
        spec_error=(err.reason, err.message), now_ms=obs.now_ms))
    conds, events = status.merge_conditions(st.get("conditions"), view.conditions, obs.now_iso,
                                            int((body.get("metadata") or {}).get("generation", 0)), "")
    return PoolPlan(pool, {"conditions": conds, "phase": view.phase, "message": view.message}, tuple(events),
                    spec_error=err)


def resolve_tiers(pool: PoolSpec, tiers: Mapping[str, TierSpec | SpecError]) -> dict[str, TierSpec]:
    """The pool's tiers that parsed; a listed tier that did not is the pool's error too."""
    out: dict[str, TierSpec] = {}
    for name in pool.tiers:
        t = tiers.get(name)
        if isinstance(t, SpecError):
            raise SpecError("InvalidTier", t.message)
        if t is not None:
            out[name] = t
    return out


def _claim_bytes(claim: Mapping[str, Any]) -> int:
    req = ((claim.get("spec") or {}).get("resources") or {}).get("requests") or {}
    try:
        return parse_bytes(req.get("storage", 0))
    except ValueError:
        return 0


def fit_claims(pool: PoolSpec, layout: NodeLayout, live: Sequence[Mapping[str, Any]] | None
               ) -> tuple[NodeLayout, list[dict[str, Any]] | None, tuple[str, str] | None]:
    """A StatefulSet's volume claims cannot change: keep the live ones, and fit the SSD tier into
    them (never configure a node for more than its claim holds). Returns the layout to use, the
    claims to apply (None: the builder's) and a (reason, message) when the spec could not be met."""
    if live is None:
        return layout, None, None
    want = children.volume_claim_templates(pool, layout)
    size = {str((c.get("metadata") or {}).get("name")): _claim_bytes(c) for c in live}
    if {str(c["metadata"]["name"]): _claim_bytes(c) for c in want} == size:
        return layout, [dict(c) for c in live], None
    problem = ("VolumeClaimsImmutable", "the StatefulSet keeps its volume claims (immutable); recreate the pool to "
                                        "change the SSD tier's claims")
    if layout.ssd is None:
        return layout, [dict(c) for c in live], problem if "ssd" not in size else None
    if "ssd" not in size:
        return replace(layout, ssd=None), [dict(c) for c in live], problem
    cap = int(size["ssd"] / 1.05)
    if (layout.ssd.capacity_bytes or 0) > cap:
        layout = replace(layout, ssd=replace(layout.ssd, capacity_bytes=cap))
        problem = (problem[0], f"{problem[1]}; the SSD tier is held at {format_bytes(cap)} per node")
    return layout, [dict(c) for c in live], problem


def plan_pool(obs: PoolObserved, settings: Settings) -> PoolPlan:
    body = obs.body
    st: Mapping[str, Any] = body.get("status") or {}
    pool: PoolSpec | None = None
    try:
        pool = parse_pool(body)
        layout = resolve_layout(pool, resolve_tiers(pool, obs.tiers), settings.default_dram_bytes,
                                settings.store_memory_overhead_bytes)
    except SpecError as err:
        return _failed(body, err, obs, pool)
    layout, live_claims, claim_problem = fit_claims(pool, layout, obs.sts_claims)

    previous = membership.ring_from_status(st)
    port, replication = pool.port, pool.replication
    grace_s = (pool.member_unready_grace_seconds if pool.member_unready_grace_seconds is not None
               else settings.member_unready_grace_seconds)
    unready_grace_ms = int(grace_s * 1000)

    def ring_of(base: Ring | None, pods: Iterable[StorePod], draining: Collection[str]) -> Ring:
        """The ring for ``pods``; members that went not-ready within the grace stay (membership)."""
        return membership.plan_ring(base, pods, draining, port, replication,
                                    now_ms=obs.now_ms, unready_grace_ms=unready_grace_ms)

    node_capacity = layout.capacity_bytes
    answered = [s for s in obs.stats.values() if s is not None]
    usage = status.aggregate(answered, pool.replication)
    current = obs.sts_replicas if obs.sts_replicas is not None else 0
    state = DrainState.from_status(st.get("drain"))
    rebalance_state = RebalanceState.from_status(st.get("rebalance"))
    events: list[Event] = []
    decision: scaling.ScaleDecision | None = None
    finished: Mapping[str, Any] | None = None
    calls: tuple[str, ...] = ()
    deadline = 0

    if state is not None:
        wanted = scaling.wanted_replicas(pool, state.from_replicas, usage.owned_bytes, node_capacity)
        pods_in = [p for p in obs.pods if p.ordinal < state.from_replicas]
        ring = ring_of(previous, pods_in, state.leaving)
        step = drain.step(state, ring.epoch, obs.pods, obs.drain_statuses, obs.now_ms, wanted,
                          settings.drain_overrun_seconds)
        events += step.events
        finished = step.finished
        if step.state is None:
            ring = ring_of(ring, [p for p in obs.pods if p.ordinal < step.member_limit], ())
        calls, deadline, state, replicas = step.calls, state.deadline_unix_ms, step.state, step.replicas
    else:
        # While a rebalance pushes blocks to their new owners, the sources' copies are foreign
        # before the owners hold them: owned bytes under-count, so a scale-down is checked against
        # what the nodes hold, and the autoscaler waits for the push to end.
        rebalancing = rebalance_state is not None
        decision = scaling.decide(pool, current, usage.used_bytes if rebalancing else usage.owned_bytes,
                                  node_capacity)
        last = int(st.get("lastScaleUnixMs") or 0)
        if (decision.reason == "Autoscaling" and decision.action in ("up", "down") and obs.sts_replicas is not None
                and (rebalancing or obs.now_ms - last < settings.autoscale_cooldown_seconds * 1000)):
            decision = scaling.ScaleDecision("none", current, current, current)  # let the last step settle
        silent = sorted(k for k, v in obs.stats.items() if v is None)
        if decision.action == "down" and silent and not pool.force_scale_down:
            # Usage unknown means the limit cannot be checked: refuse rather than guess low.
            decision = scaling.ScaleDecision(
                "blocked", current, current, decision.wanted, "NodeStatsUnavailable",
                f"scale-down from {current} to {decision.wanted} waits: no usage from {', '.join(silent)}")
        if decision.action == "down":
            step = drain.start(current, decision.target, obs.pods, obs.now_ms, pool.grace_period_seconds,
                               decision.reason)
            events += step.events
            state, calls, replicas = step.state, step.calls, step.replicas
            deadline = state.deadline_unix_ms if state else 0
            ring = ring_of(previous, [p for p in obs.pods if p.ordinal < step.member_limit], step.draining)
            if state is not None:
                state = replace(state, epoch=ring.epoch)
        else:
            replicas = decision.target
            limit = max(current, replicas) if decision.action == "blocked" else replicas
            ring = ring_of(previous, [p for p in obs.pods if p.ordinal < limit], ())
    if previous is not None and ring.epoch != previous.epoch:
        events.append(Event("Normal", "RingUpdated", f"ring epoch {ring.epoch}: {len(ring.active)} active, "
                                                     f"{len(ring.draining)} draining"))

    rb = rebalance.advance(
        rebalance_state, previous, ring,
        {k: (v.epoch if v is not None else None) for k, v in obs.stats.items()}, obs.pods, obs.warm_statuses,
        obs.now_ms, warm := WarmSettings(pool.warm_fraction, pool.warm_seconds, pool.warm_bytes_per_second),
        settings.drain_overrun_seconds, draining=state is not None,
        held_bytes={k: (v.used_bytes if v is not None else None) for k, v in obs.stats.items()})
    events += rb.events
    by_id = {m.id: m for m in ring.members}
    push = tuple(m for m in ring.members
                 if (s := obs.stats.get(m.id)) is None or s.epoch != ring.epoch)
    unreachable = sorted(k for k, v in obs.stats.items() if v is None)
    desired = (state.to_replicas if state else
               decision.wanted if decision and decision.action != "blocked" else replicas)
    view = status.pool_conditions(PoolObservation(
        desired=desired, pods=len(obs.pods), ready_pods=sum(p.ready for p in obs.pods),
        active_members=len(ring.active), unreachable=unreachable, decision=decision, drain=state,
        now_ms=obs.now_ms, updating=obs.sts_updating, problem=obs.start_problem or claim_problem,
        rebalance=rb.state))
    generation = int((body.get("metadata") or {}).get("generation", 0))
    conds, cond_events = status.merge_conditions(st.get("conditions"), view.conditions, obs.now_iso, generation)
    events += cond_events
    patch: dict[str, Any] = {
        "observedGeneration": generation, "phase": view.phase, "message": view.message, "conditions": conds,
        "replicas": len(obs.pods), "readyReplicas": len(ring.active), "desiredReplicas": desired,
        "selector": children.selector_string(pool), "ring": ring.to_dict(),
        "drain": state.to_status() if state is not None else None,
        "router": children.router_status(pool, settings),
        "rebalance": rb.state.to_status() if rb.state is not None else None,
        **status.usage_status(usage),
    }
    if pool.default_tenant:
        # Tokenless callers are the store's "default" partition: show it under the pool's name for it.
        for row in patch["tenants"]:
            if row["tenantId"] == STORE_DEFAULT_TENANT:
                row["tenantId"] = pool.default_tenant
    if finished is not None:
        patch["lastDrain"] = dict(finished)
    if rb.finished is not None:
        patch["lastRebalance"] = dict(rb.finished)
    if decision is not None and decision.action in ("up", "down") and obs.sts_replicas is not None:
        patch["lastScaleUnixMs"] = obs.now_ms
    layout_policy = Policy(dict(pool.ttl_seconds), layout.dram.high_watermark, layout.dram.low_watermark)
    policies = netpolicy.network_policies(pool, (tn for tn, _ in obs.tenants), settings)
    patch["networkPolicies"] = [m["metadata"]["name"] for m in policies] or None
    manifests = children.children(pool, layout, settings, replicas)
    # Before the StatefulSet (which stays last): new store pods start behind their policy.
    manifests[-1:-1] = policies
    if live_claims is not None:
        sts_spec = manifests[-1]["spec"]
        if live_claims:
            sts_spec["volumeClaimTemplates"] = live_claims
        else:
            sts_spec.pop("volumeClaimTemplates", None)
    if obs.start_problem is not None and obs.sts_replicas is None:
        # Pods that cannot mount (or would refuse) the key or their certificate only wait or
        # crash-loop: create the store nodes once the Secret is usable.  Running nodes keep
        # their keys and certificates and go on serving.
        manifests = [m for m in manifests if m["kind"] != "StatefulSet"]
    return PoolPlan(
        pool=pool, status=patch, events=tuple(events), layout=layout,
        children=tuple(manifests),
        prune=(*(children.pruned(pool) if (st.get("router") or {}).get("enabled") else ()),
               *netpolicy.pruned_policies(st.get("networkPolicies") or (), policies)),
        ring=ring, push_ring=push,
        drain_calls=tuple(by_id[c] for c in calls if c in by_id), drain_deadline_ms=deadline,
        policy=layout_policy, tenants=tuple(node_tenants(pool, obs.tenants)),
        configure=tuple(m for m in ring.members if obs.stats.get(m.id) is not None),
        replicas=replicas, scale=decision, warm_calls=tuple(by_id[c] for c in rb.calls if c in by_id),
        rebalance=rb.state, warm=warm)
