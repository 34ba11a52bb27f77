"""What a store node reports of its push jobs: the drain (scale-down) and the warm-up (scale-up,
re-replication).  Pure values.

One definition for every side: the node keeps its running job's status as one of these (replaced
whole at each step, so a reader sees one consistent snapshot), the wire carries it as the
``DrainStatus``/``WarmStatus`` messages of ``store.proto`` (field for field, converted in
:mod:`kvpool.wire.convert`), and the operator plans with it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DrainStatus:
    """A leaving node's drain: its objects pushed to their owners in the ring it drains in."""

    state: str = "idle"
    """``idle`` (no drain yet), ``running``, ``done`` (every object counted: the last ones as
    dropped if the deadline passed), or stopped before its end: ``superseded`` (a newer drain
    took over) or ``cancelled`` (a newer ring made the node active again)."""
    moved_objects: int = 0
    """Objects an owner holds now (pushed, or there already)."""
    moved_bytes: int = 0
    dropped_objects: int = 0
    """Objects no owner holds at the end (refused, unreachable, or the deadline passed)."""
    dropped_bytes: int = 0
    remaining_objects: int = 0
    """Objects not counted yet as moved or dropped."""
    deadline_unix_ms: int = 0
    epoch: int = 0
    """The ring epoch the drain runs for."""


@dataclass(frozen=True)
class WarmStatus:
    """A previous owner's warm-up push: its hottest objects whose ownership moved, to their new
    owners (an added member, or the next owner of a block that lost a copy)."""

    state: str = "idle"
    """``idle`` (no warm-up yet), ``running`` or ``done`` (at its end, its deadline, or a newer ring)."""
    planned_objects: int = 0
    """Pushes chosen (hottest first): one per object and new owner."""
    planned_bytes: int = 0
    moved_objects: int = 0
    """Written at the new owner."""
    moved_bytes: int = 0
    skipped_objects: int = 0
    """The new owner had it already (never re-sent)."""
    skipped_bytes: int = 0
    failed_objects: int = 0
    """Refused or unreachable target, or gone here meanwhile."""
    remaining_objects: int = 0
    """Not pushed yet (at the deadline: left where they are)."""
    deadline_unix_ms: int = 0
    epoch: int = 0
    """The ring epoch the warm-up runs for."""
