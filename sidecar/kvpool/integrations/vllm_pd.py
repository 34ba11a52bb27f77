"""Prefill/decode disaggregation for the vLLM connector: vLLM's ``kv_role`` on kvpool's handoff.

- ``kv_producer`` (a prefill instance) saves a prompt's full blocks as ``kv_both`` does and, when
  the request finishes, publishes the prefill (:meth:`kvpool.client.client.Client.publish_prefill`:
  the sidecar writes what is only local to the pool, waits for the commits and signs a record);
  ``request_finished`` returns it as ``kv_transfer_params`` (:func:`encode_params`), which vLLM
  puts in the prefill side's ``RequestOutput.kv_transfer_params``, the way its own P/D connectors
  (NixlConnector, P2pNcclConnector) hand their metadata to the decode side.
- ``kv_consumer`` (a decode instance) saves nothing.  A request whose ``kv_transfer_params``
  (``SamplingParams(extra_args={"kv_transfer_params": ...})``) carry records has them accepted by
  its sidecar (:meth:`~kvpool.client.client.Client.accept_handoff`: it checks the tag, tenant and
  expiry, and lands the blocks from the pool), and the blocks the plan covers are loaded through
  the connector's ordinary load path.  A record that is malformed, altered, forged, expired, of
  another tenant or of another prompt or key space makes the request recompute its whole prompt
  (never other bytes); blocks the pool no longer has shorten the load to the blocks before them.
  A request without records is matched against the pool as under ``kv_both``.
- ``kv_both`` is the shared prefix cache: it saves and loads, publishes nothing, and accepts
  records when it is given some.

State objects: none here.  A Llama-like (attention-only) model has no state object, so records
are published with ``state_position=0`` and nothing goes point to point.  vLLM 0.32 has no state
hook of its own for a connector: a hybrid model's recurrent state is one more KV cache group
(``MambaSpec``), reached through ``SupportsHMA.request_finished_all_groups`` and the registered
caches; KVPoolConnector stores one full-attention group and refuses hybrid models at start.

The pure part (roles, the ``kv_transfer_params`` encoding, record checks, the load decision)
is apart from :class:`Handoffs`, the I/O with the sidecar.
"""

from __future__ import annotations

import base64
import binascii
import enum
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpool.core import errors, retry
from kvpool.core import handoff_record as _ho
from kvpool.core.planning import HitPlan
from kvpool.integrations.common import IntegrationConfigError, positive

if TYPE_CHECKING:
    from kvpool.client.client import Client
    from kvpool.client.results import HandoffResult

log = logging.getLogger(__name__)

PARAMS_KEY = "kvpool_handoff"
"""The key of kvpool's records in ``kv_transfer_params``: a list of base64 strings, one signed
record (:meth:`~kvpool.core.handoff_record.HandoffRecord.to_bytes`) per (TP, PP) rank, in the
order ``pp * tp_size + tp``."""

SETTINGS = {
    "handoff_wait_ms": "kv_producer: how long a finished request's publish waits for its blocks to be saved "
                       "and in the pool (default 5000; past it the request finishes without a record)",
    "handoff_ttl_ms": "kv_producer: how long a published record is accepted (default 600000)",
}


class Role(enum.StrEnum):
    """vLLM's ``kv_role`` values (``vllm.config.kv_transfer.KVRole``)."""

    PRODUCER = "kv_producer"
    CONSUMER = "kv_consumer"
    BOTH = "kv_both"

    @property
    def publishes(self) -> bool:
        """Publishes each finished request's prefill and returns the record."""
        return self is Role.PRODUCER

    @property
    def saves(self) -> bool:
        """Stores new prompt blocks (a decode instance's prompt was stored by its prefill instance)."""
        return self is not Role.CONSUMER

    @property
    def accepts(self) -> bool:
        """Accepts records given in a request's ``kv_transfer_params``."""
        return self is not Role.PRODUCER


def role_of(kv_role: object) -> Role:
    """The connector's role from ``kv_transfer_config.kv_role``; a clear error for any other value."""
    try:
        return Role(str(kv_role))
    except ValueError:
        raise IntegrationConfigError(f"kv_transfer_config.kv_role must be one of "
                                     f"{', '.join(r.value for r in Role)}, got {kv_role!r}") from None


@dataclass(frozen=True)
class HandoffSettings:
    wait_ms: int = 5000
    """Producer: bound on the wait, at a request's end, for its blocks to be saved and in the pool."""
    ttl_ms: int = 600_000
    """Producer: lifetime of a published record."""

    @classmethod
    def parse(cls, extra: dict[str, Any], where: str) -> HandoffSettings:
        return cls(int(positive(extra, "handoff_wait_ms", 5000, where, integer=True)),
                   int(positive(extra, "handoff_ttl_ms", 600_000, where, integer=True)))


