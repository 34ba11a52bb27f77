"""What the scale-down drain and the scale-up warm-up share: store nodes each running one push
job (GetDrainStatus / GetWarmStatus) for a ring epoch, followed from the operator.

Pure: :func:`follow` classifies every node's job from its answer, the status row kept so far and
whether its pod is still usable; the two state machines (:mod:`.drain`, :mod:`.rebalance`) decide
what the classification means for them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol


class JobStatus(Protocol):
    """A node's answer about its push job (:class:`kvpool.core.push_status.DrainStatus` / ``WarmStatus``)."""

    @property
    def state(self) -> str: ...  # idle | running | done

    @property
    def epoch(self) -> int: ...


def sum_counters(nodes: Iterable[Mapping[str, Any]], names: Sequence[str]) -> dict[str, int]:
    """The counters ``names`` summed over the nodes' status rows."""
    out = dict.fromkeys(names, 0)
    for n in nodes:
        for k in names:
            out[k] += int(n.get(k, 0))
    return out


def status_counters(status: Any, names: Sequence[str]) -> dict[str, int]:
    """The camelCase status counters ``names`` of a node's status dataclass (its snake_case fields)."""
    return {n: int(getattr(status, re.sub(r"([A-Z])", r"_\1", n).lower())) for n in names}


def follow(names: Iterable[str], rows: Mapping[str, Mapping[str, Any]], statuses: Mapping[str, JobStatus | None],
           usable: set[str], epoch: int, counters: Sequence[str]) -> tuple[dict[str, dict[str, Any]], list[str], int]:
    """Each node's status row after its latest answer, the nodes to ask to start (again), and how
    many jobs are still pending.

    A node whose pod is gone or not serving is ``gone`` (what it held is read through fallbacks
    or lost; nothing to wait for).  No answer: ``unreachable`` and pending, unless it had finished
    (a node that is done may stop answering).  A job of ``epoch`` that is done or running keeps
    its counters; any other answer (idle, or a job of another epoch: the node restarted, or the
    ring was replaced since) is ``pending`` and the node is asked again: its job is idempotent for
    one epoch.  A row keeps the job's ``counters`` (camelCase status names of its snake_case fields).
    """
    out: dict[str, dict[str, Any]] = {}
    calls: list[str] = []
    pending = 0
    for name in names:
        row = dict(rows.get(name, {}))
        st = statuses.get(name)
        if name not in usable:
            row["state"] = "gone"
        elif st is None:
            if row.get("state") != "done":
                row["state"] = "unreachable"
                pending += 1
        elif st.epoch == epoch and st.state == "done":
            row.update(status_counters(st, counters), state="done")
        elif st.epoch == epoch and st.state == "running":
            row.update(status_counters(st, counters), state="running")
            pending += 1
        else:
            row["state"] = "pending"
            calls.append(name)
            pending += 1
        out[name] = row
    return out, calls, pending
