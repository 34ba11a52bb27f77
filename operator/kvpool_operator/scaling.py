"""How many store nodes a pool should have, and whether a scale-down is safe (DESIGN §8).

Pure. Autoscaling aims used/capacity at the target; any scale-down, by the autoscaler or by the
user, is refused when the remaining nodes would be used above the limit (0.8 unless the pool
says otherwise) — the ECK pattern: refuse with a reason rather than lose the cache — unless the
pool is annotated kvpool.io/force-scale-down.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from .model import FORCE_SCALE_DOWN_ANNOTATION, PoolSpec
from .units import format_percent

Action = Literal["none", "up", "down", "blocked"]


@dataclass(frozen=True)
class ScaleDecision:
    action: Action
    current: int
    target: int
    """Replicas to move to (``current`` when blocked or nothing to do)."""
    wanted: int
    """What spec or autoscaler asked for (differs from ``target`` when blocked)."""
    reason: str = ""
    message: str = ""
    projected_utilization: float = 0.0


def autoscale_target(pool: PoolSpec, current: int, used_bytes: int, node_capacity_bytes: int) -> int:
    """Nodes for used/capacity ≈ target, clamped to [min, max]; one node down at a time (each step
    is a drain), any number up.  A pool with no nodes yet starts at spec.storage.replicas (within
    [min, max]), as a Deployment under a HorizontalPodAutoscaler starts at its own replicas: the
    autoscaler moves it from there once the nodes report their usage."""
    a = pool.autoscaling

    def bounded(n: int) -> int:
        return max(a.min_replicas, min(a.max_replicas, n))
    if current == 0:
        return bounded(pool.replicas)
    if node_capacity_bytes <= 0:
        return bounded(current)
    need = bounded(math.ceil(used_bytes / (node_capacity_bytes * a.target_utilization)) if used_bytes else 0)
    if need < current:
        smaller = current - 1
        if current > a.max_replicas:
            # maxReplicas was lowered below the pool: step towards it whatever the load, so that
            # decide() refuses the step with a reason when the remaining nodes would be too full
            # (hysteresis would hold the pool where it is, over the user's bound, and say nothing).
            return smaller
        # Hysteresis: only shrink when the smaller pool would still be under the target.
        if used_bytes > smaller * node_capacity_bytes * a.target_utilization * 0.9:
            return current
        return max(need, smaller)
    return need


def wanted_replicas(pool: PoolSpec, current: int, used_bytes: int, node_capacity_bytes: int) -> int:
    if not pool.autoscaling.enabled:
        return pool.replicas
    return autoscale_target(pool, current, used_bytes, node_capacity_bytes)


def decide(pool: PoolSpec, current: int, used_bytes: int, node_capacity_bytes: int) -> ScaleDecision:
    """The next step from ``current`` replicas given the pool's observed usage."""
    wanted = wanted_replicas(pool, current, used_bytes, node_capacity_bytes)
    if wanted == current:
        return ScaleDecision("none", current, current, wanted)
    if wanted > current:
        why = "Autoscaling" if pool.autoscaling.enabled else "SpecChanged"
        return ScaleDecision("up", current, wanted, wanted, why, f"scaling up from {current} to {wanted} store nodes")
    remaining = wanted * node_capacity_bytes
    projected = used_bytes / remaining if remaining > 0 else (math.inf if used_bytes else 0.0)
    limit = pool.utilization_limit
    if projected > limit and not pool.force_scale_down:
        shown = "∞" if math.isinf(projected) else format_percent(projected)
        return ScaleDecision(
            "blocked", current, current, wanted, "UtilizationTooHigh",
            f"scale-down from {current} to {wanted} refused: the remaining nodes would be {shown} full "
            f"(limit {format_percent(limit)}); free space, lower the load or annotate the pool "
            f"{FORCE_SCALE_DOWN_ANNOTATION}=true", projected)
    why = "Forced" if projected > limit else ("Autoscaling" if pool.autoscaling.enabled else "SpecChanged")
    return ScaleDecision("down", current, wanted, wanted, why,
                         f"scaling down from {current} to {wanted} store nodes", projected)