class HandoffStat(enum.StrEnum):
    """The connector's P/D counters (in ``KVPoolConnector.stats`` of the scheduler side)."""

    PUBLISHED = "handoffs_published"
    """Producer: records returned in ``kv_transfer_params``."""
    PUBLISH_FAILED = "handoff_publish_failed"
    """Producer: finished requests returned without a record (blocks not in the pool in time, pool away)."""
    ACCEPTED = "handoffs_accepted"
    """Consumer: requests whose records the sidecar accepted."""
    REFUSED = "handoff_refused"
    """Consumer: requests whose records were malformed, altered, forged, expired, of another
    tenant or of another prompt: recomputed in full."""
    FAILED = "handoff_failed"
    """Consumer: requests whose accept failed otherwise (sidecar or pool away): recomputed."""
    BLOCKS = "handoff_blocks"
    """Consumer: blocks the accepted records landed in the sidecar (every rank)."""
    MISSING = "handoff_missing_blocks"
    """Consumer: blocks of accepted records the pool no longer had (recomputed)."""
    LAST_PUBLISH_US = "last_handoff_publish_us"
    """Producer: how long the last publish held the scheduler (waiting for the saves, the pool's commits)."""
    LAST_ACCEPT_US = "last_handoff_accept_us"
    """Consumer: how long the last accept held the scheduler (landing the blocks from the pool)."""


# -- pure ------------------------------------------------------------------------------------------


def encode_params(records: Sequence[_ho.HandoffRecord]) -> dict[str, Any]:
    """``kv_transfer_params`` of a published prefill (JSON-safe: strings in a list)."""
    return {PARAMS_KEY: [base64.b64encode(r.to_bytes()).decode("ascii") for r in records]}


def decode_params(params: object) -> list[_ho.HandoffRecord] | None:
    """The records in a request's ``kv_transfer_params``: None when it carries none (no params,
    or none of kvpool's); :class:`~kvpool.core.errors.HandoffInvalid` when they are malformed."""
    if not isinstance(params, dict) or params.get(PARAMS_KEY) is None:
        return None
    value = params[PARAMS_KEY]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise errors.HandoffInvalid(f"kv_transfer_params.{PARAMS_KEY} must be a non-empty list of strings")
    try:
        return [_ho.from_bytes(base64.b64decode(v, validate=True)) for v in value]
    except (binascii.Error, ValueError) as exc:
        if isinstance(exc, errors.HandoffInvalid):
            raise
        raise errors.HandoffInvalid(f"kv_transfer_params.{PARAMS_KEY} is not base64: {exc}") from None


def mismatch(records: Sequence[_ho.HandoffRecord], expected_keys: Sequence[Sequence[bytes]], prompt_tokens: int,
             block_tokens: int) -> str | None:
    """Why the records cannot serve this request (None: they can): one per rank, the engine's
    block size, a prompt no longer than the request's, and keys that are this engine's keys of
    the request's leading blocks (``expected_keys``, per rank) — another prompt, model or key
    space is refused here, before the sidecar lands anything."""
    if len(records) != len(expected_keys):
        return f"{len(records)} records for {len(expected_keys)} ranks"
    for rank, (rec, want) in enumerate(zip(records, expected_keys, strict=True)):
        if rec.block_tokens != block_tokens:
            return f"rank {rank}: record of {rec.block_tokens}-token blocks, engine blocks of {block_tokens}"
        if rec.prompt_tokens > prompt_tokens:
            return f"rank {rank}: record of a {rec.prompt_tokens}-token prompt, request of {prompt_tokens}"
        if tuple(rec.keys) != tuple(want[:len(rec.keys)]) or len(rec.keys) > len(want):
            return f"rank {rank}: record keys are not this request's blocks in this engine's key space"
    return None


def hit_blocks(plans: Sequence[HitPlan], limit: int) -> int:
    """Leading blocks to load after the accept: what every rank's plan covers, within ``limit``
    (the blocks before the prompt's last token, which vLLM always computes)."""
    if not plans:
        return 0
    return max(0, min([limit] + [p.hit_blocks for p in plans]))


def publishable(saved_blocks: int, prompt_tokens: int, block_tokens: int) -> bool:
    """Whether a finished producer request is published: every full block of its prompt saved
    (or known in the pool), so not one aborted before its prefill ended, nor a prompt shorter
    than a block (the decode side computes it all anyway)."""
    full = prompt_tokens // block_tokens
    return full > 0 and saved_blocks >= full


def publish_backoff(attempt: int) -> float:
    """Seconds before the next publish attempt (the blocks' save still under way): 2 ms doubling to 50 ms."""
    return retry.delay(attempt + 1, 0.002, 0.05)


