"""Tenant isolation through the sidecars: the same keys of two tenants are two objects, and a
sidecar sees only its own tenant's data (the tenant comes from its credentials, never the client)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvpool.apps.cluster import LocalCluster
from kvpool.core import errors
from kvpool.core.keys import KeySpace
from kvpool.pool.node_client import StoreClient
from kvpool.wire.counters import SidecarCounter
from kvpool.wire.proto import store_pb2 as pb

KiB, MiB = 1 << 10, 1 << 20


# Sidecars 0/2 are tenant alpha, 1/3 tenant beta: 2 and 3 start with empty local tiers.
CLUSTER = dict(stores=1, sidecars=4, store_bytes=64 * MiB, local_bytes=16 * MiB,
               tenants=["alpha", "beta", "alpha", "beta"])


@pytest.fixture
def lc(module_cluster: LocalCluster) -> LocalCluster:
    return module_cluster


def _settle(h: Any, *clients: Any) -> None:
    for c in clients:
        h.wait_for(lambda c=c: c.stats().pending_pool_bytes == 0, what="write-through backlog")


def test_sidecars_act_as_their_configured_tenant(lc: LocalCluster) -> None:
    for i, want in enumerate(["alpha", "beta", "alpha", "beta"]):
        with lc.connect(i) as c:
            assert c.tenant_id == want


def test_same_tokens_other_tenant_matches_nothing(lc: LocalCluster, h: Any, rng: random.Random) -> None:
    ks = KeySpace(model="tenancy-test", block_tokens=lc.block_tokens)
    tokens = [rng.randrange(50000) for _ in range(lc.block_tokens * 6 + 17)]
    keys = ks.block_keys(tokens)
    assert len(keys) == 6
    values = h.values(rng, [32 * KiB] * 6)
    state = rng.randbytes(4000)
    with lc.connect(0) as alpha, lc.connect(1) as beta, lc.connect(2) as alpha2:
        assert alpha.put(keys, values) == [pb.OK] * 6
        assert alpha.put_state(keys[5], 6 * lc.block_tokens, state) == pb.OK
        assert alpha.flush().dropped_objects == 0  # the state object reaches the pool too
        _settle(h, alpha)
        # The same tenant on another sidecar finds everything in the pool...
        assert alpha2.match(keys) == 6
        with alpha2.get(keys) as got:
            assert [bytes(v) for v in got] == values
        assert bytes(alpha2.get_state(keys[5], 6 * lc.block_tokens) or b"") == state
        # ...the other tenant, with the very same tokens and keys, finds nothing.
        assert beta.match(keys) == 0
        with pytest.raises(errors.NotFound):
            beta.get(keys[:1])
        assert beta.get_into(keys, [bytearray(32 * KiB) for _ in keys]) == [-1] * 6
        assert beta.get_state(keys[5], 6 * lc.block_tokens) is None
        assert beta.has_states([keys[5]]) == [False]
        plan = beta.plan(len(tokens), keys)
        assert plan.hit_tokens == 0
        assert h.counters(beta).get(SidecarCounter.READ_HITS_POOL, 0) == 0


def test_each_tenant_reads_only_its_own_objects(lc: LocalCluster, h: Any, rng: random.Random) -> None:
    keys = h.keys(rng, 12)
    mine = h.values(rng, [rng.randrange(1, 200 * KiB) for _ in keys])
    theirs = h.values(rng, [rng.randrange(1, 200 * KiB) for _ in keys])
    with lc.connect(0) as alpha, lc.connect(1) as beta:
        assert alpha.put(keys, mine) == [pb.OK] * 12
        assert beta.put(keys, theirs) == [pb.OK] * 12  # same keys, another tenant: new objects
        _settle(h, alpha, beta)
    # Fresh sidecars (empty local tiers) of each tenant read through the pool.
    with lc.connect(2) as alpha2, lc.connect(3) as beta2:
        assert alpha2.match(keys) == 12 and beta2.match(keys) == 12
        with alpha2.get(keys) as a, beta2.get(keys) as b:
            assert [bytes(v) for v in a] == mine
            assert [bytes(v) for v in b] == theirs


def test_store_nodes_keep_tenants_apart(lc: LocalCluster, h: Any, rng: random.Random) -> None:
    keys = h.keys(rng, 16)
    values = h.values(rng, [8 * KiB] * 16)
    with lc.connect(1) as beta:
        assert beta.put(keys, values) == [pb.OK] * 16
        _settle(h, beta)
    held = {t: 0 for t in ("alpha", "beta", "default")}
    for i in range(len(lc.stores)):
        for t, used in h.store_tenant_bytes(lc, i).items():
            held[t] = held.get(t, 0) + used
    assert held["beta"] >= 16 * 8 * KiB and held["alpha"] > 0 and held["default"] == 0
    for addr in lc.stores:
        # A closed pool: no token, or a made-up one, is refused; alpha's token sees none of beta's keys.
        with StoreClient(addr) as anon, pytest.raises(errors.Unauthenticated):
            anon.exists(keys)
        with StoreClient(addr, "not-a-token") as forged, pytest.raises(errors.Unauthenticated):
            forged.exists(keys)
        with StoreClient(addr, lc.tokens["alpha"]) as alpha, StoreClient(addr, lc.tokens["beta"]) as beta_c:
            assert not any(alpha.exists(keys, prefix_only=False).present)
            assert alpha.get(keys) == [None] * 16
            assert any(beta_c.exists(keys, prefix_only=False).present)
