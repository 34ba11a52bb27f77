"""The ring from ready store pods: members, states, epochs."""

from kvpool.ring import Ring
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
