"""Sidecars read and write store nodes one-sided over RDMA (the simulated fabric,
``KVPOOL_RDMA=sim:DIR``, between real processes): connection set-up, byte-exact reads into the
sidecar's buffers and the client's registered memory, byte-exact writes (the pool writes of a
put), the store's hold keeping an extent in place under a read, and every fallback to TCP —
sidecar without a device, node without one, a connection that fails, a link lost in the middle
of a batch, bytes that do not match their checksum — counted by reason, with the reads and
writes still exact.

The simulated READ copies from the node's arena pages mapped in the sidecar's process
(``kvpool/transfer/rdma_sim.py``): the node's CPU takes no part in moving the bytes.
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kvpool
from kvpool.apps.cluster import LocalCluster
from kvpool.core.deadlines import ClientDeadlines
from kvpool.pool.node_client import StoreClient
from kvpool.transfer.rdma import RDMA_ENV, rdma_status
from kvpool.wire.counters import SidecarCounter, StoreCounter
from kvpool.wire.proto import store_pb2 as pb

KiB, MiB = 1 << 10, 1 << 20
# Generous deadlines: the shared cores of a test run must not turn a read into a miss.
SLOW_OK = ["--read-deadline-ms", "10000", "--match-deadline-ms", "5000"]


@contextlib.contextmanager
def _env(value: str) -> Iterator[None]:
    """``$KVPOOL_RDMA`` for the processes started inside (they inherit this process's environment)."""
    old = os.environ.get(RDMA_ENV)
    os.environ[RDMA_ENV] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(RDMA_ENV, None)
        else:
            os.environ[RDMA_ENV] = old


class Fabric:
    """The cluster of these tests: one store node on the simulated fabric; sidecar 0 on it too,
    sidecar 1 without a device, sidecar 2 on another fabric (its connect cannot succeed)."""

    def __init__(self, lc: LocalCluster, directory: str) -> None:
        self.lc, self.dir = lc, directory

    def fault(self, what: str | None) -> None:
        path = os.path.join(self.dir, "fault")
        if what is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        else:
            with open(path, "w") as f:
                f.write(what)

    def written(self, rng: random.Random, sizes: list[int]) -> tuple[list[bytes], list[bytes]]:
        """Objects written straight into the node (no sidecar has them in its local tier)."""
        keys = [rng.randbytes(32) for _ in sizes]
        values = [rng.randbytes(s) for s in sizes]
        with StoreClient(self.lc.stores[0]) as node:
            assert node.put(keys, values) == [pb.OK] * len(keys)
        return keys, values

    def store_counters(self) -> dict[str, int]:
        with StoreClient(self.lc.stores[0]) as node:
            return dict(node.stats().counters)


CLUSTER = {"stores": 1, "sidecars": 0, "store_bytes": 96 * MiB, "local_bytes": 32 * MiB}


@pytest.fixture(scope="module")
def fabric_dir() -> Iterator[str]:
    """The fabric, named in ``$KVPOOL_RDMA`` while the module's cluster starts (its store node)."""
    with tempfile.TemporaryDirectory(prefix="kvpool-fabric-") as d, _env(f"sim:{d}"):
        yield d


@pytest.fixture(scope="module")
def fabric(fabric_dir: str, module_cluster: LocalCluster) -> Iterator[Fabric]:
    lc = module_cluster
    with tempfile.TemporaryDirectory(prefix="kvpool-fabric-other-") as other:
        lc.add_sidecar(extra_args=SLOW_OK)
        with _env("off"):
            lc.add_sidecar(extra_args=SLOW_OK)
        with _env(f"sim:{other}"):
            lc.add_sidecar(extra_args=SLOW_OK)
        yield Fabric(lc, fabric_dir)


def _connect(lc: LocalCluster, i: int) -> Any:
    """A client whose bounds leave room for a read the fabric delays, on shared cores."""
    return kvpool.connect(lc.sidecars[i], deadlines=ClientDeadlines(10.0, 10.0, 100e6, 10.0))


def _grew(after: dict[str, int], before: dict[str, int], name: str) -> int:
    return int(after.get(name, 0) - before.get(name, 0))


def _rdma_up(h: Any, f: Fabric, client: Any, rng: random.Random) -> None:
    """Wait until ``client``'s sidecar reads one-sided again (a link dropped by an earlier test
    is reconnected ``retry_seconds`` later)."""
    f.fault(None)

    def one_sided() -> bool:
        keys, values = f.written(rng, [4 * KiB])  # a new object each time: a read keeps it local
        before = h.counters(client)
        buf = np.zeros(4 * KiB, np.uint8)
        assert client.get_into(keys, [buf]) == [4 * KiB] and buf.tobytes() == values[0]
        return _grew(h.counters(client), before, SidecarCounter.RDMA_READS) == 1
    h.wait_for(one_sided, 60, "the sidecar's RDMA link to come back")


def test_reads_are_one_sided_and_byte_exact(fabric: Fabric, h: Any, rng: random.Random) -> None:
    with _connect(fabric.lc, 0) as a:
        _rdma_up(h, fabric, a, rng)
        sizes = [1, 4095, 64 * KiB, MiB, 3 * MiB + 5, 17]
        keys, values = fabric.written(rng, sizes)
        before, store_before = h.counters(a), fabric.store_counters()
        bufs = [np.zeros(s, np.uint8) for s in sizes]
        assert a.get_into(keys, bufs) == sizes
        assert [b.tobytes() for b in bufs] == values
        after, store_after = h.counters(a), fabric.store_counters()
        assert _grew(after, before, SidecarCounter.RDMA_READS) == len(keys)
        assert _grew(after, before, SidecarCounter.RDMA_READ_BYTES) == sum(sizes)
        assert not any(_grew(after, before, c) for c in SidecarCounter if c.startswith("rdma_fallback_"))
        assert _grew(store_after, store_before, StoreCounter.RDMA_HOLDS) == 1  # one hold for the batch
        assert store_after.get(StoreCounter.RDMA_CONNECTS, 0) >= 1
        # The hold was released, not left to expire.
        assert _grew(store_after, store_before, StoreCounter.RDMA_HOLDS_EXPIRED) == 0


def test_reads_land_one_sided_in_registered_client_memory(fabric: Fabric, h: Any, rng: random.Random) -> None:
    with _connect(fabric.lc, 0) as a:
        _rdma_up(h, fabric, a, rng)
        sizes = [3000, 2 * MiB, 5]
        keys, values = fabric.written(rng, sizes)
        buf = a.alloc_buffer(sum(sizes))
        spans, at = [], 0
        for s in sizes:
            spans.append(buf[at:at + s])
            at += s
        before = h.counters(a)
        assert a.get_into(keys, spans) == sizes
        assert [bytes(s) for s in spans] == values
        assert _grew(h.counters(a), before, SidecarCounter.RDMA_READS) == len(keys)


def test_a_sidecar_without_a_device_reads_over_tcp(fabric: Fabric, h: Any, rng: random.Random) -> None:
    keys, values = fabric.written(rng, [MiB, 7])
    with _connect(fabric.lc, 1) as b:
        bufs = [np.zeros(len(v), np.uint8) for v in values]
        assert b.get_into(keys, bufs) == [len(v) for v in values]
        assert [x.tobytes() for x in bufs] == values
        c = h.counters(b)
        assert c.get(SidecarCounter.RDMA_FALLBACK_NO_LOCAL_DEVICE) == 1  # once for the node
        assert c.get(SidecarCounter.RDMA_READS, 0) == 0


def test_a_connection_that_fails_falls_back_to_tcp(fabric: Fabric, h: Any, rng: random.Random) -> None:
    keys, values = fabric.written(rng, [MiB, 7])
    with _connect(fabric.lc, 2) as c:
        bufs = [np.zeros(len(v), np.uint8) for v in values]
        assert c.get_into(keys, bufs) == [len(v) for v in values]
        assert [x.tobytes() for x in bufs] == values
        got = h.counters(c)
        assert got.get(SidecarCounter.RDMA_FALLBACK_CONNECT_FAILED, 0) >= 1
        assert got.get(SidecarCounter.RDMA_READS, 0) == 0 and got.get(SidecarCounter.RDMA_CONNECTS, 0) == 0


def test_bytes_that_changed_under_a_read_are_read_again_over_tcp(fabric: Fabric, h: Any, rng: random.Random) -> None:
    """The fabric flips a byte of each one-sided READ (an extent reused under the read): every
    object fails its checksum, is read again over TCP, and comes back exact."""
    with _connect(fabric.lc, 0) as a:
        _rdma_up(h, fabric, a, rng)
        keys, values = fabric.written(rng, [64 * KiB, MiB, 1])
        before = h.counters(a)
        fabric.fault("corrupt")
        try:
            bufs = [np.zeros(len(v), np.uint8) for v in values]
            assert a.get_into(keys, bufs) == [len(v) for v in values]
        finally:
            fabric.fault(None)
        assert [x.tobytes() for x in bufs] == values
        after = h.counters(a)
        assert _grew(after, before, SidecarCounter.RDMA_FALLBACK_CHECKSUM) == len(keys)
        assert _grew(after, before, SidecarCounter.RDMA_READS) == 0


def test_the_hold_keeps_an_extent_in_place_under_a_one_sided_read(fabric: Fabric, h: Any,
                                                                  rng: random.Random) -> None:
    """While a READ is on its way (the fabric delays it), the object is removed and its key
    written again with other bytes of the same size: without the hold, the new object would take
    the freed extent and the read would see its bytes."""
    with _connect(fabric.lc, 0) as a:
        _rdma_up(h, fabric, a, rng)
        keys, values = fabric.written(rng, [MiB])
        before, store_before = h.counters(a), fabric.store_counters()
        bufs = [np.zeros(MiB, np.uint8)]
        got: list[Any] = []
        fabric.fault("delay 2")
        try:
            def read() -> None:
                try:
                    got.append(a.get_into(keys, bufs))
                except Exception as exc:
                    got.append(exc)
            reader = threading.Thread(target=read)
            reader.start()
            h.wait_for(lambda: _grew(fabric.store_counters(), store_before, StoreCounter.RDMA_HOLDS) == 1,
                       30, "the node to hold the object")
            with StoreClient(fabric.lc.stores[0]) as node:
                assert node.remove(keys) == [pb.OK]  # removed: the extent stays with the hold
                assert node.put(keys, [rng.randbytes(MiB)]) == [pb.OK]
                assert node.put([rng.randbytes(32) for _ in range(4)], [rng.randbytes(MiB)] * 4) == [pb.OK] * 4
            reader.join(60)
            assert not reader.is_alive()
        finally:
            fabric.fault(None)
        assert got == [[MiB]] and bufs[0].tobytes() == values[0]
        after = h.counters(a)
        assert _grew(after, before, SidecarCounter.RDMA_READS) == 1
        assert _grew(after, before, SidecarCounter.RDMA_FALLBACK_CHECKSUM) == 0


def test_a_link_lost_mid_batch_falls_back_for_the_rest(fabric: Fabric, h: Any, rng: random.Random) -> None:
    """The first two READs of a batch of six complete, then the link fails: the other four are
    read over TCP, the queue pair is dropped (later reads are TCP until it is reconnected), and
    all six are exact."""
    with _connect(fabric.lc, 0) as a:
        _rdma_up(h, fabric, a, rng)
        sizes = [256 * KiB] * 6
        keys, values = fabric.written(rng, sizes)
        before = h.counters(a)
        fabric.fault("fail-after 2")
        try:
            bufs = [np.zeros(s, np.uint8) for s in sizes]
            assert a.get_into(keys, bufs) == sizes
            assert [x.tobytes() for x in bufs] == values
            after = h.counters(a)
            assert _grew(after, before, SidecarCounter.RDMA_READS) == 2
            assert _grew(after, before, SidecarCounter.RDMA_FALLBACK_TRANSFER_FAILED) == 4
            # The broken queue pair is not used again: the next read is TCP, whole and exact.
            again = [np.zeros(s, np.uint8) for s in sizes]
            assert a.get_into(keys, again) == sizes
            assert [x.tobytes() for x in again] == values
            assert _grew(h.counters(a), after, SidecarCounter.RDMA_READS) == 0
        finally:
            fabric.fault(None)


def _pool_has(f: Fabric, keys: list[bytes], values: list[bytes]) -> None:
    with StoreClient(f.lc.stores[0]) as node:
        assert node.get(keys) == values


def test_pool_writes_are_one_sided_and_byte_exact(fabric: Fabric, h: Any, rng: random.Random) -> None:
    with _connect(fabric.lc, 0) as a:
        _rdma_up(h, fabric, a, rng)
        sizes = [1, 4095, 64 * KiB, MiB, 3 * MiB + 5]
        keys, values = h.keys(rng, len(sizes)), h.values(rng, sizes)
        before, store_before = h.counters(a), fabric.store_counters()
        assert a.put(keys, values) == [pb.OK] * len(keys)
        h.wait_for(lambda: a.stats().pending_pool_bytes == 0, 60, "the write-through to the pool")
        _pool_has(fabric, keys, values)
        after = h.counters(a)
        assert _grew(after, before, SidecarCounter.RDMA_WRITES) == len(keys)
        assert _grew(after, before, SidecarCounter.RDMA_WRITE_BYTES) == sum(sizes)
        assert _grew(fabric.store_counters(), store_before, StoreCounter.RDMA_RESERVATIONS) >= 1


def test_a_pool_write_whose_link_fails_is_revoked_and_made_over_tcp(fabric: Fabric, h: Any,
                                                                    rng: random.Random) -> None:
    with _connect(fabric.lc, 0) as a:
        _rdma_up(h, fabric, a, rng)
        keys, values = h.keys(rng, 3), h.values(rng, [MiB, 5, 200 * KiB])
        before, store_before = h.counters(a), fabric.store_counters()
        fabric.fault("fail-after 1")
        try:
            assert a.put(keys, values) == [pb.OK] * 3
            h.wait_for(lambda: a.stats().pending_pool_bytes == 0, 60, "the write-through to the pool")
        finally:
            fabric.fault(None)
        _pool_has(fabric, keys, values)
        after, store_after = h.counters(a), fabric.store_counters()
        assert _grew(after, before, SidecarCounter.RDMA_FALLBACK_TRANSFER_FAILED) >= 1
        assert _grew(after, before, SidecarCounter.RDMA_WRITES) == 0
        assert _grew(store_after, store_before, StoreCounter.REVOKED) >= 1  # nothing half-written is visible


def test_a_node_without_a_device_is_read_over_tcp(h: Any, rng: random.Random) -> None:
    """A store node without a device advertises none (Health, its ring entry) and refuses
    ConnectRdma; a sidecar with a device reads it over TCP, counted once."""
    with tempfile.TemporaryDirectory(prefix="kvpool-fabric-") as d:
        with _env("off"):
            lc = LocalCluster(stores=1, sidecars=0, store_bytes=32 * MiB, local_bytes=16 * MiB)
            lc.__enter__()
        try:
            with _env(f"sim:{d}"):
                lc.add_sidecar(extra_args=SLOW_OK)
            with StoreClient(lc.stores[0]) as node:
                assert node.health().rdma_device == ""
                assert [m.rdma_device for m in node.get_ring().members] == [""]
                keys, values = [rng.randbytes(32) for _ in range(3)], [rng.randbytes(s) for s in (1, KiB, MiB)]
                assert node.put(keys, values) == [pb.OK] * 3
            with _connect(lc, 0) as a:
                for _ in range(2):
                    bufs = [np.zeros(len(v), np.uint8) for v in values]
                    assert a.get_into(keys, bufs) == [len(v) for v in values]
                    assert [x.tobytes() for x in bufs] == values
                c = h.counters(a)
                assert c.get(SidecarCounter.RDMA_FALLBACK_NO_REMOTE_DEVICE) == 1  # retried later, not per read
                assert c.get(SidecarCounter.RDMA_READS, 0) == 0
        finally:
            lc.__exit__(None, None, None)


def test_a_node_with_a_device_advertises_it(fabric: Fabric) -> None:
    with StoreClient(fabric.lc.stores[0]) as node:
        assert node.health().rdma_device == "kvpool-sim"
        ring = node.get_ring()
        assert [m.rdma_device for m in ring.members if m.id == fabric.lc.store_ids[0]] == ["kvpool-sim"]


def test_reads_over_a_real_device(h: Any, rng: random.Random) -> None:
    """The same reads through pyverbs and the host's RDMA device (store and sidecar on one
    device, a loopback connection); only where pyverbs finds one."""
    devices, reason = rdma_status()
    if not devices:
        pytest.skip(f"no RDMA device on this host ({reason}); the one-sided path ran on the simulated fabric only")
    with _env(f"device:{devices[0]}"):
        lc = LocalCluster(stores=1, sidecars=0, store_bytes=32 * MiB, local_bytes=16 * MiB)
        lc.__enter__()
    try:
        with _env(f"device:{devices[0]}"):
            lc.add_sidecar(extra_args=SLOW_OK)
        with StoreClient(lc.stores[0]) as node:
            assert node.health().rdma_device == devices[0]
            keys, values = [rng.randbytes(32) for _ in range(4)], [rng.randbytes(s) for s in (1, 4095, MiB, 3 * MiB)]
            assert node.put(keys, values) == [pb.OK] * 4
        with _connect(lc, 0) as a:
            bufs = [np.zeros(len(v), np.uint8) for v in values]
            assert a.get_into(keys, bufs) == [len(v) for v in values]
            assert [x.tobytes() for x in bufs] == values
            c = h.counters(a)
            assert c.get(SidecarCounter.RDMA_READS, 0) == 4, c
            assert c.get(SidecarCounter.RDMA_READ_BYTES, 0) == sum(len(v) for v in values)
            more, more_values = h.keys(rng, 2), h.values(rng, [MiB, 17])
            assert a.put(more, more_values) == [pb.OK, pb.OK]
            h.wait_for(lambda: a.stats().pending_pool_bytes == 0, 60, "the write-through to the pool")
            assert h.counters(a).get(SidecarCounter.RDMA_WRITES, 0) == 2
        with StoreClient(lc.stores[0]) as node:
            assert node.get(more) == more_values
    finally:
        lc.__exit__(None, None, None)


def test_a_node_restart_breaks_the_connection_and_reads_go_on(h: Any, rng: random.Random) -> None:
    """The node dies and comes back (a new life, a new arena and rkey): the sidecar's reads of
    that moment go over TCP, exact, and the connection is made again later."""
    with tempfile.TemporaryDirectory(prefix="kvpool-fabric-") as d:
        with _env(f"sim:{d}"):
            lc = LocalCluster(stores=1, sidecars=0, store_bytes=32 * MiB, local_bytes=16 * MiB)
            lc.__enter__()
        try:
            with _env(f"sim:{d}"):
                lc.add_sidecar(extra_args=SLOW_OK)
            f = Fabric(lc, d)
            with _connect(lc, 0) as a:
                _rdma_up(h, f, a, rng)
                with _env(f"sim:{d}"):
                    lc.restart_store(0)
                keys, values = f.written(rng, [MiB, 33])
                before = h.counters(a)

                def exact() -> bool:  # the sidecar may need a moment to find the new life
                    bufs = [np.zeros(len(v), np.uint8) for v in values]
                    return a.get_into(keys, bufs) == [len(v) for v in values] and \
                        [x.tobytes() for x in bufs] == values
                h.wait_for(exact, 60, "the read after the restart")
                after = h.counters(a)
                assert _grew(after, before, SidecarCounter.RDMA_READS) == 0
                assert sum(_grew(after, before, c) for c in SidecarCounter if c.startswith("rdma_fallback_")) >= 1
                _rdma_up(h, f, a, rng)  # connected again to the new life
                assert _grew(h.counters(a), after, SidecarCounter.RDMA_CONNECTS) == 1
        finally:
            lc.__exit__(None, None, None)
