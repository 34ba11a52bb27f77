"""The client's side of the prefill → decode handoff (:mod:`kvpool.core.handoff_record`), over gRPC.

The prefill side publishes a signed record once its blocks are in the pool; the decode side
accepts it: its sidecar lands the blocks (from the pool) and the state (point to point from the
prefill sidecar, else the pool), and the record's plan says what to compute.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvpool.client.keys import pack_keys
from kvpool.client.link import SidecarLink
from kvpool.client.results import Blocks, HandoffResult, leading_ok
from kvpool.core import errors
from kvpool.core import handoff_record as _ho
from kvpool.core.planning import HitPlan, state_store_position
from kvpool.wire.proto import sidecar_pb2 as spb
from kvpool.wire.proto import store_pb2 as pb

if TYPE_CHECKING:
    from kvpool.client.client import Client


def state_candidates(prompt_tokens: int, matched_tokens: int, n_keys: int, block_tokens: int, window_tokens: int,
                     rollback_tokens: int) -> list[int]:
    """Where ``Client.plan`` looks for a state object: the last block boundary of the match that
    leaves the window and rollback to compute, and the one before (none without a window)."""
    if not window_tokens:
        return []
    b = block_tokens
    cap = max(0, prompt_tokens - max(1, window_tokens + rollback_tokens))
    l1 = (min(matched_tokens, cap) // b) * b
    return [p for p in (l1, l1 - b) if p > 0 and p // b - 1 < n_keys]


def check_position(position: int, block_tokens: int) -> None:
    """A state object's attach position must be a positive multiple of the block size."""
    if position <= 0 or position % block_tokens:
        raise errors.InvalidArgument(
            f"state attach position {position} must be a positive multiple of {block_tokens}")


def publish_prefill(link: SidecarLink, block_tokens: int, keys: Sequence[bytes], prompt_tokens: int,
                    state_position: int | None = None, hold_ms: int = 30_000, record_ttl_ms: int = 600_000,
                    timeout_ms: int = 10_000) -> _ho.HandoffRecord:
    """Prefill side: hand a finished prefill to a decode instance (:mod:`kvpool.core.handoff_record`).

    Makes sure every block of ``keys`` (the prompt's full blocks) is in the pool, writing
    what is only local and waiting for the commits (``timeout_ms``); keeps the state object
    at ``state_position`` (default: the store position ``floor((L − 1) / B) × B`` of DESIGN
    §5; 0: none) exportable from this sidecar for ``hold_ms``; returns the signed record
    (``.to_bytes()`` / ``.to_json()`` for the engines' channel), accepted for ``record_ttl_ms``.
    Raises NotFound when a block is neither local nor in the pool.  A state object that does
    not exist is not an error: the record then sends the decode side to the bounded replay.
    """
    if state_position is None:
        state_position = state_store_position(prompt_tokens, block_tokens) or 0
        if state_position // block_tokens > len(keys):
            state_position = 0
    elif state_position:
        check_position(state_position, block_tokens)
    r = link.call(link.stub.PublishPrefill, spb.PublishPrefillRequest(
        keys=pack_keys(keys), prompt_tokens=prompt_tokens, block_tokens=block_tokens,
        state_position=state_position, hold_ms=hold_ms, record_ttl_ms=record_ttl_ms, timeout_ms=timeout_ms))
    if r.code != pb.OK:
        raise errors.error_for_code(r.code, r.message)
    return _ho.from_bytes(r.record)


def accept_handoff(link: SidecarLink, client: Client, record: _ho.HandoffRecord | bytes | str,
                   window_tokens: int = 128, rollback_tokens: int = 6, lease_ms: int = 10_000) -> HandoffResult:
    """Decode side: land a prefill's blocks (from the pool) and state (point to point from
    the prefill sidecar, else the pool) in this sidecar; the plan says what to compute.

    Raises WrongTenant, HandoffInvalid (altered, forged, malformed) or HandoffExpired for a
    record that may not be used.  Otherwise never raises for what is missing: blocks the
    pool no longer holds are per-block codes (the plan covers the local prefix only), and a
    state object that is gone gives the bounded replay of the hit rule
    (:func:`kvpool.core.handoff_record.plan_handoff`).
    """
    t0 = time.perf_counter()
    blob = record.to_bytes() if isinstance(record, _ho.HandoffRecord) else \
        _ho.parse(record).to_bytes() if isinstance(record, str) else bytes(record)
    r, m = link.call_life(link.stub.AcceptHandoff, spb.AcceptHandoffRequest(record=blob, lease_ms=lease_ms))
    if r.code != pb.OK:
        raise errors.error_for_code(r.code, r.message)
    rec = _ho.from_bytes(blob)
    codes = list(r.codes)
    ro = m.ro
    n = leading_ok(codes)
    blocks = Blocks([ro[o:o + s] for o, s in zip(r.offsets[:n], r.sizes[:n], strict=True)], client, r.lease_id)
    outcome = _ho.StateOutcome(r.state)
    state_ok = outcome in (_ho.StateOutcome.PEER, _ho.StateOutcome.POOL, _ho.StateOutcome.LOCAL)
    state = ro[r.state_offset:r.state_offset + r.state_size] if state_ok else None
    res = HandoffResult(rec, HitPlan(0, 0, None, 0, 0, 0), blocks, codes, state, outcome, r.state_detail,
                        r.state_lease_id, client, r.blocks_us / 1e6, r.state_us / 1e6, 0.0, r.pool_hits,
                        r.local_hits)
    res.plan = _ho.plan_handoff(rec, res.local_blocks, state_ok, window_tokens, rollback_tokens)
    res.total_seconds = time.perf_counter() - t0
    return res
