"""The two credentials of a store node, on a real node: a tenant's token reaches no ``StoreAdmin``
method, the admin token reaches every one, and ``StoreData`` treats the admin token as it always
did (no tenant: its tenant calls are UNAUTHENTICATED; Stats shows every tenant).

The methods are enumerated from the service descriptors, so a method added to either service
fails here until the test says what it expects of it."""

from __future__ import annotations

import base64
import itertools
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from kvpool.wire.proto import store_pb2 as pb

ADMIN = "adm-secret"
TENANTS = [{"tenantId": "alpha", "token": "tok-alpha", "salt": base64.b64encode(b"salt-a").decode()},
           {"tenantId": "beta", "token": "tok-beta", "quotaBytes": 1 << 20}]
ADMIN_SERVICE = pb.DESCRIPTOR.services_by_name["StoreAdmin"]
DATA_SERVICE = pb.DESCRIPTOR.services_by_name["StoreData"]
REFUSED = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)


def _call(node: Any, service: Any, method: str, request: Any, token: str) -> tuple[grpc.StatusCode, Any]:
    """One call by the descriptor's names (no generated stub: what is enumerated is what is called)."""
    m = service.methods_by_name[method]
    ch = node._channel()
    rpc = ch.unary_unary(f"/{service.full_name}/{m.name}", request_serializer=lambda r: r.SerializeToString(),
                         response_deserializer=getattr(pb, m.output_type.name).FromString)
    md = (("authorization", f"Bearer {token}"),) if token else ()
    try:
        return grpc.StatusCode.OK, rpc(request, timeout=10, metadata=md)
    except grpc.RpcError as err:
        return err.code(), err.details()


def _admin_requests(node: Any) -> dict[str, Callable[[], Any]]:
    """A request each ``StoreAdmin`` method serves (rings of rising epochs; the node holds no
    object, so its drain and warm-up finish at once without reaching the absent peer)."""
    epochs = itertools.count(1)
    peer = pb.RingMember(id="peer", address="127.0.0.1:9", state="active")

    def ring(state: str = "active") -> pb.Ring:
        return pb.Ring(epoch=next(epochs), members=[
            pb.RingMember(id=node.node_id, address=node.address, state=state), peer])

    return {
        "SetRing": lambda: ring(),
        "SetTenants": lambda: pb.SetTenantsRequest(tenants=[pb.TenantConfig(
            tenant_id="beta", token="tok-beta", quota_bytes=1)]),  # the refused calls try to shrink a quota
        "SetPolicy": lambda: pb.PolicyRequest(ttl_seconds={"chatbot": 60}, high_watermark=0.9, low_watermark=0.8),
        "Drain": lambda: pb.DrainRequest(ring=ring("draining"), deadline_unix_ms=2**42),
        "GetDrainStatus": pb.Empty,
        "Warm": lambda: pb.WarmRequest(ring=ring(), added=["peer"], deadline_unix_ms=2**42),
        "GetWarmStatus": pb.Empty,
    }


@pytest.fixture
def nodes(stores: Any) -> Any:
    return stores.start_many({"guarded": {"dram": "8MiB", "tenants": TENANTS, "admin_token": ADMIN},
                              "dev": {"dram": "8MiB", "tenants": TENANTS}})


