"""Scale-down as a resumable state machine (DESIGN §8, STYLE 8).

    start → Draining (leaving nodes marked draining in a new ring epoch, each asked to push its
    objects, hottest first, to the new owners until done or the deadline) → removal (a ring
    without them, then the StatefulSet lowered) → done.

Pure: :func:`start` and :func:`step` map (state kept in ``status.drain``, observations) to the
next state and the calls to make. Every step can be repeated: a store node's Drain is idempotent
for one epoch, so an operator restarted in the middle re-reads ``status.drain`` and carries on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvpool.core.push_status import DrainStatus

from .membership import StorePod
from .push_jobs import follow, sum_counters
from .units import format_bytes, format_time

COUNTERS = ("movedObjects", "movedBytes", "droppedObjects", "droppedBytes", "remainingObjects")


@dataclass(frozen=True)
class DrainState:
    """What ``status.drain`` holds while a scale-down runs."""

    from_replicas: int
    to_replicas: int
    leaving: tuple[str, ...]
    started_unix_ms: int
    deadline_unix_ms: int
    epoch: int = 0
    """Ring epoch in which the leaving nodes drain (0 until that ring exists)."""
    nodes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    reason: str = "SpecChanged"

    def totals(self) -> dict[str, int]:
        return sum_counters(self.nodes.values(), COUNTERS)

    def to_status(self) -> dict[str, Any]:
        return {"phase": "Draining", "fromReplicas": self.from_replicas, "toReplicas": self.to_replicas,
                "leaving": list(self.leaving), "startedUnixMs": self.started_unix_ms,
                "deadlineUnixMs": self.deadline_unix_ms, "deadline": format_time(self.deadline_unix_ms),
                "epoch": self.epoch, "reason": self.reason,
                "nodes": {k: dict(v) for k, v in self.nodes.items()}, **self.totals()}

    @staticmethod
    def from_status(doc: Mapping[str, Any] | None) -> DrainState | None:
        if not doc or doc.get("phase") != "Draining":
            return None
        return DrainState(from_replicas=int(doc["fromReplicas"]), to_replicas=int(doc["toReplicas"]),
                          leaving=tuple(doc.get("leaving") or ()), started_unix_ms=int(doc.get("startedUnixMs", 0)),
                          deadline_unix_ms=int(doc.get("deadlineUnixMs", 0)), epoch=int(doc.get("epoch", 0)),
                          nodes={k: dict(v) for k, v in (doc.get("nodes") or {}).items()},
                          reason=str(doc.get("reason", "SpecChanged")))

    def progress_message(self, now_ms: int) -> str:
        t = self.totals()
        left = max(0, (self.deadline_unix_ms - now_ms) // 1000)
        return (f"draining {', '.join(self.leaving)} ({self.from_replicas}→{self.to_replicas} nodes): moved "
                f"{t['movedObjects']} objects ({format_bytes(t['movedBytes'])}), dropped {t['droppedObjects']}, "
                f"{t['remainingObjects']} remaining, {left}s to the deadline")


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class DrainStep:
    state: DrainState | None
    """The state to store (None: no drain in progress any more)."""
    draining: frozenset[str]
    """Members to mark draining in the ring."""
    member_limit: int
    """Only pods with an ordinal below this are ring members."""
    replicas: int
    """StatefulSet replicas to apply (after the ring has been pushed)."""
    calls: tuple[str, ...] = ()
    """Leaving nodes to (re)send Drain with the current ring and the deadline."""
    events: tuple[Event, ...] = ()
    finished: Mapping[str, Any] | None = None
    """Summary for ``status.lastDrain`` when the drain ended on this step."""


def start(from_replicas: int, to_replicas: int, pods: Iterable[StorePod], now_ms: int, grace_seconds: int,
          reason: str = "SpecChanged") -> DrainStep:
    """Begin a scale-down that :mod:`scaling` allowed. The leaving nodes are the highest ordinals
    (the ones a StatefulSet removes); those that never joined the ring have nothing to move."""
    leaving = tuple(p.name for p in pods if p.ordinal >= to_replicas and p.usable)
    if not leaving:
        return DrainStep(None, frozenset(), to_replicas, to_replicas, events=(
            Event("Normal", "ScaledDown", f"scaled down from {from_replicas} to {to_replicas} store nodes "
                                          "(nothing to drain)"),))
    state = DrainState(from_replicas=from_replicas, to_replicas=to_replicas, leaving=leaving,
                       started_unix_ms=now_ms, deadline_unix_ms=now_ms + grace_seconds * 1000, reason=reason,
                       nodes={n: {"state": "pending"} for n in leaving})
    return DrainStep(state, frozenset(leaving), from_replicas, from_replicas, calls=leaving, events=(
        Event("Normal", "DrainStarted", f"draining {', '.join(leaving)} before scaling from {from_replicas} to "
                                        f"{to_replicas} store nodes; deadline in {grace_seconds}s"),))


def step(state: DrainState, ring_epoch: int, pods: Iterable[StorePod],
         statuses: Mapping[str, DrainStatus | None], now_ms: int, wanted_replicas: int,
         overrun_seconds: float = 30.0) -> DrainStep:
    """Advance a running drain.

    ``ring_epoch`` is the epoch of the ring that marks the leaving nodes draining (the handler has
    just pushed it); ``statuses`` are the leaving nodes' GetDrainStatus answers (None: no answer).
    """
    if wanted_replicas >= state.from_replicas:
        return DrainStep(None, frozenset(), wanted_replicas, wanted_replicas, events=(
            Event("Normal", "DrainCancelled", f"scale-down to {state.to_replicas} cancelled: "
                                              f"{wanted_replicas} store nodes wanted"),),
            finished={**state.totals(), "result": "Cancelled", "leaving": list(state.leaving)})
    usable = {p.name for p in pods if p.usable}
    nodes, calls, pending = follow(state.leaving, state.nodes, statuses, usable, ring_epoch, COUNTERS)
    new = replace(state, nodes=nodes, epoch=ring_epoch)
    overrun = now_ms > state.deadline_unix_ms + int(overrun_seconds * 1000)
    if pending and not overrun:
        return DrainStep(new, frozenset(state.leaving), state.from_replicas, state.from_replicas, tuple(calls))
    t = new.totals()
    result = "Completed" if not pending else "DeadlineExceeded"
    msg = (f"drained {', '.join(state.leaving)} in {(now_ms - state.started_unix_ms) / 1000:.1f}s: moved "
           f"{t['movedObjects']} objects ({format_bytes(t['movedBytes'])}), dropped {t['droppedObjects']} "
           f"({format_bytes(t['droppedBytes'])}); now {state.to_replicas} store nodes")
    ev = Event("Normal" if result == "Completed" else "Warning",
               "DrainCompleted" if result == "Completed" else "DrainDeadlineExceeded", msg)
    finished = {**t, "result": result, "reason": state.reason, "leaving": list(state.leaving),
                "fromReplicas": state.from_replicas,
                "toReplicas": state.to_replicas, "startedUnixMs": state.started_unix_ms, "endedUnixMs": now_ms,
                "durationSeconds": round((now_ms - state.started_unix_ms) / 1000, 3)}
    return DrainStep(None, frozenset(), state.to_replicas, state.to_replicas, events=(ev,), finished=finished)
