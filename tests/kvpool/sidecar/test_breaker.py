"""The circuit breaker's decisions and the deadline arithmetic (pure functions, no sockets)."""

from __future__ import annotations

import pytest

from kvpool.core import breaker as b
from kvpool.core.deadlines import MIN_SECONDS, ClientDeadlines, Deadlines, read_seconds, remaining

P = b.Policy(backoff_seconds=1.0, max_backoff_seconds=8.0)


def test_a_healthy_node_takes_calls() -> None:
    assert b.admit(b.Health(), 0.0) is b.Admission.CALL
    assert b.is_up(b.Health())


def test_a_failure_makes_it_suspect_and_probes_at_once() -> None:
    h = b.on_failure(b.Health(), 10.0, P)
    assert h.state is b.State.SUSPECT and h.failures == 1 and not b.is_up(h)
    # The first probe is due at once: a node that was only slow comes back within one probe.
    assert b.admit(h, 10.0) is b.Admission.PROBE
    p = b.probe_started(h)
    # While the probe is out, every call skips the node: one probe at a time.
    assert b.admit(p, 10.0) is b.Admission.SKIP
    assert b.admit(p, 1000.0) is b.Admission.SKIP


def test_failed_probes_back_off_doubling_up_to_the_cap() -> None:
    h, now = b.on_failure(b.Health(), 0.0, P), 0.0
    delays = []
    for _ in range(7):
        h = b.on_failure(b.probe_started(h), now, P, probe=True)
        delays.append(h.until - now)
        assert b.admit(h, now) is b.Admission.SKIP  # suspect: calls skip it until the probe is due
        assert b.admit(h, h.until) is b.Admission.PROBE
        now = h.until
    assert delays == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0]


def test_a_probe_that_answers_lets_it_back_in() -> None:
    h = b.probe_started(b.on_failure(b.on_failure(b.Health(), 0.0, P), 0.0, P))
    ok = b.on_success(h)
    assert ok == b.Health() and b.admit(ok, 0.0) is b.Admission.CALL
    # After recovery the next failure starts the ladder again (probe at once).
    assert b.on_failure(ok, 5.0, P).until == 5.0


def test_a_call_failing_during_a_probe_leaves_the_decision_to_the_probe() -> None:
    p = b.probe_started(b.on_failure(b.Health(), 0.0, P))
    q = b.on_failure(p, 0.5, P)  # a call sent before the node became suspect, failing late
    assert q.state is b.State.PROBING and q.failures == 2
    assert b.admit(q, 0.5) is b.Admission.SKIP


def test_probe_delay() -> None:
    assert [b.probe_delay(k, P) for k in range(0, 7)] == [0.0, 0.0, 1.0, 2.0, 4.0, 8.0, 8.0]


def test_read_deadline_grows_with_its_bytes() -> None:
    d = Deadlines(match_seconds=0.1, read_base_seconds=0.1, read_bytes_per_second=100e6)
    assert d.read_seconds(0) == pytest.approx(0.1)
    assert d.read_seconds(16 << 20) == pytest.approx(0.1 + (16 << 20) / 100e6)
    assert d.read_seconds(100_000_000) == pytest.approx(1.1)
    assert read_seconds(1 << 30, 0.05, 0) == pytest.approx(0.05)  # no floor: no extra time
    assert read_seconds(0, 0.0, 1e6) == MIN_SECONDS


def test_remaining_never_reaches_zero() -> None:
    assert remaining(10.0, 9.75) == pytest.approx(0.25)
    assert remaining(10.0, 11.0) == MIN_SECONDS  # an answer already there is still collected


@pytest.mark.parametrize("kw", [{"match_seconds": 0}, {"read_base_seconds": -1}, {"probe_seconds": 0},
                                {"read_bytes_per_second": -1.0}])
def test_bad_deadlines_are_refused(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Deadlines(**kw)


def test_client_deadlines_are_positive() -> None:
    d = ClientDeadlines()
    assert d.match_seconds <= d.read_seconds < d.read_bound(100 << 20) < d.other_seconds
    with pytest.raises(ValueError):
        ClientDeadlines(match_seconds=0)


def test_sidecar_flags_set_the_deadlines() -> None:
    from kvpool.sidecar.main import build_parser, config_from_args

    args = build_parser().parse_args(["--socket", "/tmp/x.sock", "--match-deadline-ms", "250", "--read-deadline-ms",
                                      "300", "--read-bytes-per-second", "50000000", "--probe-deadline-ms", "2000",
                                      "--suspect-backoff-ms", "500"])
    cfg = config_from_args(args)
    assert cfg.deadlines() == Deadlines(0.25, 0.3, 50e6, 2.0)
    assert cfg.suspect_backoff_ms == 500
    defaults = config_from_args(build_parser().parse_args(["--socket", "/tmp/x.sock"]))
    assert defaults.deadlines() == Deadlines()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--socket", "/tmp/x.sock", "--match-deadline-ms", "0"])