def test_every_admin_method_refuses_a_tenant_token_and_serves_the_admin_token(nodes: Any, h: Any) -> None:
    node = nodes["guarded"]
    requests = _admin_requests(node)
    assert set(requests) == set(ADMIN_SERVICE.methods_by_name), "a StoreAdmin method this test does not know"
    for method, token in itertools.product(ADMIN_SERVICE.methods_by_name, ["tok-alpha", "tok-beta", "", "bogus"]):
        code, detail = _call(node, ADMIN_SERVICE, method, requests[method](), token)
        assert code in REFUSED, f"{method} with token {token!r}: {code} {detail}"
    # Nothing the refused calls asked for happened.
    data = node.stub()
    assert data.GetRing(pb.Empty(), timeout=10).epoch == 0
    assert h.stats_tenant(node.admin(ADMIN).stats(), "beta").quota_bytes == 1 << 20
    assert node.admin(ADMIN).drain_status().state == "idle" and node.admin(ADMIN).warm_status().state == "idle"
    # The admin token: every method served.
    requests = _admin_requests(node)
    for method in ADMIN_SERVICE.methods_by_name:
        code, detail = _call(node, ADMIN_SERVICE, method, requests[method](), ADMIN)
        assert code == grpc.StatusCode.OK, f"{method} with the admin token: {code} {detail}"
    assert data.GetRing(pb.Empty(), timeout=10).epoch == 3  # SetRing, Drain and Warm each published one
    assert h.stats_tenant(node.admin(ADMIN).stats(), "beta").quota_bytes == 1
    assert h.wait_for(lambda: node.admin(ADMIN).drain_status().state == "done", 30, what="the empty drain")
    assert h.wait_for(lambda: node.admin(ADMIN).warm_status().state == "done", 30, what="the empty warm-up")


def test_a_node_without_an_admin_token_takes_admin_calls_only_without_a_token(nodes: Any) -> None:
    """A dev pool (no admin token): the operator's calls carry none; a tenant's token is still refused."""
    node = nodes["dev"]
    requests = _admin_requests(node)
    for method in ADMIN_SERVICE.methods_by_name:
        for token in ("tok-alpha", "bogus"):
            code, detail = _call(node, ADMIN_SERVICE, method, requests[method](), token)
            assert code in REFUSED, f"{method} with token {token!r}: {code} {detail}"
    assert node.stub().GetRing(pb.Empty(), timeout=10).epoch == 0
    requests = _admin_requests(node)
    for method in ADMIN_SERVICE.methods_by_name:
        code, detail = _call(node, ADMIN_SERVICE, method, requests[method](), "")
        assert code == grpc.StatusCode.OK, f"{method} without a token: {code} {detail}"


def test_data_calls_with_the_admin_token_are_handled_as_before(nodes: Any, h: Any) -> None:
    """The admin token names no tenant: the tenant calls refuse it; the open calls serve it; Stats
    shows it every tenant (a tenant sees only its own)."""
    node = nodes["guarded"]
    key = b"k" * 32
    requests: dict[str, Any] = {
        "Release": pb.ReleaseRequest(lease_ids=[1]), "Remove": pb.RemoveRequest(keys=key),
        "Stats": pb.Empty(), "GetRing": pb.Empty(), "Health": pb.Empty(),
        # A data-session ticket is a tenant's (its tenant comes from the token).
        "DataTicket": pb.Empty(),
        # RDMA's out-of-band calls are a tenant's too (this node has no device: the tenant check
        # comes first, so the admin token is refused before the device is asked for).
        "ConnectRdma": pb.ConnectRdmaRequest(), "HoldExtents": pb.HoldExtentsRequest(keys=key),
        "ReleaseExtents": pb.ReleaseExtentsRequest(hold_ids=[1]),
        "ReserveRdma": pb.ReserveRdmaRequest(keys=key, sizes=[8]),
        "CommitRdma": pb.CommitRdmaRequest(reservation_id=1)}
    served = {"Stats", "GetRing", "Health"}
    assert set(requests) == set(DATA_SERVICE.methods_by_name), "a StoreData method this test does not know"
    for method, request in requests.items():
        code, reply = _call(node, DATA_SERVICE, method, request, ADMIN)
        if method in served:
            assert code == grpc.StatusCode.OK, f"{method}: {code} {reply}"
        else:
            assert code == grpc.StatusCode.UNAUTHENTICATED, f"{method} with the admin token: {code} {reply}"
    _, stats = _call(node, DATA_SERVICE, "Stats", pb.Empty(), ADMIN)
    assert {t.tenant_id for t in stats.tenants} >= {"alpha", "beta"}
    _, own = _call(node, DATA_SERVICE, "Stats", pb.Empty(), "tok-alpha")
    assert [t.tenant_id for t in own.tenants] == ["alpha"]
    # And a tenant's data calls work beside it.
    assert node.client("tok-alpha").put([key], [b"x" * 8]) == [pb.OK]
