"""Tenant isolation on a real node: partitions, tokens, admin calls, quotas."""

from __future__ import annotations

import base64
import random
from typing import Any

import grpc
import pytest

from kvpool.core import errors
from kvpool.wire.counters import StoreCounter
from kvpool.wire.proto import store_pb2 as pb

KiB = 1 << 10

TENANTS = [
    {"tenantId": "alpha", "token": "tok-alpha", "salt": base64.b64encode(b"salt-a").decode()},
    {"tenantId": "beta", "token": "tok-beta", "salt": base64.b64encode(b"salt-b").decode()},
]


@pytest.fixture(scope="module")
def nodes(module_stores: Any) -> Any:
    fs = module_stores.tmp / "fs"
    closed = {"dram": "8MiB", "tenants": TENANTS, "closed": True}
    return module_stores.start_many({
        "iso": closed,
        "admin": {"dram": "8MiB", "tenants": TENANTS, "admin_token": "adm"},
        "fs_a": {"dram": "1MiB", "tenants": TENANTS, "closed": True, "sharedfs": fs},
        "fs_b": {"dram": "4MiB", "tenants": TENANTS, "closed": True, "sharedfs": fs},
        "fs_nosalt": {"dram": "1MiB", "tenants": NO_SALT, "sharedfs": module_stores.tmp / "fs-nosalt"}})


NO_SALT = [{"tenantId": "gamma", "token": "tok-gamma"}, {"tenantId": "delta", "token": "tok-delta"}]


def test_same_key_two_tenants_two_objects(nodes: Any, h: Any, rng: random.Random) -> None:
    node = nodes["iso"]
    a, b = node.client("tok-alpha"), node.client("tok-beta")
    objects0 = h.stats_tenant(a.stats(), "alpha").objects
    keys = h.rand_keys(rng, 4)
    va = h.rand_values(rng, [10 * KiB] * 4)
    assert a.put(keys, va) == [pb.OK] * 4
    # The second tenant sees nothing of the first one's objects...
    assert b.exists(keys, prefix_only=False).present == [False] * 4
    assert b.get(keys) == [None] * 4
    assert b.remove(keys) == [pb.NOT_FOUND] * 4
    # ...writes its own under the same keys (not ALREADY_EXISTS)...
    vb = h.rand_values(rng, [3 * KiB] * 4)
    assert b.put(keys, vb) == [pb.OK] * 4
    # ...and each reads its own bytes.
    assert [bytes(g) for g in a.get(keys) if g is not None] == va
    assert [bytes(g) for g in b.get(keys) if g is not None] == vb
    # A tenant sees only its own usage.
    sa = a.stats()
    assert [t.tenant_id for t in sa.tenants] == ["alpha"]
    assert h.stats_tenant(sa, "alpha").objects == objects0 + 4


def test_unknown_or_missing_token_is_unauthenticated(nodes: Any, h: Any, rng: random.Random) -> None:
    node = nodes["iso"]
    keys = h.rand_keys(rng, 2)
    for token in ("tok-nobody", ""):
        c = node.client(token)
        with pytest.raises(errors.Unauthenticated):
            c.exists(keys)
        with pytest.raises(errors.Unauthenticated):
            c.put(keys, [b"x", b"y"])
        with pytest.raises(errors.Unauthenticated):
            c.get(keys)
        with pytest.raises(errors.Unauthenticated):
            c.remove(keys)
        with pytest.raises(errors.Unauthenticated):
            c.stats()
    # The raw status code, for clients in other languages.
    stub = node.stub()
    with pytest.raises(grpc.RpcError) as ei:
        stub.Remove(pb.RemoveRequest(keys=keys[0]), metadata=h.bearer("tok-nobody"), timeout=10)
    assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # Health is open (probes), and the node keeps serving tenants.
    assert node.client().health().ok
    assert node.client("tok-alpha").put(keys, [b"x", b"y"]) == [pb.OK, pb.OK]


def test_admin_calls_need_the_admin_token(nodes: Any, h: Any) -> None:
    node = nodes["admin"]
    ring = pb.Ring(epoch=3, members=[pb.RingMember(id=node.node_id, address=node.address, state="active")])
    for token in ("", "tok-alpha", "wrong"):
        with pytest.raises(errors.PermissionDenied):
            node.admin(token).set_ring(ring)
    assert node.admin("adm").set_ring(ring).epoch == 3
    assert node.client().get_ring().epoch == 3


def test_sharedfs_objects_are_per_tenant(nodes: Any, h: Any, rng: random.Random) -> None:
    a = nodes["fs_a"].client("tok-alpha")
    keys = h.rand_keys(rng, 16)
    vals = h.rand_values(rng, [128 * KiB] * 16)
    for i in range(0, 16, 4):
        assert a.put(keys[i:i + 4], vals[i:i + 4]) == [pb.OK] * 4
    assert a.stats().counters[StoreCounter.DEMOTED] > 0
    other = nodes["fs_b"]  # a second node on the same shared directory
    assert other.client("tok-beta").exists(keys, prefix_only=False).present == [False] * 16
    assert other.client("tok-beta").get(keys[:4]) == [None] * 4
    got = other.client("tok-alpha").get(keys[:4])
    assert all(g is not None and bytes(g) == v for g, v in zip(got, vals[:4], strict=True))


def test_tenants_without_salt_do_not_share_shared_fs_files(nodes: Any, h: Any, rng: random.Random) -> None:
    node = nodes["fs_nosalt"]
    g = node.client("tok-gamma")
    keys = h.rand_keys(rng, 16)
    vals = h.rand_values(rng, [128 * KiB] * 16)
    for i in range(0, 16, 4):
        assert g.put(keys[i:i + 4], vals[i:i + 4]) == [pb.OK] * 4
    assert g.stats().counters[StoreCounter.DEMOTED] > 0
    for token in ("tok-delta", ""):  # another tenant, and the open default tenant
        c = node.client(token)
        assert c.exists(keys, prefix_only=False).present == [False] * 16
        assert c.get(keys[:4]) == [None] * 4
    assert [bytes(x) if x is not None else None for x in g.get(keys[:4])] == vals[:4]
