"""A store node's RDMA side (``kvpool/store/rdma.py``) on the simulated fabric: holds keep
extents in place for one-sided reads until released or expired, per tenant; ConnectRdma and
the hold calls are authenticated like the other data calls; a node without a device refuses
them (UNIMPLEMENTED)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvpool.core import errors
from kvpool.core.checksum import checksum
from kvpool.store.main import RunningStore, start_store
from kvpool.store.node import NodeConfig, StoreNode, Tenant
from kvpool.store.rdma import StoreRdma
from kvpool.transfer.rdma_sim import FabricContext
from kvpool.wire.counters import StoreCounter
from kvpool.wire.proto import store_pb2 as pb
from kvpool.wire.proto import store_pb2_grpc as pbg

MiB = 1 << 20


@pytest.fixture
def node_rdma(tmp_path: Path) -> Iterator[tuple[StoreNode, StoreRdma]]:
    node = StoreNode(NodeConfig(dram_bytes=8 * MiB, lease_ms_max=60_000))
    node.set_tenants([Tenant("a", "tok-a"), Tenant("b", "tok-b")])
    # Two tenants that trust each other: the holds' tenant checks are what is tested here.
    rdma = StoreRdma(node, FabricContext(str(tmp_path)), max_queue_pairs=2, sweep_seconds=3600,
                     shared_tenants=True)
    try:
        yield node, rdma
    finally:
        rdma.close()
        node.close()


def _put(node: StoreNode, tenant: str, key: bytes, value: bytes) -> int:
    codes, offsets, _, rid = node.put_start(tenant, [key], [len(value)], "default", pb.BLOCK)
    assert codes == [pb.OK]
    node.dram.view[offsets[0]:offsets[0] + len(value)] = value
    assert node.put_commit(tenant, rid, [checksum(value)]) == [pb.OK]
    return offsets[0]


def test_a_hold_keeps_the_extent_until_it_is_released(node_rdma: tuple[StoreNode, StoreRdma]) -> None:
    node, rdma = node_rdma
    key, value = os.urandom(32), os.urandom(MiB)
    offset = _put(node, "a", key, value)
    hold_id, codes, found = rdma.hold("a", [key, os.urandom(32)], pb.BLOCK, 5000)
    assert hold_id and codes == [pb.OK, pb.NOT_FOUND] and found[0] is not None and found[0].offset == offset
    assert node.remove("a", [key]) == [pb.OK]  # gone for everyone else at once...
    again = _put(node, "a", key, os.urandom(MiB))
    assert again != offset  # ...but its extent stays with the hold
    assert bytes(node.dram.slice(offset, MiB)) == value
    rdma.release("b", [hold_id])  # another tenant's release ends nothing
    assert rdma.held() == 1
    rdma.release("a", [hold_id])
    assert rdma.held() == 0
    # Freed now: the next object of that size may take it.
    assert offset in {_put(node, "a", os.urandom(32), os.urandom(MiB)) for _ in range(3)}


def test_a_hold_expires_when_its_reader_never_releases_it(node_rdma: tuple[StoreNode, StoreRdma]) -> None:
    node, rdma = node_rdma
    key = os.urandom(32)
    _put(node, "a", key, os.urandom(4096))
    hold_id, _, found = rdma.hold("a", [key], pb.BLOCK, 50)
    assert hold_id and found[0] is not None and found[0].inflight == 1
    time.sleep(0.1)
    assert rdma.sweep() == 1
    assert found[0].inflight == 0 and rdma.held() == 0
    assert node.stats()["counters"][StoreCounter.RDMA_HOLDS_EXPIRED] == 1  # type: ignore[index]
    assert rdma.hold("a", [os.urandom(32)], pb.BLOCK, 50)[0] == 0  # nothing found, nothing held
    assert rdma.hold("b", [key], pb.BLOCK, 50)[1] == [pb.NOT_FOUND]  # tenants' keys are apart


def test_a_reservation_for_writes_holds_its_slots_until_the_commit(node_rdma: tuple[StoreNode, StoreRdma]) -> None:
    node, rdma = node_rdma
    keys, values = [os.urandom(32) for _ in range(2)], [os.urandom(4096), os.urandom(100)]
    codes, offsets, rid = rdma.reserve("a", keys, [len(v) for v in values], "default", pb.BLOCK, 50, 0)
    assert codes == [pb.OK, pb.OK] and rid and rdma.held() == 1
    for off, v in zip(offsets, values, strict=True):  # what the writer's RDMA WRITEs do
        node.dram.view[off:off + len(v)] = v
    assert rdma.commit("b", rid, [checksum(v) for v in values], revoke=False) != [pb.OK, pb.OK]  # not b's
    assert rdma.commit("a", rid, [checksum(v) for v in values], revoke=False) == [pb.OK, pb.OK]
    assert rdma.held() == 0
    assert [node.where("a", k) for k in keys] == ["dram", "dram"]
    # A revoke publishes nothing; a reservation never committed releases its slots at expiry.
    codes, _, rid = rdma.reserve("a", [os.urandom(32)], [4096], "default", pb.BLOCK, 50, 0)
    assert rdma.commit("a", rid, [], revoke=True) == [] and node.stats()["counters"][StoreCounter.REVOKED] == 1  # type: ignore[index]
    codes, _, rid = rdma.reserve("a", [os.urandom(32)], [4096], "default", pb.BLOCK, 50, 0)
    time.sleep(0.1)
    assert rdma.sweep() == 1 and rdma.held() == 0


def test_connect_checks_the_endpoint_and_bounds_the_queue_pairs(node_rdma: tuple[StoreNode, StoreRdma],
                                                                tmp_path: Path) -> None:
    node, rdma = node_rdma
    with pytest.raises(ValueError):
        rdma.connect(b"\x01\x02")
    with pytest.raises(errors.Unavailable):
        rdma.connect(FabricContext(str(tmp_path / "elsewhere")).create_queue_pair().endpoint.encode())
    peer = FabricContext(str(tmp_path))
    try:
        qps = [peer.create_queue_pair() for _ in range(3)]
        for qp in qps:
            rdma.connect(qp.endpoint.encode())
        assert node.stats()["counters"][StoreCounter.RDMA_CONNECTS] == 3  # type: ignore[index]
        assert rdma.connected() == 2  # the oldest was closed
    finally:
        peer.close()


def test_a_node_several_tenants_share_refuses_one_sided_access(tmp_path: Path) -> None:
    """One rkey reads the whole arena: with two tenants on the node (and no word that they trust
    each other) connect, holds and reservations are refused; with one tenant they are served."""
    node = StoreNode(NodeConfig(dram_bytes=8 * MiB))
    rdma = StoreRdma(node, FabricContext(str(tmp_path)), sweep_seconds=3600)
    peer = FabricContext(str(tmp_path))
    try:
        node.set_tenants([Tenant("a", "tok-a")])
        key = os.urandom(32)
        _put(node, "a", key, os.urandom(4096))
        rdma.connect(peer.create_queue_pair().endpoint.encode())
        hold_id, codes, _ = rdma.hold("a", [key], pb.BLOCK, 5000)
        assert hold_id and codes == [pb.OK]
        rdma.release("a", [hold_id])
        node.set_tenants([Tenant("a", "tok-a"), Tenant("b", "tok-b")])
        with pytest.raises(errors.PermissionDenied, match="2 tenants share it"):
            rdma.connect(peer.create_queue_pair().endpoint.encode())
        with pytest.raises(errors.PermissionDenied):
            rdma.hold("a", [key], pb.BLOCK, 5000)  # a reader connected before loses RDMA too
        with pytest.raises(errors.PermissionDenied):
            rdma.reserve("a", [os.urandom(32)], [4096], "default", pb.BLOCK, 0, 0)
        assert rdma.held() == 0
    finally:
        peer.close()
        rdma.close()
        node.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[RunningStore, RunningStore]]:
    cfg = NodeConfig(dram_bytes=8 * MiB, open_tenancy=False, rdma=f"sim:{tmp_path}")
    with_device = start_store(cfg, "127.0.0.1:0", 0)
    without = start_store(NodeConfig(dram_bytes=8 * MiB, open_tenancy=False, rdma="off"), "127.0.0.1:0", 0)
    for s in (with_device, without):
        s.node.set_tenants([Tenant("a", "tok-a")])
    try:
        yield with_device, without
    finally:
        with_device.stop(0)
        without.stop(0)


def test_rdma_calls_are_authenticated_and_need_a_device(served: tuple[RunningStore, RunningStore],
                                                        tmp_path: Path) -> None:
    with_device, without = served
    qp = FabricContext(str(tmp_path)).create_queue_pair()
    request = pb.ConnectRdmaRequest(endpoint=qp.endpoint.encode())
    for store, token, code in ((with_device, "", grpc.StatusCode.UNAUTHENTICATED),
                               (with_device, "wrong", grpc.StatusCode.UNAUTHENTICATED),
                               (without, "tok-a", grpc.StatusCode.UNIMPLEMENTED)):
        with grpc.insecure_channel(store.address) as channel:
            stub = pbg.StoreDataStub(channel)
            meta = (("authorization", f"Bearer {token}"),) if token else ()
            for call, req in ((stub.ConnectRdma, request),
                              (stub.HoldExtents, pb.HoldExtentsRequest(keys=os.urandom(32))),
                              (stub.ReleaseExtents, pb.ReleaseExtentsRequest(hold_ids=[1]))):
                with pytest.raises(grpc.RpcError) as err:
                    call(req, timeout=10, metadata=meta)
                assert err.value.code() == code
    with grpc.insecure_channel(with_device.address) as channel:
        reply = pbg.StoreDataStub(channel).ConnectRdma(request, timeout=10,
                                                       metadata=(("authorization", "Bearer tok-a"),))
        assert reply.endpoint and reply.arena_key and reply.incarnation == with_device.node.incarnation
    qp.close()