# -- I/O -------------------------------------------------------------------------------------------


class Handoffs:
    """The scheduler side's handoff I/O: publish a finished request's prefill (producer), accept a
    request's records (consumer); counted in ``stats``."""

    def __init__(self, client: Client, settings: HandoffSettings, stats: dict[str, int]) -> None:
        self.client = client
        self.settings = settings
        self.stats = stats
        for s in HandoffStat:
            stats.setdefault(s.value, 0)

    def publish(self, keys_per_rank: Sequence[Sequence[bytes]], prompt_tokens: int) -> dict[str, Any] | None:
        """``kv_transfer_params`` for a finished request whose blocks ``keys_per_rank`` were saved
        (by the workers' background saves, which may still run: a block not yet in the sidecar is
        waited for, within ``wait_ms``); None when they are not in the pool by then."""
        t0 = time.monotonic()
        deadline = t0 + self.settings.wait_ms / 1000
        records = []
        try:
            for keys in keys_per_rank:
                records.append(self._publish_one(keys, prompt_tokens, deadline))
        except errors.KvpoolError as exc:
            log.warning("kvpool handoff of a %d-token prefill not published: %s", prompt_tokens, exc)
            self.stats[HandoffStat.PUBLISH_FAILED] += 1
            return None
        finally:
            self.stats[HandoffStat.LAST_PUBLISH_US] = int((time.monotonic() - t0) * 1e6)
        self.stats[HandoffStat.PUBLISHED] += 1
        return encode_params(records)

    def _publish_one(self, keys: Sequence[bytes], prompt_tokens: int, deadline: float) -> _ho.HandoffRecord:
        attempt = 0
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            try:
                return self.client.publish_prefill(keys, prompt_tokens, state_position=0,
                                                   record_ttl_ms=self.settings.ttl_ms, timeout_ms=max(1, left_ms))
            except errors.NotFound:  # a block's save has not committed yet
                pause = publish_backoff(attempt)
                if time.monotonic() + pause >= deadline:
                    raise
                time.sleep(pause)
                attempt += 1

    def take(self, params: object, expected_keys: Callable[[], Sequence[Sequence[bytes]]], prompt_tokens: int,
             block_tokens: int, limit: int) -> int | None:
        """Leading blocks that the records in a request's ``kv_transfer_params`` hand over and
        that the sidecar now holds (within ``limit``); 0 when they are refused or the accept
        fails (the request recomputes); None when ``params`` carry no records.  The accept's
        pins are dropped here: the connector's match that follows pins the landed blocks (one
        evicted in between is a block recomputed, never a wrong one)."""
        try:
            records = decode_params(params)
        except errors.HandoffInvalid as exc:
            self.refuse(str(exc))
            return 0
        if records is None:
            return None
        why = mismatch(records, expected_keys(), prompt_tokens, block_tokens)
        if why is not None:
            self.refuse(why)
            return 0
        got = self.accept(records)
        if got is None:
            return 0
        self.release(got)
        return hit_blocks([r.plan for r in got], limit)

    def accept(self, records: Sequence[_ho.HandoffRecord]) -> list[HandoffResult] | None:
        """Have the sidecar accept every rank's record (blocks landed and pinned until the results
        are released); None (counted) when it refuses one or fails."""
        got: list[HandoffResult] = []
        t0 = time.monotonic()
        try:
            for rec in records:
                # Attention-only KV: no window state, so no replay (window 0, rollback 0).
                got.append(self.client.accept_handoff(rec, window_tokens=0, rollback_tokens=0))
            self.stats[HandoffStat.LAST_ACCEPT_US] = int((time.monotonic() - t0) * 1e6)
        except (errors.HandoffInvalid, errors.HandoffExpired, errors.WrongTenant) as exc:
            self.refuse(str(exc), got)
            return None
        except errors.KvpoolError as exc:
            log.warning("kvpool handoff not accepted (%s): recomputing", exc)
            self.stats[HandoffStat.FAILED] += 1
            self.release(got)
            return None
        self.stats[HandoffStat.ACCEPTED] += 1
        self.stats[HandoffStat.BLOCKS] += sum(r.local_blocks for r in got)
        self.stats[HandoffStat.MISSING] += sum(r.missing_blocks for r in got)
        return got

    def refuse(self, why: str, got: Sequence[HandoffResult] = ()) -> None:
        log.warning("kvpool handoff refused (%s): recomputing the prompt", why)
        self.stats[HandoffStat.REFUSED] += 1
        self.release(got)

    @staticmethod
    def release(results: Sequence[HandoffResult]) -> None:
        for r in results:
            try:
                r.release()
            except errors.KvpoolError:
                pass  # the lease expires anyway
