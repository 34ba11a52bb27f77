"""The sidecar's half of the prefill → decode handoff (records: :mod:`kvpool.core.handoff_record`).

Prefill side (``PublishPrefill``): every block of the prefill is made to be in the pool (what is
only local is written now and the commits waited for), the state object, which stays single-copy
in this sidecar's host memory, is pinned and *exported* for a bounded hold, and a signed record
is returned.  Export = a random 64-bit token admitted by the guard of this sidecar's arena segment
on its transfer port, for exactly that object's extent and until the hold ends; nothing else of
the arena can be read over it.  With TLS the port is mutual TLS and admits only certificates of
the export's tenant (:func:`kvpool.core.pki.tenant`), so a record that leaks to another tenant, or
to anyone outside the pool, reads nothing; the reader, in turn, accepts only a server of that
identity (not a name: a tenant's certificate has none), so neither a store node nor another
tenant's sidecar can pose as the prefill sidecar.

Decode side (``AcceptHandoff``): the record is verified (tenant, tag, expiry), the blocks land
from the pool into the local tier through the sidecar's ordinary read path (one batched read per
owner, all owners concurrently, straight into arena extents), and, at the same time, the state
object is read point to point from the prefill sidecar's transfer port into a local extent
(the transfer engine: bulk bytes never inside gRPC), its checksum checked against the record.
Without it (expired export, prefill sidecar gone or restarted, bytes that fail the checksum) the
pool is asked, and failing that the reply says so and the client plans the bounded replay.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from kvpool.core import handoff_record as ho
from kvpool.core import pki
from kvpool.core.checksum import checksum
from kvpool.core.keys import KEY_BYTES
from kvpool.core.retry import UNREACHABLE
from kvpool.pool.fanout import Pool
from kvpool.sidecar.config import SidecarConfig
from kvpool.sidecar.local_tier import LocalEntry, LocalTier
from kvpool.sidecar.reads import Reads
from kvpool.sidecar.writer import Writer
from kvpool.transfer import Segment, SegmentRegistry, TransferEngine, TransferRequest, TransferServer
from kvpool.wire import grpc_status
from kvpool.wire.counters import SidecarCounter, handoff_refused, handoff_state
from kvpool.wire.proto import sidecar_pb2 as spb
from kvpool.wire.proto import store_pb2 as pb

log = logging.getLogger("kvpool.sidecar.handoff")

SEGMENT = "arena"
_RETRY = {pb.IN_FLIGHT, UNREACHABLE, pb.DRAINING, pb.WRONG_OWNER}


@dataclass
class _Export:
    entry: LocalEntry
    lease_id: int
    expires: float  # unix seconds


class ExportGuard:
    """Admits a transfer read only for a live export's token, inside that object's extent."""

    def __init__(self, service: HandoffService) -> None:
        self.service = service

    def acquire(self, op: str, offset: int, length: int, token: int) -> object | None:
        if op != "read":
            return None
        exp = self.service.exports.get(token)
        if exp is None or time.time() >= exp.expires:
            return None
        e = exp.entry
        if not (e.offset <= offset and offset + length <= e.offset + e.size):
            return None
        # Pinned while the bytes move, even if the export's lease ends meanwhile.
        return e if self.service.local.pin_live(e) else None

    def release(self, handle: object) -> None:
        assert isinstance(handle, LocalEntry)
        self.service.local.unpin(handle)


class HandoffService:
    """Exports, the transfer port, and the two RPCs' logic of one sidecar: reads through
    ``reads``, writes what the pool lacks through ``writer``."""

    def __init__(self, cfg: SidecarConfig, local: LocalTier, pool: Pool, reads: Reads, writer: Writer,
                 counters: Any, key_secret: bytes) -> None:
        self.cfg, self.local, self.pool, self.reads, self.writer = cfg, local, pool, reads, writer
        self.counters = counters
        self.instance = secrets.token_hex(8)
        self.secret = key_secret
        self.max_hold_ms = cfg.max_handoff_hold_ms
        listen, advertise = cfg.handoff_listen, cfg.handoff_advertise
        self.exports: dict[int, _Export] = {}
        self._lock = threading.Lock()
        self.server: TransferServer | None = None
        self.address = ""
        if listen:
            host, _, port = listen.rpartition(":")
            registry = SegmentRegistry()
            registry.register(Segment(SEGMENT, local.arena.view), guard=ExportGuard(self))
            # Over TLS only a sidecar of this tenant (its certificate) may read an export: a
            # stolen record's token is not enough.
            me = pki.tenant(cfg.tenant_id)
            self.server = TransferServer(registry, host=host or "127.0.0.1", port=int(port or 0), tls=cfg.tls,
                                         peer_check=(lambda who: who == me) if cfg.tls else None).start()
            self.address = advertise or self.server.address
        self._engine: TransferEngine | None = None
        self._state_pool = futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="handoff-state")

    @property
    def engine(self) -> TransferEngine:
        with self._lock:
            if self._engine is None:
                # The prefill sidecar is checked by its certificate's identity (this tenant's, as
                # it checks this reader), not by a name: a tenant's certificate serves none, and
                # cfg.tls's server_name is the store nodes' (which a store node would pass).
                tls = self.cfg.tls.expecting(pki.tenant(self.cfg.tenant_id)) if self.cfg.tls else None
                self._engine = TransferEngine(connections_per_peer=2, stall_timeout=5.0, tls=tls)
            return self._engine

    def key(self, tenant: str) -> bytes:
        return ho.handoff_key(self.secret, tenant)

    def _sweep(self) -> None:
        now = time.time()
        with self._lock:
            gone = [t for t, x in self.exports.items() if x.expires <= now]
            dead = [self.exports.pop(t) for t in gone]
        if dead:
            self.local.release([x.lease_id for x in dead])

    # -- prefill side -------------------------------------------------------------------------

    def publish(self, request: spb.PublishPrefillRequest) -> spb.PublishPrefillReply:
        t0 = time.perf_counter()
        blob = request.keys
        b = request.block_tokens
        if len(blob) % KEY_BYTES or b <= 0:
            return spb.PublishPrefillReply(code=pb.INVALID, message="keys blob or block size malformed")
        arr = np.frombuffer(blob, dtype=f"V{KEY_BYTES}")
        keys: list[bytes] = arr.tolist()
        p = request.state_position
        if len(keys) * b > request.prompt_tokens or (p and (p % b or p // b > len(keys))):
            return spb.PublishPrefillReply(
                code=pb.INVALID, message=f"{len(keys)} blocks of {b} tokens and state position {p} do not fit a "
                                         f"prompt of {request.prompt_tokens} tokens")
        self._sweep()
        deadline = time.monotonic() + (request.timeout_ms or 10_000) / 1000.0
        codes, written = self._to_pool(keys, arr, deadline)
        if any(c != pb.OK for c in codes):
            missing = sum(c != pb.OK for c in codes)
            first = next(i for i, c in enumerate(codes) if c != pb.OK)
            return spb.PublishPrefillReply(
                code=pb.NOT_FOUND, codes=codes, blocks_written=written,
                message=f"{missing} of {len(keys)} blocks are not in the pool (first at index {first}: "
                        f"{pb.Code.Name(codes[first])})")
        now_ms = int(time.time() * 1000)
        hold_ms = min(request.hold_ms or 30_000, self.max_hold_ms)
        flags = 0
        fields: dict[str, Any] = {}
        if p:
            skey = keys[p // b - 1]
            found, _ = self.local.lookup([skey], pb.STATE)
            e = found[0]
            if e is not None and self.server is not None:
                lease = self.local.lease([e], hold_ms)
                if lease.entries:
                    token = secrets.randbits(64) or 1
                    expires = now_ms + hold_ms
                    with self._lock:
                        self.exports[token] = _Export(e, lease.lease_id, expires / 1000.0)
                    flags |= ho.FLAG_STATE | ho.FLAG_PEER
                    fields = dict(state_size=e.size, state_checksum=e.checksum, peer=self.address, segment=SEGMENT,
                                  state_offset=e.offset, export_id=token, state_expires_unix_ms=expires)
            if not flags:
                # Not here (handed to the pool on eviction) or no transfer port: the decode side
                # asks the pool, then replays.
                if e is not None or (self.pool.enabled
                                     and bool(self.pool.present(arr[p // b - 1:p // b], pb.STATE)[0])):
                    flags |= ho.FLAG_STATE
                    if e is not None:
                        fields = dict(state_size=e.size, state_checksum=e.checksum)
        rec = ho.HandoffRecord(
            tenant=self.cfg.tenant_id, prompt_tokens=request.prompt_tokens, block_tokens=b, keys=tuple(keys),
            created_unix_ms=now_ms, expires_unix_ms=now_ms + (request.record_ttl_ms or 600_000),
            state_position=p if flags & ho.FLAG_STATE else 0, instance=self.instance, flags=flags, **fields,
        ).signed(self.key(self.cfg.tenant_id))
        self.counters[SidecarCounter.HANDOFFS_PUBLISHED] += 1
        return spb.PublishPrefillReply(code=pb.OK, codes=codes, record=rec.to_bytes(), blocks_written=written,
                                       publish_us=int((time.perf_counter() - t0) * 1e6),
                                       state_exported=bool(flags & ho.FLAG_PEER))

    def _to_pool(self, keys: list[bytes], arr: np.ndarray, deadline: float) -> tuple[list[pb.Code], int]:
        """Per-key codes once every block is in the pool (or the deadline passed) and how many
        this call wrote.  Local blocks the pool does not hold yet are written now; a write that
        may succeed later (the write-through writer holds the key at its owner: IN_FLIGHT; an
        owner unreachable or a ring moving) is tried again until the deadline, others are final."""
        n = len(keys)
        codes = [pb.NOT_FOUND] * n
        if not self.pool.enabled:
            return codes, 0
        found, lease = self.local.lookup(keys, pb.BLOCK, 60_000)
        assert lease is not None
        written = 0
        try:
            absent = [i for i, e in enumerate(found) if e is None]
            if absent:
                have = self.pool.present(arr[absent], pb.BLOCK)
                for i, h in zip(absent, have, strict=True):
                    if h:
                        codes[i] = pb.OK
            todo = [i for i, e in enumerate(found) if e is not None]
            wait = 0.002
            while todo:
                ents: list[LocalEntry] = [found[i] for i in todo]  # type: ignore[misc]
                got: dict[int, int] = {}
                ok, _ = self.writer.push(ents, None, got)
                written += ok
                retry = []
                for i, e in zip(todo, ents, strict=True):
                    c = pb.OK if e.pooled else got.get(id(e), pb.OK)
                    codes[i] = pb.NOT_FOUND if c == UNREACHABLE else grpc_status.as_code(c)
                    if c in _RETRY and not e.pooled:
                        retry.append(i)
                todo = retry
                if not todo or time.monotonic() >= deadline:
                    break
                time.sleep(wait)  # backoff before the next attempt, bounded by the deadline
                wait = min(wait * 2, 0.05)
        finally:
            self.local.release([lease.lease_id])
        return codes, written

    # -- decode side --------------------------------------------------------------------------

    def accept(self, request: spb.AcceptHandoffRequest) -> spb.AcceptHandoffReply:
        try:
            rec = ho.from_bytes(request.record)
        except ho.HandoffInvalid as exc:
            return spb.AcceptHandoffReply(code=pb.HANDOFF_INVALID, message=str(exc))
        checked, why = ho.check(rec, self.key(self.cfg.tenant_id), self.cfg.tenant_id, int(time.time() * 1000))
        code = grpc_status.as_code(checked)
        if code != pb.OK:
            self.counters[handoff_refused(code)] += 1
            return spb.AcceptHandoffReply(code=code, message=why)
        lease_ms = self.cfg.lease(request.lease_ms)
        t0 = time.perf_counter()
        state_fut = self._state_pool.submit(self._land_state, rec, lease_ms) if rec.has_state else None
        reply = spb.AcceptHandoffReply(code=pb.OK)
        if rec.keys:
            keys = list(rec.keys)
            r = self.reads.read_keys(keys, np.frombuffer(b"".join(keys), dtype=f"V{KEY_BYTES}"), pb.BLOCK, lease_ms)
            reply.codes.extend(r.codes)
            reply.offsets.extend(r.offsets)
            reply.sizes.extend(r.sizes)
            reply.lease_id = r.lease_id
            reply.local_hits, reply.pool_hits = r.local_hits, r.pool_hits
        reply.blocks_us = int((time.perf_counter() - t0) * 1e6)
        if state_fut is not None:
            outcome, where, lease_id, detail, us = state_fut.result()
            # StateOutcome's values are HandoffState's; the stub's enum class is a plain int at runtime.
            reply.state = cast(spb.HandoffState, int(outcome))
            reply.state_detail = detail
            reply.state_us = us
            if where is not None:
                reply.state_offset, reply.state_size, reply.state_lease_id = where[0], where[1], lease_id
        self.counters[SidecarCounter.HANDOFFS_ACCEPTED] += 1
        self.counters[handoff_state(ho.StateOutcome(reply.state))] += 1
        return reply

    def _land_state(self, rec: ho.HandoffRecord, lease_ms: int
                    ) -> tuple[ho.StateOutcome, tuple[int, int] | None, int, str, int]:
        """(outcome, (arena offset, size), lease pinning it, why not, µs): the state made local."""
        t0 = time.perf_counter()
        key = rec.state_key
        assert key is not None
        sources, fail = ho.state_sources(rec, int(time.time() * 1000), self.instance)
        why: list[str] = []
        if fail == ho.StateOutcome.EXPIRED:
            why.append("the prefill sidecar's export had ended")
        for src in sources:
            if src == "local":
                found, lease = self.local.lookup([key], pb.STATE, lease_ms)
                assert lease is not None
                e = found[0]
                if e is not None:
                    return ho.StateOutcome.LOCAL, (e.offset, e.size), lease.lease_id, "", _us(t0)
                self.local.release([lease.lease_id])
            elif src == "peer":
                got = self._from_peer(rec, key, lease_ms)
                if isinstance(got, str):
                    why.append(got)
                    continue
                return ho.StateOutcome.PEER, (got[0].offset, got[0].size), got[1], "", _us(t0)
            elif src == "pool" and self.pool.enabled:
                r = self.reads.read_keys([key], np.frombuffer(key, dtype=f"V{KEY_BYTES}"), pb.STATE, lease_ms)
                if r.codes and r.codes[0] == pb.OK:
                    if rec.state_checksum and r.checksums[0] != rec.state_checksum:
                        self.local.release([r.lease_id])
                        why.append("the pool's state object is not the record's (checksum)")
                        continue
                    return ho.StateOutcome.POOL, (r.offsets[0], r.sizes[0]), r.lease_id, "", _us(t0)
                why.append("not in the pool")
        return fail, None, 0, "; ".join(why), _us(t0)

    def _from_peer(self, rec: ho.HandoffRecord, key: bytes, lease_ms: int) -> tuple[LocalEntry, int] | str:
        """The state read from the prefill sidecar's transfer port into a fresh local extent."""
        why, e = self.local.reserve_one(key, rec.state_size, pb.STATE)
        if e is None:
            return f"no local extent for the state ({pb.Code.Name(why)})"
        try:
            st = self.engine.submit(rec.peer, [TransferRequest("read", self.local.view(e), rec.segment,
                                                               rec.state_offset, rec.state_size,
                                                               token=rec.export_id)]).wait()[0]
        except BaseException:
            self.local.abandon(e)
            raise
        if not st.ok:
            self.local.abandon(e)
            detail = f": {st.message}" if st.message else ""
            return f"the prefill sidecar at {rec.peer} did not serve it ({st.code.name}{detail})"
        csum = checksum(self.local.view(e))
        if csum != rec.state_checksum:
            self.local.abandon(e)
            self.counters[SidecarCounter.HANDOFF_STATE_CHECKSUM_FAILURES] += 1
            return "the state bytes from the prefill sidecar failed their checksum"
        lease = self.local.lease([], lease_ms)
        self.local.insert_fetched(e, csum, lease)
        # Here it is the only copy that this sidecar knows of: keep it out of the pool like any
        # state object, but hand it over on eviction and drain.
        self.local.mark_local_only(e, dirty=self.pool.enabled)
        return e, lease.lease_id

    def close(self) -> None:
        self._state_pool.shutdown(wait=False, cancel_futures=True)
        if self.server is not None:
            self.server.stop()
        if self._engine is not None:
            self._engine.close()


def _us(t0: float) -> int:
    return int((time.perf_counter() - t0) * 1e6)
