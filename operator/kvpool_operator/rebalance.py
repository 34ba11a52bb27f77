"""Scale-up rebalance and re-replication as one resumable state machine (issue 8 part 1; DESIGN §6, §8).

    a ring epoch adds members → WaitingForRing (every member must report that epoch, so the new
    nodes take the writes) → Warming (each previous owner asked to push its hottest blocks now
    owned by the added members, paced, until done or the deadline) → done (``status.lastRebalance``).

    a ring epoch drops active members without a drain (a dead node removed after the unready
    grace), with replication R ≥ 2 → WaitingForRing → Warming, shown as the condition reason
    Rereplicating: the surviving members push, with the same Warm job, each block that lost a
    copy to its owner that was not one before, from its first surviving previous owner.  With
    R=1 the only copy died with the node (and a state object is single-copy): nothing to restore.

Reads never wait for it: during the transition the sidecars fall back to the previous owners
and copy what they find over; the push makes the rest of the hot set hit at the new owners.
Pure: :func:`advance` maps (``status.rebalance``, the rings, the nodes' answers) to the next
state and the Warm calls to make; a store node's Warm is idempotent for one epoch, so an
operator restarted in the middle re-reads ``status.rebalance`` and carries on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvpool.core.push_status import WarmStatus
from kvpool.core.ring import Ring, removed_members

from .drain import Event
from .membership import StorePod
from .push_jobs import follow, sum_counters
from .units import format_bytes, format_time

COUNTERS = ("plannedObjects", "plannedBytes", "movedObjects", "movedBytes", "skippedObjects", "skippedBytes",
            "failedObjects", "remainingObjects")


@dataclass(frozen=True)
class WarmSettings:
    """The pool's spec.scaleUp, as the planner needs it."""

    fraction: float = 1.0
    deadline_seconds: int = 300
    bytes_per_second: int = 0


