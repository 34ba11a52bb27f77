"""Scratch extents of the local tier (the pool ranges of a sparse read), in process: outside the
index, freed with their lease, and never freed under a fetch that is still landing bytes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvpool.sidecar.local_tier import LocalTier
from kvpool.wire.proto import store_pb2 as pb

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[LocalTier]:
    t = LocalTier(4 * MiB, str(tmp_path), label="scratch-test")
    yield t
    t.close()


def test_scratch_is_not_an_object_and_goes_with_its_lease(tier: LocalTier) -> None:
    _, lease = tier.lookup([], pb.BLOCK, 10_000)
    assert lease is not None
    [e] = tier.scratch([100 * KiB], lease)
    assert e is not None and tier.used >= 100 * KiB
    assert tier.objects() == 0 and tier.match_prefix(np.zeros(1, "V32"))[0] == 0
    assert tier.scratch_done(e, lease, keep=True)
    assert tier.used >= 100 * KiB  # still held by the lease for the client
    tier.release([lease.lease_id])
    assert tier.used == 0


def test_a_failed_fetch_frees_its_scratch_at_once(tier: LocalTier) -> None:
    _, lease = tier.lookup([], pb.BLOCK, 10_000)
    assert lease is not None
    [e] = tier.scratch([64 * KiB], lease)
    assert e is not None
    assert not tier.scratch_done(e, lease, keep=False)
    assert tier.used == 0 and e not in lease.entries
    tier.release([lease.lease_id])
    assert tier.used == 0


def test_a_lease_that_ends_mid_fetch_never_frees_the_extent_under_it(tier: LocalTier) -> None:
    _, lease = tier.lookup([], pb.BLOCK, 10_000)
    assert lease is not None
    [e] = tier.scratch([64 * KiB], lease)
    assert e is not None
    tier.release([lease.lease_id])  # as an expiry would: the fetch still writes into e
    assert tier.used >= 64 * KiB
    assert not tier.scratch_done(e, lease, keep=True)  # not to be handed out: the lease is gone
    assert tier.used == 0


def test_no_scratch_without_room_or_lease(tier: LocalTier) -> None:
    _, lease = tier.lookup([], pb.BLOCK, 10_000)
    assert lease is not None
    assert tier.scratch([0, 64 * MiB], lease) == [None, None]
    tier.release([lease.lease_id])
    assert tier.scratch([KiB], lease) == [None]  # a lease already gone
    assert tier.used == 0
