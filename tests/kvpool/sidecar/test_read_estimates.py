"""The sidecar measures its pool read bandwidth and match time and exports them in Stats
(the engines' fetch-or-recompute inputs, ``kvpool.sidecar.estimates``)."""

from __future__ import annotations

import random
import time
from typing import Any

from kvpool.apps.cluster import LocalCluster
from kvpool.core import planning
from kvpool.wire.proto import store_pb2 as pb

MiB = 1 << 20


def test_remote_reads_give_a_sane_bandwidth_and_matches_a_lookup_time(h: Any) -> None:
    rng = random.Random(21)
    with LocalCluster(stores=2, sidecars=2, local_bytes=64 * MiB) as lc:
        keys = h.keys(rng, 24)
        vals = h.values(rng, [MiB] * len(keys))
        with lc.connect(0) as writer:
            for i in range(0, len(keys), 8):
                assert writer.put(keys[i:i + 8], vals[i:i + 8]) == [pb.OK] * 8
            h.wait_for(lambda: writer.stats().pending_pool_bytes == 0, what="write-through backlog")
        with lc.connect(1) as c:  # another sidecar: every read is a remote fetch from the store nodes
            before = c.stats()
            # Nothing measured yet: the documented priors, and the samples say so.
            assert before.pool_read_samples == 0
            assert before.pool_read_bytes_per_s == planning.PRIOR_POOL_READ_BYTES_PER_S
            assert before.lookup_samples == 0 and before.lookup_seconds == planning.PRIOR_LOOKUP_SECONDS
            wall = 0.0
            for i in range(0, len(keys), 4):  # six reads of 4 MiB, each of keys this sidecar never held
                assert c.match(keys[i:i + 4]) == 4
                t0 = time.perf_counter()
                with c.get(keys[i:i + 4]) as got:
                    wall += time.perf_counter() - t0
                    assert [bytes(v) for v in got] == vals[i:i + 4]
            s = c.stats()
            # Those reads promoted the blocks into this sidecar's local tier: reading them into
            # registered memory copies local hits, which the local bandwidth measures.
            bufs = [c.alloc_buffer(MiB) for _ in range(4)]
            for _ in range(4):
                assert c.get_into(keys[:4], bufs) == [MiB] * 4
            assert bytes(bufs[0]) == vals[0]
            local = c.stats()
        assert s.counters["read_hits_pool"] == len(keys)
        assert s.pool_read_samples == 6 and s.lookup_samples == 6
        # The sidecar times only its fetch rounds, inside the client's call: its bandwidth is at
        # least what the client saw end to end, and below anything loopback TCP can carry.
        seen = len(keys) * MiB / wall
        assert seen <= s.pool_read_bytes_per_s < 100e9, (seen, s.pool_read_bytes_per_s)
        assert s.pool_read_bytes_per_s != planning.PRIOR_POOL_READ_BYTES_PER_S
        assert 0 < s.lookup_seconds < 1.0
        # No read_into of a local hit had happened: the local bandwidth was still the prior; then measured.
        assert s.local_read_samples == 0 and s.local_read_bytes_per_s == planning.PRIOR_LOCAL_READ_BYTES_PER_S
        assert local.local_read_samples == 4 and local.pool_read_samples == 6
        assert 1e6 < local.local_read_bytes_per_s < 1e12
        assert local.local_read_bytes_per_s != planning.PRIOR_LOCAL_READ_BYTES_PER_S