@dataclass(frozen=True)
class RebalanceState:
    """What ``status.rebalance`` holds while a scale-up warm-up runs."""

    epoch: int
    """Ring epoch whose added members receive the push."""
    added: tuple[str, ...]
    sources: tuple[str, ...]
    """Previous owners that push (active before and after)."""
    started_unix_ms: int
    deadline_unix_ms: int
    stage: str = "WaitingForRing"  # WaitingForRing | Warming
    nodes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    removed: tuple[str, ...] = ()
    """Active members that left without a drain: the blocks they held get their lost copy back."""

    @property
    def reason(self) -> str:
        """The Rebalancing condition's reason: the stage, Rereplicating for a push that restores copies."""
        return "Rereplicating" if self.stage == "Warming" and self.removed else self.stage

    def what(self) -> str:
        """The push in a few words, for messages."""
        parts = [f"warm-up of {', '.join(self.added)}"] if self.added else []
        if self.removed:
            parts.append(f"re-replication of the blocks that lost a copy with {', '.join(self.removed)}")
        return " and ".join(parts)

    def totals(self) -> dict[str, int]:
        return sum_counters(self.nodes.values(), COUNTERS)

    def to_status(self) -> dict[str, Any]:
        return {"phase": "Rebalancing", "stage": self.stage, "epoch": self.epoch, "added": list(self.added),
                "sources": list(self.sources), "removed": list(self.removed), "startedUnixMs": self.started_unix_ms,
                "deadlineUnixMs": self.deadline_unix_ms, "deadline": format_time(self.deadline_unix_ms),
                "nodes": {k: dict(v) for k, v in self.nodes.items()}, **self.totals()}

    @staticmethod
    def from_status(doc: Mapping[str, Any] | None) -> RebalanceState | None:
        if not doc or doc.get("phase") != "Rebalancing":
            return None
        return RebalanceState(epoch=int(doc.get("epoch", 0)), added=tuple(doc.get("added") or ()),
                              sources=tuple(doc.get("sources") or ()),
                              started_unix_ms=int(doc.get("startedUnixMs", 0)),
                              deadline_unix_ms=int(doc.get("deadlineUnixMs", 0)),
                              stage=str(doc.get("stage", "WaitingForRing")),
                              nodes={k: dict(v) for k, v in (doc.get("nodes") or {}).items()},
                              removed=tuple(doc.get("removed") or ()))

    def progress_message(self, now_ms: int) -> str:
        t = self.totals()
        if self.stage == "WaitingForRing":
            return f"waiting for every store node to take ring epoch {self.epoch} before the {self.what()}"
        left = max(0, (self.deadline_unix_ms - now_ms) // 1000)
        return (f"{self.what()} from {', '.join(self.sources)}: moved {t['movedObjects']} of "
                f"{t['plannedObjects']} objects ({format_bytes(t['movedBytes'])}), {t['skippedObjects']} "
                f"already there, {t['remainingObjects']} remaining, {left}s to the deadline")


@dataclass(frozen=True)
class RebalanceStep:
    state: RebalanceState | None
    """The state to store (None: no rebalance in progress)."""
    calls: tuple[str, ...] = ()
    """Previous owners to (re)send Warm with the current ring and the deadline."""
    events: tuple[Event, ...] = ()
    finished: Mapping[str, Any] | None = None
    """Summary for ``status.lastRebalance`` when the rebalance ended on this step."""


def _start(previous: Ring, ring: Ring, now_ms: int, warm: WarmSettings,
           carry: RebalanceState | None = None) -> RebalanceStep:
    before = {m.id for m in previous.active}
    added = [m.id for m in ring.active if m.id not in before]
    # Replication R restored only with R ≥ 2: with R=1 the only copy died with the node.
    removed = removed_members(previous, ring) if ring.replicas > 1 else []
    if carry is not None:  # a further change before the last push finished: push for all of them
        added = [m.id for m in ring.active if m.id in set(carry.added) or m.id in set(added)]
        before = {m.id for m in ring.active} - set(added)
        if ring.replicas > 1:
            removed = [r for r in dict.fromkeys([*carry.removed, *removed]) if ring.member(r) is None]
    if warm.fraction <= 0:
        added = []  # no warm-up; restoring copies does not depend on it
    sources = tuple(m.id for m in ring.active if m.id in before)
    if not (added or removed) or not sources:
        return RebalanceStep(None)
    state = RebalanceState(epoch=ring.epoch, added=tuple(added), sources=sources, started_unix_ms=now_ms,
                           deadline_unix_ms=now_ms + warm.deadline_seconds * 1000,
                           nodes={s: {"state": "pending"} for s in sources}, removed=tuple(removed))
    verb = "restarted for" if carry is not None else "started:"
    pushes = [f"their hottest moved objects to {', '.join(added)}"] if added else []
    if removed:
        pushes.append(f"the blocks that lost a copy with {', '.join(removed)} (left without a drain) "
                      f"to their next owners")
    return RebalanceStep(state, events=(Event(
        "Normal", "RebalanceStarted", f"rebalance {verb} {', '.join(sources)} will push {' and '.join(pushes)} "
                                      f"(ring epoch {ring.epoch}); deadline in {warm.deadline_seconds}s"),))


def advance(state: RebalanceState | None, previous: Ring | None, ring: Ring, epochs: Mapping[str, int | None],
            pods: Iterable[StorePod], statuses: Mapping[str, WarmStatus | None], now_ms: int,
            warm: WarmSettings, overrun_seconds: float = 30.0, draining: bool = False,
            held_bytes: Mapping[str, int | None] | None = None) -> RebalanceStep:
    """The next step of the scale-up rebalance.

    ``previous`` is the ring of the last status (None on a new pool), ``ring`` the one this
    reconcile publishes; ``epochs`` each usable member's reported ring epoch (None: no answer);
    ``statuses`` the sources' GetWarmStatus answers. ``draining``: a scale-down is in progress
    (its own drain moves the objects; no warm-up then). ``held_bytes``: what each node reported
    holding (None or absent: no answer); a scale-up whose previous owners all said they hold
    nothing (a new pool coming up) has nothing to warm and starts no rebalance.  A previous owner
    that did not answer may hold data: the rebalance starts (this reconcile publishes the ring, so
    there is no later one to catch up), and a source that turns out empty is done at once.
    """
    if draining:
        if state is None:
            return RebalanceStep(None)
        return _end(state, now_ms, "Cancelled", "a scale-down started")
    if state is not None and ring.epoch != state.epoch:
        goes_on = (any(m.id in state.added for m in ring.active)
                   or (ring.replicas > 1 and any(ring.member(r) is None for r in state.removed)))
        if not goes_on and previous is not None:
            why = "no longer has the added nodes" if state.added else "has the removed nodes back"
            ended = _end(state, now_ms, "Superseded", f"ring epoch {ring.epoch} {why}")
            nxt = _start(previous, ring, now_ms, warm)
            return RebalanceStep(nxt.state, events=ended.events + nxt.events, finished=ended.finished)
        nxt = _start(previous or ring, ring, now_ms, warm, carry=state)
        return RebalanceStep(nxt.state, events=nxt.events)
    if state is None:
        if previous is None or ring.epoch == previous.epoch:
            return RebalanceStep(None)
        if held_bytes is not None and all(held_bytes.get(m.id) == 0 for m in previous.active):
            return RebalanceStep(None)
        return _start(previous, ring, now_ms, warm)

    usable = {p.name for p in pods if p.usable}
    members = [m.id for m in ring.members]
    if state.stage == "WaitingForRing":
        if any(epochs.get(m) != ring.epoch for m in members if m in usable):
            if now_ms > state.deadline_unix_ms:
                return _end(state, now_ms, "DeadlineExceeded", "the ring never reached every store node")
            return RebalanceStep(state)
        state = replace(state, stage="Warming")
    nodes, calls, pending = follow(state.sources, state.nodes, statuses, usable, state.epoch, COUNTERS)
    state = replace(state, nodes=nodes)
    overrun = now_ms > state.deadline_unix_ms + int(overrun_seconds * 1000)
    if pending and not overrun:
        return RebalanceStep(state, tuple(calls))
    return _end(state, now_ms, "Completed" if not pending else "DeadlineExceeded", "")


def _end(state: RebalanceState, now_ms: int, result: str, why: str) -> RebalanceStep:
    t = state.totals()
    outcome = "hit its deadline" if result == "DeadlineExceeded" else result.lower()
    msg = (f"{state.what()} {outcome}"
           f" after {(now_ms - state.started_unix_ms) / 1000:.1f}s: moved {t['movedObjects']} objects "
           f"({format_bytes(t['movedBytes'])}), {t['skippedObjects']} already there, {t['failedObjects']} failed"
           + (f" ({why})" if why else ""))
    reason = {"Completed": "RebalanceCompleted", "DeadlineExceeded": "RebalanceDeadlineExceeded"}.get(
        result, "RebalanceCancelled")
    ev = Event("Normal" if result in ("Completed", "Superseded", "Cancelled") else "Warning", reason, msg)
    finished = {**t, "result": result, "epoch": state.epoch, "added": list(state.added), "removed": list(state.removed),
                "sources": list(state.sources), "startedUnixMs": state.started_unix_ms, "endedUnixMs": now_ms,
                "durationSeconds": round((now_ms - state.started_unix_ms) / 1000, 3)}
    return RebalanceStep(None, events=(ev,), finished=finished)
