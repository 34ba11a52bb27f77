"""Prefill → decode handoff through the pool, with real store and sidecar processes.

Sidecar 0 is the prefill side, 1 the decode side (tenant acme), 2 another tenant.  Tests that
kill or stop a prefill sidecar start their own with ``add_sidecar`` (same tenant, same pool).
"""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Any

import pytest

from kvpool.apps.cluster import LocalCluster
from kvpool.core import errors, pki
from kvpool.core import handoff_record as ho
from kvpool.core.handoff_record import StateOutcome
from kvpool.core.keys import KeySpace
from kvpool.core.planning import plan_hit
from kvpool.pool.node_client import StoreClient
from kvpool.wire.counters import SidecarCounter, handoff_state
from kvpool.wire.proto import store_pb2 as pb

KiB, MiB = 1 << 10, 1 << 20
B = 128
CLUSTER = dict(stores=2, sidecars=3, store_bytes=96 * MiB, local_bytes=32 * MiB, tenants=["acme", "acme", "globex"])


@pytest.fixture
def lc(module_cluster: LocalCluster) -> LocalCluster:
    return module_cluster


def prefill(client: Any, rng: random.Random, blocks: int = 12, tail: int = 40, block_bytes: int = 64 * KiB,
            state_bytes: int = 300_000) -> tuple[list[bytes], list[bytes], bytes, int, int]:
    """Put a prefill's blocks and its state object; (keys, values, state, prompt length, position)."""
    ks = KeySpace(model=f"handoff-{rng.random()}", block_tokens=B)
    prompt = blocks * B + tail
    keys = ks.block_keys([rng.randrange(50000) for _ in range(prompt)])
    assert len(keys) == blocks
    values = [rng.randbytes(block_bytes) for _ in keys]
    state = rng.randbytes(state_bytes)
    pos = ((prompt - 1) // B) * B
    assert client.put(keys, values) == [pb.OK] * blocks
    assert client.put_state(keys[pos // B - 1], pos, state) == pb.OK
    return keys, values, state, prompt, pos


def test_blocks_and_state_byte_exact_on_the_decode_side(lc: LocalCluster, rng: random.Random, h: Any) -> None:
    with lc.connect(0) as p, lc.connect(1) as d:
        keys, values, state, prompt, pos = prefill(p, rng)
        rec = p.publish_prefill(keys, prompt)
        assert rec.has_state and rec.has_peer and rec.state_position == pos and rec.tenant == "acme"
        wire = rec.to_bytes()  # what the engines carry over their own channel
        before = h.counters(d)
        with d.accept_handoff(wire) as res:
            assert res.state_outcome == ho.StateOutcome.PEER, res.state_detail
            assert res.complete and res.missing_blocks == 0 and res.local_blocks == len(keys)
            assert [bytes(v) for v in res.blocks] == values
            assert res.state is not None and bytes(res.state) == state
            assert res.pool_hits == len(keys)  # the decode sidecar had none of them: all from the pool
            assert (res.plan.hit_tokens, res.plan.state_position, res.plan.compute_tokens) == (pos, pos, prompt - pos)
            assert res.blocks_local_seconds > 0 and res.total_seconds >= res.blocks_local_seconds
        after = h.counters(d)
        peer = handoff_state(StateOutcome.PEER)
        assert after[peer] == before.get(peer, 0) + 1
        # Everything is local on the decode side now: a read is all local hits, the state too.
        with d.get(keys) as got:
            assert [bytes(v) for v in got] == values
        assert h.counters(d)[SidecarCounter.READ_HITS_LOCAL] - after[SidecarCounter.READ_HITS_LOCAL] == len(keys)
        assert bytes(d.get_state(keys[pos // B - 1], pos) or b"") == state
        # The JSON form is accepted as well (the same record).
        with d.accept_handoff(rec.to_json()) as again:
            assert again.state_outcome == ho.StateOutcome.LOCAL and again.local_hits == len(keys)


def test_write_back_blocks_are_written_to_the_pool_by_the_publish(lc: LocalCluster, rng: random.Random,
                                                                  h: Any) -> None:
    addr = lc.add_sidecar("acme", extra_args=["--write-back"])
    with LocalClient(lc, addr) as p, lc.connect(1) as d:
        keys, values, state, prompt, pos = prefill(p, rng, blocks=6)
        assert h.counters(p)[SidecarCounter.LOCAL_ONLY_OBJECTS] == len(keys) + 1  # only here, before the publish
        rec = p.publish_prefill(keys, prompt)
        assert h.counters(p)[SidecarCounter.LOCAL_ONLY_OBJECTS] == 1  # the blocks reached the pool; the state stays
        with d.accept_handoff(rec) as res:
            assert res.state_outcome == ho.StateOutcome.PEER
            assert [bytes(v) for v in res.blocks] == values and bytes(res.state or b"") == state


def test_tampered_forged_and_foreign_records_are_refused(lc: LocalCluster, rng: random.Random) -> None:
    with lc.connect(0) as p, lc.connect(1) as d, lc.connect(2) as other:
        keys, values, state, prompt, pos = prefill(p, rng, blocks=4)
        wire = bytearray(p.publish_prefill(keys, prompt).to_bytes())
        rec = ho.from_bytes(bytes(wire))
        # Point the export at another offset of the prefill arena: refused, nothing read.
        import dataclasses
        moved = dataclasses.replace(rec, state_offset=0)
        with pytest.raises(errors.HandoffInvalid, match="tag"):
            d.accept_handoff(moved.body() + rec.tag)
        flipped = bytearray(wire)
        flipped[-40] ^= 0x80  # a key byte
        with pytest.raises(errors.HandoffInvalid):
            d.accept_handoff(bytes(flipped))
        with pytest.raises(errors.HandoffInvalid):
            d.accept_handoff(b"not a record at all")
        forged = dataclasses.replace(rec, state_size=64 * MiB).signed(ho.handoff_key(b"guessed", "acme"))
        with pytest.raises(errors.HandoffInvalid):
            d.accept_handoff(forged)
        with pytest.raises(errors.WrongTenant):
            other.accept_handoff(bytes(wire))
        # The genuine record still works after all that.
        with d.accept_handoff(bytes(wire)) as res:
            assert [bytes(v) for v in res.blocks] == values and bytes(res.state or b"") == state


def test_expired_record_is_refused_and_an_ended_export_replays(lc: LocalCluster, rng: random.Random) -> None:
    with lc.connect(0) as p, lc.connect(1) as d:
        keys, values, state, prompt, pos = prefill(p, rng, blocks=5)
        short = p.publish_prefill(keys, prompt, record_ttl_ms=100)
        held = p.publish_prefill(keys, prompt, hold_ms=100)
        wait_until_ms(max(short.expires_unix_ms, held.state_expires_unix_ms))
        with pytest.raises(errors.HandoffExpired):
            d.accept_handoff(short)
        with d.accept_handoff(held) as res:
            assert res.state_outcome == ho.StateOutcome.EXPIRED and res.state is None
            assert not res.complete and "ended" in res.state_detail
            assert [bytes(v) for v in res.blocks] == values  # the blocks are in the pool regardless
            assert res.plan == plan_hit(prompt, len(keys) * B, (), B, 128, 6)  # bounded replay
            assert res.plan.hit_tokens == res.plan.block_hit_tokens - B


def test_killed_prefill_sidecar_gives_the_bounded_replay(lc: LocalCluster, rng: random.Random) -> None:
    addr = lc.add_sidecar("acme")
    proc = lc.sidecar_procs[-1]
    with LocalClient(lc, addr) as p:
        keys, values, state, prompt, pos = prefill(p, rng, blocks=7)
        wire = p.publish_prefill(keys, prompt).to_bytes()
    os.kill(proc.pid, signal.SIGKILL)  # no drain: the single copy of the state dies with it
    proc.popen.wait()
    with lc.connect(1) as d, d.accept_handoff(wire) as res:
        assert res.state_outcome == ho.StateOutcome.GONE, res.state_detail
        assert "did not serve it" in res.state_detail and "not in the pool" in res.state_detail
        assert [bytes(v) for v in res.blocks] == values
        assert res.plan == plan_hit(prompt, len(keys) * B, (), B, 128, 6)


def test_stopped_prefill_sidecar_hands_the_state_over_through_the_pool(lc: LocalCluster,
                                                                       rng: random.Random) -> None:
    addr = lc.add_sidecar("acme")
    proc = lc.sidecar_procs[-1]
    with LocalClient(lc, addr) as p:
        keys, values, state, prompt, pos = prefill(p, rng, blocks=3)
        wire = p.publish_prefill(keys, prompt).to_bytes()
    proc.popen.send_signal(signal.SIGTERM)  # drain: local-only objects (the state) go to the pool
    assert proc.popen.wait(30) == 0
    with lc.connect(1) as d, d.accept_handoff(wire) as res:
        assert res.state_outcome == ho.StateOutcome.POOL, res.state_detail
        assert bytes(res.state or b"") == state and [bytes(v) for v in res.blocks] == values
        assert res.plan.hit_tokens == pos


def test_missing_blocks(lc: LocalCluster, rng: random.Random) -> None:
    with lc.connect(0) as p, lc.connect(1) as d:
        keys, values, state, prompt, pos = prefill(p, rng, blocks=6)
        with pytest.raises(errors.NotFound, match="1 of 7 blocks"):
            p.publish_prefill(keys + [rng.randbytes(32)], prompt + B)
        rec = p.publish_prefill(keys, prompt)
        # The pool loses blocks 3.. after the publish (evicted, say): the decode side says so.
        for addr in lc.stores:
            with StoreClient(addr, lc.tokens["acme"]) as s:
                s.remove(keys[3:])
        with d.accept_handoff(rec) as res:
            assert res.block_codes == [pb.OK] * 3 + [pb.NOT_FOUND] * 3 and res.missing_blocks == 3
            assert res.local_blocks == 3 and [bytes(v) for v in res.blocks] == values[:3]
            assert not res.complete
            assert res.plan == plan_hit(prompt, 3 * B, (), B, 128, 6)


def wait_until_ms(unix_ms: int) -> None:
    """Wait for the wall clock to pass ``unix_ms`` (expiry is a deadline on that clock)."""
    while time.time() * 1000 <= unix_ms:
        time.sleep(0.01)


class LocalClient:
    """A client of a sidecar added by a test (``LocalCluster.connect`` takes an index)."""

    def __init__(self, lc: LocalCluster, address: str) -> None:
        from kvpool.client.client import connect
        self.c = connect(address, block_tokens=lc.block_tokens)

    def __enter__(self) -> Any:
        return self.c

    def __exit__(self, *exc: object) -> None:
        self.c.close()


def test_a_stolen_record_read_with_another_tenants_identity_is_refused(lc: LocalCluster,
                                                                       rng: random.Random) -> None:
    """A record that leaks carries the export's token; the export port still wants a certificate
    of the record's tenant (from the pool's CA): another tenant's, or none the pool issued, reads
    nothing, and the export stays readable by its own tenant."""
    from kvpool.transfer import TransferCode, TransferEngine, TransferRequest

    with lc.connect(0) as p:
        keys, values, state, prompt, pos = prefill(p, rng, blocks=2)
        rec = p.publish_prefill(keys, prompt, hold_ms=20_000)
    assert rec.has_peer and rec.tenant == "acme"
    stranger_ca = pki.make_ca("not the pool's CA")

    def read(tls: Any) -> tuple[TransferCode, str, bytes]:
        eng = TransferEngine(tls=tls, stall_timeout=5.0)
        try:
            buf = bytearray(rec.state_size)
            t0 = time.monotonic()
            st = eng.submit(rec.peer, [TransferRequest("read", memoryview(buf), rec.segment, rec.state_offset,
                                                       rec.state_size, token=rec.export_id)]).wait()[0]
            assert time.monotonic() - t0 < 5.0  # refused at once, not timed out
            return st.code, st.message, bytes(buf)
        finally:
            eng.close()

    code, why, got = read(lc.issue("globex-thief", pki.tenant("globex")))
    assert code == TransferCode.CONNECTION and got != state, why
    code, why, got = read(lc.issue("forged-acme", pki.tenant("acme"), ca=stranger_ca))
    assert code == TransferCode.CONNECTION and got != state, why
    code, why, got = read(None)  # plaintext: no TLS at all
    assert code == TransferCode.CONNECTION and got != state, why
    code, why, got = read(lc.issue("acme-reader-2", pki.tenant("acme")))
    assert (code, got) == (TransferCode.OK, state), why


def test_the_export_port_serves_only_the_exported_extent_while_it_holds(lc: LocalCluster,
                                                                       rng: random.Random) -> None:
    from kvpool.transfer import TransferCode, TransferEngine, TransferRequest

    with lc.connect(0) as p:
        keys, values, state, prompt, pos = prefill(p, rng, blocks=2)
        rec = p.publish_prefill(keys, prompt, hold_ms=2000)
        assert rec.peer and rec.peer == p.handoff_address and rec.instance == p.instance_id
    # The port is mutual TLS and serves sidecars of the export's tenant: read as one of acme's.
    eng = TransferEngine(tls=lc.issue("acme-reader", pki.tenant("acme")))
    try:
        def read(offset: int, length: int, token: int) -> tuple[TransferCode, bytes]:
            buf = bytearray(length)
            st = eng.submit(rec.peer, [TransferRequest("read", memoryview(buf), rec.segment, offset, length,
                                                       token=token)]).wait()[0]
            return st.code, bytes(buf)

        assert read(rec.state_offset, rec.state_size, rec.export_id) == (TransferCode.OK, state)
        # Another token, bytes before or past the object, a write: refused, nothing moves.
        assert read(rec.state_offset, rec.state_size, rec.export_id ^ 1)[0] == TransferCode.LEASE_INVALID
        assert read(rec.state_offset - 4096, 8192, rec.export_id)[0] == TransferCode.LEASE_INVALID
        assert read(rec.state_offset, rec.state_size + 1, rec.export_id)[0] == TransferCode.LEASE_INVALID
        st = eng.submit(rec.peer, [TransferRequest("write", memoryview(bytearray(16)), rec.segment,
                                                   rec.state_offset, 16, token=rec.export_id)]).wait()[0]
        assert st.code == TransferCode.LEASE_INVALID
        wait_until_ms(rec.state_expires_unix_ms)
        assert read(rec.state_offset, rec.state_size, rec.export_id)[0] == TransferCode.LEASE_INVALID
    finally:
        eng.close()
