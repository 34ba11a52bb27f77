"""The circuit breaker of one store node, as seen by one sidecar (pure; no I/O, no clock).

A node that misses a deadline, or cannot be reached, becomes *suspect*: the engine's calls skip
it at once (its keys are misses, or are read at the other replicas) instead of waiting for it
again.  A *probe* — one small call at a time, run beside the engine's calls, never in them — lets
it back in when it answers; a probe that fails keeps it suspect for a back-off that doubles up to
a cap.  The first probe goes out right after the failure: a node that was only slow for a moment
(a loaded machine) is back within one probe's round trip, while a hung one costs the engine's
calls nothing more.

The pool (:mod:`kvpool.pool.fanout`) holds one :class:`Health` per node under its lock and
applies these functions; the clock is an argument.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace


class State(enum.Enum):
    CLOSED = "closed"
    """Healthy: calls go to the node."""
    SUSPECT = "suspect"
    """Missed a deadline or unreachable: calls skip it; a probe is due at ``Health.until``."""
    PROBING = "probing"
    """A probe is on its way: calls skip it; only that probe decides."""


class Admission(enum.Enum):
    CALL = "call"
    """Send the call."""
    SKIP = "skip"
    """Skip the node (its keys are misses for this call)."""
    PROBE = "probe"
    """Skip the node, and start the one probe now (:func:`probe_started`)."""


@dataclass(frozen=True)
class Policy:
    backoff_seconds: float = 1.0
    """Suspect this long after a failed probe (doubling with each further one)."""
    max_backoff_seconds: float = 8.0


@dataclass(frozen=True)
class Health:
    state: State = State.CLOSED
    until: float = 0.0
    """When a suspect node's next probe is due (monotonic seconds)."""
    failures: int = 0
    """Failures since the node last answered (calls and probes)."""


def admit(h: Health, now: float) -> Admission:
    """What a call (or the background loop) does with the node now."""
    if h.state is State.CLOSED:
        return Admission.CALL
    if h.state is State.SUSPECT and now >= h.until:
        return Admission.PROBE
    return Admission.SKIP


def probe_delay(failures: int, policy: Policy) -> float:
    """Seconds from the ``failures``-th failure to the next probe: none after the first (probe at
    once: maybe it was only slow), then ``backoff``, doubling, capped."""
    if failures <= 1:
        return 0.0
    return float(min(policy.backoff_seconds * 2.0 ** (failures - 2), policy.max_backoff_seconds))


def on_failure(h: Health, now: float, policy: Policy, probe: bool = False) -> Health:
    """A call (``probe``: the probe) to the node missed its deadline or found it unreachable.
    A call that fails while a probe is on its way leaves the decision to the probe (one probe at
    a time)."""
    failures = h.failures + 1
    if h.state is State.PROBING and not probe:
        return replace(h, failures=failures)
    return Health(State.SUSPECT, now + probe_delay(failures, policy), failures)


def on_success(h: Health) -> Health:
    """The node answered (a call or a probe): it is healthy again."""
    return Health()


def probe_started(h: Health) -> Health:
    """The one probe of a suspect node is on its way (later calls skip it until it ends)."""
    return replace(h, state=State.PROBING)


def is_up(h: Health) -> bool:
    return h.state is State.CLOSED
