"""The operator's calls to store nodes: what reaches the node's admin API, what comes back.

A real gRPC server on 127.0.0.1 stands in for the node's ``StoreAdmin`` (it records the requests
and answers canned statuses), so the whole path (Nodes → AdminClient → the wire) is exercised."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from kvpool.core.push_status import DrainStatus
from kvpool.core.ring import Member, Ring
from kvpool.store.admin_service import AdminGate
from kvpool.wire.convert import drain_status_from_pb, ring_to_pb
from kvpool.wire.proto import store_pb2 as pb
from kvpool.wire.proto import store_pb2_grpc as pbg
from kvpool_operator import drain, rebalance
from kvpool_operator.nodes import Nodes, NodeUnreachable
from kvpool_operator.push_jobs import status_counters

ADMIN = "adm-token"


class _Admin(pbg.StoreAdminServicer):
    def __init__(self) -> None:
        self.seen: list[tuple[str, Any]] = []

    def Warm(self, request: pb.WarmRequest, context: grpc.ServicerContext) -> pb.WarmStatus:
        self.seen.append(("Warm", request))
        return pb.WarmStatus(state="running", epoch=request.ring.epoch, planned_objects=4)

    def GetDrainStatus(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.DrainStatus:
        self.seen.append(("GetDrainStatus", request))
        return pb.DrainStatus()  # a node that never drained: every field unset


@pytest.fixture
def node() -> Iterator[tuple[str, _Admin]]:
    servicer = _Admin()
    server = grpc.server(futures.ThreadPoolExecutor(2), interceptors=[AdminGate(ADMIN)])
    pbg.add_StoreAdminServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(0).wait(10)


def test_ring_to_pb() -> None:
    ring = Ring(7, (Member("a", "1.2.3.4:7400", "active", "1.2.3.4:7401"), Member("b", "x:1", "draining")), 2)
    msg = ring_to_pb(ring)
    assert (msg.epoch, msg.replicas) == (7, 2)
    assert [(m.id, m.address, m.state, m.transfer_address) for m in msg.members] == [
        ("a", "1.2.3.4:7400", "active", "1.2.3.4:7401"), ("b", "x:1", "draining", "")]


def test_drain_status_from_pb_gives_the_status_counters() -> None:
    st = drain_status_from_pb(pb.DrainStatus(state="running", moved_objects=3, moved_bytes=30, dropped_objects=1,
                                             dropped_bytes=10, remaining_objects=2, deadline_unix_ms=99, epoch=4))
    assert status_counters(st, drain.COUNTERS) == {"movedObjects": 3, "movedBytes": 30, "droppedObjects": 1,
                                                   "droppedBytes": 10, "remainingObjects": 2}
    assert (st.state, st.epoch, st.deadline_unix_ms) == ("running", 4, 99)


def test_warm_request_carries_the_removed_members(node: tuple[str, _Admin]) -> None:
    address, servicer = node
    nodes = Nodes()
    try:
        st = nodes.warm(address, ADMIN, Ring(5, (Member("a", address),), 2), [], 99, 10, 0.0, ["b"])
    finally:
        nodes.close()
    assert (st.state, st.epoch) == ("running", 5)
    assert status_counters(st, rebalance.COUNTERS)["plannedObjects"] == 4
    method, req = servicer.seen[0]
    assert method == "Warm" and list(req.removed) == ["b"] and list(req.added) == []
    assert (req.deadline_unix_ms, req.max_bytes_per_second, req.ring.replicas) == (99, 10, 2)


def test_an_unset_status_is_idle(node: tuple[str, _Admin]) -> None:
    address, _ = node
    nodes = Nodes()
    try:
        assert nodes.drain_status(address, ADMIN) == DrainStatus(state="idle")
    finally:
        nodes.close()


def test_a_refused_or_silent_node_is_unreachable(node: tuple[str, _Admin]) -> None:
    address, servicer = node
    nodes = Nodes(timeout=2.0)
    try:
        with pytest.raises(NodeUnreachable, match="GetDrainStatus: PermissionDenied"):
            nodes.drain_status(address, "a-tenant-token")
        assert servicer.seen == []  # refused before the node's method ran
        with pytest.raises(NodeUnreachable, match="store node 127.0.0.1:9: GetDrainStatus: Unavailable"):
            nodes.drain_status("127.0.0.1:9", ADMIN)  # nothing listens there
    finally:
        nodes.close()


def test_a_rotation_of_the_operators_files_makes_a_new_admin_client(tmp_path: Any) -> None:
    """A gRPC channel keeps the credentials it was made with: once a renewal or a CA rotation
    rewrote the operator's files, the next call gets a client made from the new ones."""
    pytest.importorskip("cryptography", reason="the certificate builders need the dataplane extra")
    from kvpool.core import pki
    from kvpool.wire import tls

    ca = pki.make_ca()
    cfg = tls.write_dir(str(tmp_path), pki.issue(ca, pki.operator()), ca.cert_pem)
    nodes = Nodes(timeout=1)
    try:
        nodes.use_tls(["127.0.0.1:9"], cfg)
        first = nodes._client("127.0.0.1:9", ADMIN)
        assert nodes._client("127.0.0.1:9", ADMIN) is first
        other = pki.make_ca()
        tls.write_dir(str(tmp_path), pki.issue(other, pki.operator()), pki.bundle(other.cert_pem, ca.cert_pem))
        assert nodes._client("127.0.0.1:9", ADMIN) is not first
    finally:
        nodes.close()
