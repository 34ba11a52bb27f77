"""The ring from ready store pods: members, states, epochs."""

from kvpool.core.ring import Ring
from kvpool_operator.membership import StorePod, observe_pods, plan_ring, ring_from_status, seed_addresses


def _pods(n: int, ready: set[int] | None = None) -> list[StorePod]:
    return [StorePod(f"p-store-{i}", i, f"127.0.0.{10 + i}", ready=ready is None or i in ready) for i in range(n)]


def test_observe_pods() -> None:
    pods = observe_pods([
        {"metadata": {"name": "p-store-1"}, "status": {"podIP": "10.0.0.2",
                                                       "conditions": [{"type": "Ready", "status": "True"}]}},
        {"metadata": {"name": "p-store-0", "deletionTimestamp": "x"},
         "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}},
        {"metadata": {"name": "p-store-2"}, "status": {}},
    ])
    assert [(p.name, p.ordinal, p.usable) for p in pods] == [("p-store-0", 0, False), ("p-store-1", 1, True),
                                                            ("p-store-2", 2, False)]


def test_first_ring_and_stability() -> None:
    r1 = plan_ring(None, _pods(3), (), 7400)
    assert r1.epoch == 1 and [m.address for m in r1.members] == ["127.0.0.10:7400", "127.0.0.11:7400",
                                                                 "127.0.0.12:7400"]
    assert r1.members[0].transfer_address == "127.0.0.10:7401"
    assert plan_ring(r1, _pods(3), (), 7400) is r1  # nothing changed: same epoch, same object


def test_epoch_moves_on_every_change() -> None:
    r1 = plan_ring(None, _pods(3), (), 7400)
    r2 = plan_ring(r1, _pods(3, ready={0, 1}), (), 7400)
    assert r2.epoch == 2 and len(r2.members) == 2
    r3 = plan_ring(r2, _pods(3), {"p-store-2"}, 7400)
    assert r3.epoch == 3 and [m.id for m in r3.draining] == ["p-store-2"] and len(r3.active) == 2
    moved = [StorePod("p-store-0", 0, "127.0.0.99", True), *_pods(3)[1:]]
    assert plan_ring(r3, moved, {"p-store-2"}, 7400).epoch == 4  # a new IP is a new membership


def test_status_round_trip_and_seeds() -> None:
    r = plan_ring(None, _pods(5), {"p-store-4"}, 7400, replication=2)
    back = ring_from_status({"ring": r.to_dict()})
    assert back == r
    assert ring_from_status({}) is None and ring_from_status({"ring": {"members": [{"x": 1}]}}) is None
    assert seed_addresses(r, "svc:7400") == ["127.0.0.10:7400", "127.0.0.11:7400", "127.0.0.12:7400", "svc:7400"]
    assert seed_addresses(None, "svc:7400") == ["svc:7400"]
    assert seed_addresses(Ring(3), "svc:1") == ["svc:1"]


def _unready(i: int, since_ms: int, ip: str | None = None, terminating: bool = False) -> StorePod:
    return StorePod(f"p-store-{i}", i, ip or f"127.0.0.{10 + i}", ready=False, terminating=terminating,
                    unready_since_ms=since_ms)


def test_a_member_that_just_went_unready_keeps_its_place_for_the_grace() -> None:
    r1 = plan_ring(None, _pods(3), (), 7400)
    now, grace = 1_000_000, 15_000
    flapping = [*_pods(2), _unready(2, now - 14_000)]
    assert plan_ring(r1, flapping, (), 7400, now_ms=now, unready_grace_ms=grace) is r1  # no new epoch
    # Back to ready within the grace: still the same ring, nothing moved at all.
    assert plan_ring(r1, _pods(3), (), 7400, now_ms=now + 1000, unready_grace_ms=grace) is r1
    # Unready past the grace: it leaves.
    gone = plan_ring(r1, [*_pods(2), _unready(2, now - 15_000)], (), 7400, now_ms=now, unready_grace_ms=grace)
    assert gone.epoch == 2 and [m.id for m in gone.members] == ["p-store-0", "p-store-1"]
    # No grace configured (the default): it leaves at once, as before.
    assert plan_ring(r1, flapping, (), 7400, now_ms=now).epoch == 2


def test_the_grace_holds_only_the_same_pod_of_a_previous_ring() -> None:
    r1 = plan_ring(None, _pods(2), (), 7400)
    now, grace = 1_000_000, 15_000

    def members(pods: list[StorePod]) -> list[str]:
        return [m.id for m in plan_ring(r1, pods, (), 7400, now_ms=now, unready_grace_ms=grace).members]

    assert members([*_pods(2), _unready(2, now - 1)]) == ["p-store-0", "p-store-1"]  # never was a member
    assert members([_pods(2)[0], _unready(1, now - 1, terminating=True)]) == ["p-store-0"]  # being deleted
    assert members([_pods(2)[0], _unready(1, now - 1, ip="127.0.0.99")]) == ["p-store-0"]  # another pod
    assert members([_pods(2)[0], _unready(1, 0)]) == ["p-store-0"]  # no transition time known
    assert members([_pods(2)[0], _unready(1, now - 1)]) == ["p-store-0", "p-store-1"]


def test_observe_pods_reads_when_readiness_was_lost() -> None:
    [pod] = observe_pods([{"metadata": {"name": "p-store-0"}, "status": {"podIP": "10.0.0.1", "conditions": [
        {"type": "Ready", "status": "False", "lastTransitionTime": "2026-12-04T10:00:00Z"}]}}])
    assert not pod.usable and pod.unready_since_ms == 1_796_378_400_000
    [bad] = observe_pods([{"metadata": {"name": "p-store-0"}, "status": {"conditions": [
        {"type": "Ready", "status": "False", "lastTransitionTime": "yesterday"}]}}])
    assert bad.unready_since_ms == 0
