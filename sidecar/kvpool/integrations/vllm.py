"""vLLM v1 KV connector: prefix blocks of vLLM's paged KV cache stored in and loaded from kvpool.

Loaded by vLLM, never by ``import kvpool``::

    --kv-transfer-config '{"kv_connector": "KVPoolConnector",
                           "kv_connector_module_path": "kvpool.integrations.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"address": "unix:///run/kvpool/kvpool.sock"}}'

One kvpool object per full block of prompt tokens and per (TP, PP) rank: every layer's slice of
that block, framed by :mod:`kvpool.integrations.common` (layout fingerprint + checksum).  Keys are
kvpool's own SHA-256 chain over the token ids in a key space built from vLLM's configuration
(model, revision, KV dtype, block size, rank/size, per-request LoRA, cache salt and multimodal
hashes), so they never depend on vLLM's per-process block-hash seed.

Scheduler side: ``get_num_new_matched_tokens`` matches the prompt's keys (pinned for a lease) and
returns the block-aligned hit beyond vLLM's own prefix cache, leaving at least the last prompt
token to compute, when loading it beats recomputing it (:mod:`kvpool.integrations.crossover`: the
sidecar's measured read bandwidth and lookup time against the prefill rate, configured or timed
from the scheduler's steps; below the crossover it returns 0 and drops the pins); the blocks to
load and the new full blocks to save go to the workers in the
step's metadata.  Worker side (:mod:`kvpool.integrations.staging`): ``start_load_kv`` lands the
blocks (local hits as views of the sidecar's arena, the rest in the worker's registered staging,
``staging_mib``) and checks them, ``wait_for_layer_load`` copies one layer into the paged cache;
``wait_for_save`` hands the step's saves to a background thread that gathers the blocks from the
paged cache straight into reserved arena extents and commits them, which is why
``request_finished`` delays freeing a request with saves
until ``get_finished`` reports them done.  A block that vanished or fails its checks between
match and load is reported by ``get_block_ids_with_load_errors`` and vLLM recomputes it.
The KV layout (which dimension indexes blocks, per-block shape, dtype) is read from the registered
caches and ``kv_cache_config``, never assumed: vLLM's CPU and CUDA layouts differ.

``kv_role``: ``kv_both`` is the shared prefix cache above; ``kv_producer`` (prefill instance) also
returns each finished request's published handoff record from ``request_finished`` as
``kv_transfer_params``, and ``kv_consumer`` (decode instance) saves nothing and loads what a
request's record hands over (:mod:`kvpool.integrations.vllm_pd`).
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvpool.core import errors
from kvpool.core.keys import KeySpace
from kvpool.core.planning import kv_bytes_per_token
from kvpool.core.traffic import DEFAULT_TRAFFIC_CLASS
from kvpool.integrations import crossover, vllm_pd
from kvpool.integrations.common import (
    ADDRESS_HELP,
    HEADER_BYTES,
    IntegrationConfigError,
    check_keys,
    check_object,
    fingerprint,
    positive,
    sidecar_address,
)
from kvpool.integrations.common import write_header as _write_header
from kvpool.integrations.staging import DEFAULT_STAGING_MIB, FastPath, Landing, PathStat, staging_settings
from kvpool.integrations.tensors import copy_tensor, host_array
from kvpool.wire.proto import store_pb2 as pb

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

SETTINGS = {
    "address": ADDRESS_HELP,
    "traffic_class": "the traffic class of saved blocks (TTL class of the pool; default "
                     f"{DEFAULT_TRAFFIC_CLASS})",
    "lease_ms": "how long a match pins the matched blocks for the load that follows (default 10000)",
    "staging_mib": "registered memory (MiB, allocated once per worker) remote blocks land in before their copy "
                   f"into the paged cache (default {DEFAULT_STAGING_MIB}; 0: through the sidecar's arena)",
    "staging_wait_ms": "unused by vLLM's loads (one thread: a step short of staging copies in what it landed "
                       "and reuses the slots); accepted for symmetry with the other integrations",
    "save": "store new prompt blocks (default true)",
    "load": "load matched blocks (default true)",
    **crossover.SETTINGS,
    **vllm_pd.SETTINGS,
}


@dataclass(frozen=True)
class Settings:
    address: str
    """The sidecar's address."""
    traffic_class: str = DEFAULT_TRAFFIC_CLASS
    """Traffic class of saved blocks."""
    lease_ms: int = 10000
    """Pin of a match, covering the step between the scheduler's match and the worker's load."""
    save: bool = True
    """Store new full prompt blocks."""
    load: bool = True
    """Load matched blocks."""
    decision: crossover.CrossoverSettings = crossover.CrossoverSettings()
    """Fetch or recompute: ``fetch_decision``, ``prefill_tokens_per_s``, ``estimate_refresh_ms``."""
    handoff: vllm_pd.HandoffSettings = vllm_pd.HandoffSettings()
    """P/D: ``handoff_wait_ms``, ``handoff_ttl_ms`` (kv_producer)."""

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> Settings:
        check_keys(extra, SETTINGS, "kv_connector_extra_config")
        lease = int(positive(extra, "lease_ms", 10000, "kv_connector_extra_config", integer=True))
        for k in ("save", "load"):
            if not isinstance(extra.get(k, True), bool):
                raise IntegrationConfigError(f"kv_connector_extra_config.{k} must be true or false, got {extra[k]!r}")
        return cls(sidecar_address(extra), str(extra.get("traffic_class", DEFAULT_TRAFFIC_CLASS)), lease,
                   extra.get("save", True), extra.get("load", True),
                   crossover.CrossoverSettings.parse(extra, "kv_connector_extra_config"),
                   vllm_pd.HandoffSettings.parse(extra, "kv_connector_extra_config"))


# -- what the scheduler sends the workers --------------------------------------------------------


@dataclass(frozen=True)
class BlockRange:
    """Blocks ``first .. first+len(block_ids)`` of a request's prompt and where they live in the paged cache."""

    req_id: str
    tokens: tuple[int, ...]
    """The prompt prefix up to the end of the range (keys are computed from it)."""
    space: tuple[tuple[str, str], ...]
    """Per-request key-space fields (LoRA, cache salt, multimodal hashes)."""
    first: int
    block_ids: tuple[int, ...]


@dataclass
class KVPoolConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockRange] = field(default_factory=list)
    saves: list[BlockRange] = field(default_factory=list)
    preempted: tuple[str, ...] = ()


@dataclass
class _Req:
    """Scheduler-side bookkeeping of one request."""

    tokens: tuple[int, ...]
    space: tuple[tuple[str, str], ...]
    block_ids: list[int] = field(default_factory=list)
    in_pool: int = 0  # leading blocks the pool already has (matched): never saved again
    saved: int = 0  # leading blocks saved or known present
    local_blocks: int = 0  # blocks vLLM's own prefix cache had at match time
    load: tuple[int, int] | None = None  # (first, count) matched in the pool, to load
    pending_load: BlockRange | None = None
    leases: list[int] = field(default_factory=list)
    has_saves: bool = False
    handoff: int | None = None  # blocks an accepted handoff record covers (None: no record looked at)


def _request_space(request: Any) -> tuple[tuple[str, str], ...]:
    fields: list[tuple[str, str]] = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        fields.append(("lora", f"{lora.lora_name}:{getattr(lora, 'lora_path', '')}"))
    salt = getattr(request, "cache_salt", None)
    if salt:
        fields.append(("cache_salt", str(salt)))
    mm = [str(getattr(f, "identifier", f)) for f in (getattr(request, "mm_features", None) or [])]
    if mm:
        fields.append(("mm", ",".join(mm)))
    return tuple(fields)


_PREFILL_STEP_TOKENS = 256
"""Steps of fewer scheduled tokens are decode-dominated: they say little about the prefill rate."""
_STEP_GAP_SECONDS = 5.0
"""A longer gap between two steps' plans is idle time, not a step."""


def _kv_bytes_per_token(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> int:
    """KV bytes per token of one worker (what it loads per token): from the KV cache groups'
    page sizes, else from the model's shape; 0 when neither is known (then every match loads)."""
    bs = int(vllm_config.cache_config.block_size)
    if kv_cache_config is not None and kv_cache_config.kv_cache_groups:
        page = sum(len(g.layer_names) * int(g.kv_cache_spec.page_size_bytes) for g in kv_cache_config.kv_cache_groups)
        return max(1, page // bs)
    try:
        mc, par = vllm_config.model_config, vllm_config.parallel_config
        return kv_bytes_per_token(mc.get_num_layers(par), mc.get_num_kv_heads(par), mc.get_head_size(),
                                  torch.tensor([], dtype=mc.dtype).element_size())
    except (AttributeError, TypeError, ValueError):
        return 0


# -- worker-side layout ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Layer:
    name: str
    tensor: torch.Tensor
    block_dim: int
    block_shape: tuple[int, ...]
    nbytes: int  # bytes of one block of this layer
    offset: int  # within the payload
    host: np.ndarray | None = None
    """The cache as numpy when it is in host memory: a block's copy then costs ~10 us less than
    through torch (16 blocks × 32 layers of 64 KiB: 6.5 vs 17.7 ms), see :mod:`.tensors`."""

    def _segment(self, obj: np.ndarray) -> np.ndarray:
        return obj[HEADER_BYTES + self.offset:HEADER_BYTES + self.offset + self.nbytes]

    def save(self, block_id: int, obj: np.ndarray) -> None:
        """Copy block ``block_id`` of this layer into its place in the object ``obj`` (uint8)."""
        if self.host is not None:
            np.copyto(self._segment(obj).view(self.host.dtype).reshape(self.block_shape),
                      self.host[(slice(None),) * self.block_dim + (block_id,)])
        else:
            dst = torch.from_numpy(self._segment(obj)).view(self.tensor.dtype).view(self.block_shape)
            copy_tensor(dst, self.tensor.select(self.block_dim, block_id))

    def load(self, block_id: int, obj: np.ndarray) -> None:
        """Copy this layer's place in the object ``obj`` (uint8, maybe read-only) into block ``block_id``."""
        if self.host is not None:
            np.copyto(self.host[(slice(None),) * self.block_dim + (block_id,)],
                      self._segment(obj).view(self.host.dtype).reshape(self.block_shape))
        else:
            with warnings.catch_warnings():
                # A local hit's object is read-only (the sidecar's arena): torch warns that
                # writing through it is undefined; we only read.
                warnings.simplefilter("ignore", UserWarning)
                src = torch.from_numpy(self._segment(obj))
            dst = self.tensor.select(self.block_dim, block_id)
            copy_tensor(dst, src.view(self.tensor.dtype).view(self.block_shape))


    def load_rows(self, block_ids: Sequence[int], rows: np.ndarray) -> bool:
        """Copy this layer's place in each row of ``rows`` (uint8, an object per row) into blocks
        ``block_ids`` with one numpy call (a slice assignment for consecutive blocks, a fancy-index
        one otherwise) instead of one per block; False (nothing copied) where the cache is not
        host memory."""
        if self.host is None:
            return False
        seg = rows[:, HEADER_BYTES + self.offset:HEADER_BYTES + self.offset + self.nbytes]
        src = np.moveaxis(seg.view(self.host.dtype).reshape((len(block_ids),) + self.block_shape), 0, self.block_dim)
        first = block_ids[0]
        if all(b == first + k for k, b in enumerate(block_ids)):
            np.copyto(self.host[(slice(None),) * self.block_dim + (slice(first, first + len(block_ids)),)], src)
        else:
            self.host[(slice(None),) * self.block_dim + (np.asarray(block_ids),)] = src
        return True


def _block_dim(name: str, shape: Sequence[int], num_blocks: int) -> int:
    dims = [d for d, s in enumerate(shape) if s == num_blocks]
    if len(dims) > 1 and shape[0] == 2:
        dims = [d for d in dims if d != 0]  # a leading 2 is K/V, not blocks
    if not dims:
        raise IntegrationConfigError(f"KV cache of layer {name} has shape {tuple(shape)}: no dimension of "
                                     f"kv_cache_config.num_blocks={num_blocks}")
    return dims[0]


def layout_of(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> tuple[list[_Layer], int, int]:
    """The per-block layout of registered caches: layers, payload bytes per block, fingerprint."""
    layers: list[_Layer] = []
    off = 0
    for name, t in kv_caches.items():
        d = _block_dim(name, t.shape, num_blocks)
        shape = tuple(s for i, s in enumerate(t.shape) if i != d)
        nbytes = t.element_size()
        for s in shape:
            nbytes *= s
        layers.append(_Layer(name, t, d, shape, nbytes, off, host_array(t)))
        off += nbytes
    fp = fingerprint([(ly.name, ly.block_shape, str(ly.tensor.dtype)) for ly in layers])
    return layers, off, fp


class _SaveQueue:
    """The worker's background saves and which finished requests they still hold: vLLM keeps a
    finished request's blocks until ``get_finished`` reports it, since a save still reads them."""

    def __init__(self) -> None:
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvpool-save")
        self._lock = threading.Lock()
        self._pending: dict[str, list[Future[None]]] = {}
        self._had_saves: set[str] = set()
        self._finished_waiting: set[str] = set()

    def submit(self, save: Callable[[BlockRange], None], rng: BlockRange) -> None:
        fut = self._saver.submit(save, rng)
        with self._lock:
            self._pending.setdefault(rng.req_id, []).append(fut)
            self._had_saves.add(rng.req_id)

    def wait(self, rid: str | None = None) -> None:
        """Block until the saves of ``rid`` (of every request: None) are done."""
        with self._lock:
            futs = [f for r, fs in self._pending.items() if rid is None or r == rid for f in fs]
        for f in futs:
            f.result()

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """Of the requests finished now or before, those whose saves are all done (reported once)."""
        with self._lock:
            self._finished_waiting |= {r for r in finished_req_ids if r in self._had_saves}
            for rid, futs in list(self._pending.items()):
                futs[:] = [f for f in futs if not f.done()]
                if not futs:
                    del self._pending[rid]
            done = {r for r in self._finished_waiting if r not in self._pending}
            self._finished_waiting -= done
            self._had_saves -= done
        return done

    def shutdown(self) -> None:
        self._saver.shutdown(wait=True)


class KVPoolConnector(KVConnectorBase_V1):
    """A vLLM KV connector backed by the kvpool sidecar (both roles: scheduler and worker)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.kv_role = vllm_pd.role_of(self._kv_transfer_config.kv_role)
        self.settings = Settings.from_extra(dict(self._kv_transfer_config.kv_connector_extra_config or {}))
        self.block_size = int(vllm_config.cache_config.block_size)
        from kvpool.client.client import connect
        self.client = connect(self.settings.address, block_tokens=self.block_size)
        par = vllm_config.parallel_config
        self.tp_size = int(par.tensor_parallel_size)
        self.pp_size = int(par.pipeline_parallel_size)
        self._base = self._base_space(vllm_config, kv_cache_config)
        self._spaces: dict[tuple[tuple[str, str], ...], list[KeySpace]] = {}
        # scheduler side
        self._reqs: dict[str, _Req] = {}
        # worker side
        self._layers: list[_Layer] = []
        self._payload = 0
        self._layout = 0
        self._staging = staging_settings(dict(self._kv_transfer_config.kv_connector_extra_config or {}),
                                         "kv_connector_extra_config")
        self._path: FastPath | None = None  # the worker's data path, made with the caches' layout
        # (block ids, landed objects, count, their rows in staging when they are evenly spaced there)
        self._loading: list[tuple[tuple[int, ...], Landing, int, np.ndarray | None]] = []
        self._layers_loaded: set[str] = set()
        self._load_errors: set[int] = set()
        self._saves = _SaveQueue()
        self.stats = {"loaded_blocks": 0, "load_errors": 0, "saved_blocks": 0, "save_refused": 0}
        self._scheduler_side(vllm_config, kv_cache_config, role)

    def _scheduler_side(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None,
                        role: KVConnectorRole) -> None:
        """The fetch-or-recompute decider (the scheduler decides; its counters go to ``stats``)."""
        self.decider: crossover.FetchDecider | None = None
        self.handoffs: vllm_pd.Handoffs | None = None
        self._step: tuple[int, float] | None = None  # (tokens, start) of the step being executed
        if role == KVConnectorRole.SCHEDULER:
            self.bytes_per_token = _kv_bytes_per_token(vllm_config, kv_cache_config)
            self.decider = crossover.FetchDecider(self.settings.decision, self.client.stats, self.stats)
            self.handoffs = vllm_pd.Handoffs(self.client, self.settings.handoff, self.stats)

    def _time_step(self, scheduled_tokens: int) -> None:
        """The prefill rate, measured: the tokens of one step over the time until the next is
        planned (the step ran in between).  Only steps of many tokens (prefill-dominated) count,
        and not the gap after an idle spell."""
        if self.decider is None:
            return
        now = time.monotonic()
        if self._step is not None and now - self._step[1] < _STEP_GAP_SECONDS:
            self.decider.observe_prefill(self._step[0], now - self._step[1])
        self._step = (scheduled_tokens, now) if scheduled_tokens >= _PREFILL_STEP_TOKENS else None

    # -- key spaces ----------------------------------------------------------------------------

    def _base_space(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> dict[str, Any]:
        mc = vllm_config.model_config
        spec_desc = ""
        if kv_cache_config is not None and kv_cache_config.kv_cache_groups:
            groups = kv_cache_config.kv_cache_groups
            if len(groups) != 1:
                raise IntegrationConfigError(f"KVPoolConnector stores one full-attention KV cache group; this model "
                                             f"has {len(groups)} (hybrid models are not supported yet)")
            s = groups[0].kv_cache_spec
            spec_desc = (f"{type(s).__name__}/heads={getattr(s, 'num_kv_heads', '?')}/"
                         f"head={getattr(s, 'head_size', '?')}/{getattr(s, 'dtype', '?')}")
        return {"model": str(mc.model), "revision": str(getattr(mc, "revision", None) or ""),
                "kv_dtype": f"{vllm_config.cache_config.cache_dtype}/{mc.dtype}", "spec": spec_desc}

    def _rank(self) -> tuple[int, int]:
        try:
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank
            return int(get_tensor_model_parallel_rank()), int(get_pp_group().rank_in_group)
        except (AssertionError, AttributeError, RuntimeError):  # parallel state not initialised: one rank
            return 0, 0

    def _key_spaces(self, space: tuple[tuple[str, str], ...]) -> list[KeySpace]:
        """One key space per (tp, pp) rank, for the request's extra fields."""
        got = self._spaces.get(space)
        if got is None:
            b = self._base
            extra = dict(space)
            lora = extra.pop("lora", "")
            extra.update({"engine": "vllm", "spec": b["spec"]})
            got = [KeySpace(b["model"], b["revision"], lora, b["kv_dtype"],
                            f"tp{tp}/{self.tp_size},pp{pp}/{self.pp_size}", extra, self.block_size)
                   for pp in range(self.pp_size) for tp in range(self.tp_size)]
            if len(self._spaces) > 4096:
                self._spaces.clear()
            self._spaces[space] = got
        return got

    def _my_space(self, space: tuple[tuple[str, str], ...]) -> KeySpace:
        tp, pp = self._rank()
        return self._key_spaces(space)[pp * self.tp_size + tp]

    # -- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        tokens = tuple(request.prompt_token_ids or ())
        st = self._reqs.get(request.request_id)
        if st is None or st.tokens != tokens:
            st = self._reqs[request.request_id] = _Req(tokens, _request_space(request))
        st.local_blocks = num_computed_tokens // self.block_size
        st.load = None
        if not self.settings.load:
            return 0, False
        limit = (len(tokens) - 1) // self.block_size  # the last prompt token is always computed
        if limit <= st.local_blocks:
            return 0, False
        handoff = self._handoff_blocks(request, st, limit)
        if handoff is not None:
            limit = handoff  # a record refused (0) recomputes; an accepted one caps the load at its plan
            if limit <= st.local_blocks:
                return 0, False
        matched = local = limit
        self._release(st)  # called again for the same request: the new match replaces the old pins
        try:
            # Every rank's blocks must be there (each worker loads its own shard).
            for ks in self._key_spaces(st.space):
                keys = ks.block_keys(tokens[:limit * self.block_size])
                n, n_local, lease = self.client.match_local(keys, self.settings.lease_ms)
                if lease:
                    st.leases.append(lease)
                matched, local = min(matched, n), min(local, n_local)
                if matched <= st.local_blocks:
                    break
        except errors.KvpoolError as exc:  # the pool being away is a miss, never a failed request
            log.warning("kvpool match failed (%s): treating as a miss", exc)
            matched = 0
        st.in_pool = st.saved = max(st.saved, matched)  # recomputed or not, these are in the pool: not saved again
        if handoff is None and not self._load_pays(matched - st.local_blocks, local - st.local_blocks):
            self._release(st)  # nothing is loaded: the pins go now, not at the lease's end
            return 0, False
        st.load = (st.local_blocks, matched - st.local_blocks)
        return (matched - st.local_blocks) * self.block_size, False

    def _handoff_blocks(self, request: Request, st: _Req, limit: int) -> int | None:
        """Blocks the records in the request's ``kv_transfer_params`` hand over (accepted once per
        request), 0 for records refused, None for none (or a role that accepts none)."""
        if self.handoffs is None or not self.kv_role.accepts or st.handoff is not None:
            return st.handoff
        st.handoff = self.handoffs.take(getattr(request, "kv_transfer_params", None),
                                        lambda: self._rank_keys(st, len(st.tokens) // self.block_size),
                                        len(st.tokens), self.block_size, limit)
        return st.handoff

    def _rank_keys(self, st: _Req, blocks: int) -> list[list[bytes]]:
        """Every rank's keys of the request's first ``blocks`` blocks (what a handoff record names)."""
        return [ks.block_keys(st.tokens[:blocks * self.block_size]) for ks in self._key_spaces(st.space)]

    def _load_pays(self, blocks: int, local_blocks: int) -> bool:
        """Whether loading ``blocks`` matched blocks (``local_blocks`` of them in the local tier)
        beats recomputing them (counted; no blocks: a miss, counted too)."""
        if self.decider is None:
            return blocks > 0
        b = self.block_size
        return self.decider.decide(max(0, blocks) * b, max(0, min(local_blocks, blocks)) * b,
                                   self.bytes_per_token).fetch

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or num_external_tokens <= 0 or st.load is None:
            return
        first, n = st.load
        if num_external_tokens != n * self.block_size:
            raise RuntimeError(f"vLLM allocated {num_external_tokens} external tokens for request "
                               f"{request.request_id}, kvpool matched {n * self.block_size}")
        ids = list(blocks.get_block_ids()[0])
        st.block_ids = ids
        st.pending_load = BlockRange(request.request_id, st.tokens[:(first + n) * self.block_size], st.space, first,
                                     tuple(ids[first:first + n]))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVPoolConnectorMetadata:
        self._time_step(int(scheduler_output.total_num_scheduled_tokens))
        meta = KVPoolConnectorMetadata(preempted=tuple(sorted(scheduler_output.preempted_req_ids or ())))
        for rid in meta.preempted:
            st = self._reqs.get(rid)
            if st is not None:  # its blocks are freed: it starts over (and matches again) when resumed
                self._release(st)
                st.block_ids, st.load, st.pending_load = [], None, None
        sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                st = self._reqs[new.req_id] = _Req(tuple(new.prompt_token_ids or ()), ())
            st.block_ids = list(new.block_ids[0])
            self._plan_step(meta, new.req_id, st, new.num_computed_tokens + sched.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                st.block_ids.extend(new_ids[0])
            self._plan_step(meta, rid, st, cached.num_computed_tokens[i] + sched.get(rid, 0))
        return meta

    def _plan_step(self, meta: KVPoolConnectorMetadata, rid: str, st: _Req, computed_after: int) -> None:
        if st.pending_load is not None:
            meta.loads.append(st.pending_load)
            st.pending_load = None
            self._release(st)  # the worker reads in this step; the pin has done its job
        if not self.settings.save or not self.kv_role.saves:
            return
        full = min(computed_after, len(st.tokens)) // self.block_size
        full = min(full, len(st.block_ids))
        if full > st.saved:
            b = self.block_size
            meta.saves.append(BlockRange(rid, st.tokens[:full * b], st.space, st.saved,
                                         tuple(st.block_ids[st.saved:full])))
            st.saved = full
            st.has_saves = True

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        self._release(st)
        params = None
        if self.handoffs is not None and self.kv_role.publishes and \
                vllm_pd.publishable(st.saved, len(st.tokens), self.block_size):
            # The workers' saves of the last blocks may still run: publish waits for them (bounded).
            params = self.handoffs.publish(self._rank_keys(st, st.saved), len(st.tokens))
        # Saves run in the workers' background thread, reading these blocks: keep them until
        # get_finished reports the request.
        return st.has_saves, params

    def _release(self, st: _Req) -> None:
        for lease in st.leases:
            self._release_lease(lease)
        st.leases = []

    def _release_lease(self, lease: int) -> None:
        try:
            self.client.release(lease)
        except errors.KvpoolError:
            pass  # it expires anyway

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = int(self._kv_cache_config.num_blocks)
        self._layers, self._payload, self._layout = layout_of(kv_caches, num_blocks)
        self._by_name = {ly.name: ly for ly in self._layers}
        if self._path is not None:
            self._path.close()
        staging = self._staging[0] if self.settings.load else 0  # only loads land in staging
        self._path = FastPath(self.client, HEADER_BYTES + self._payload, staging, 0.0, self.stats)

    def _require_caches(self) -> None:
        if not self._layers:
            raise RuntimeError("KVPoolConnector: register_kv_caches was not called before a load or save")

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPoolConnectorMetadata)
        self._finish_loads()
        if not meta.loads:
            return
        self._require_caches()
        for rng in meta.loads:
            self._fetch(rng)

    def _fetch(self, rng: BlockRange) -> None:
        """Land the range's blocks (local hits as arena views, the rest in staging slots) and
        check them; the copies into the paged cache follow layer by layer.  A range larger
        than the free slots goes in parts: the blocks landed before are copied in first (all
        layers), which frees their slots — staging stays bounded, and never waits on itself."""
        path = self._path
        assert path is not None
        keys = self._my_space(rng.space).block_keys(rng.tokens)[rng.first:]
        n = len(rng.block_ids)
        step = path.pool.slots or n
        done = 0
        while done < n:
            part = keys[done:done + step]
            if path.pool.slots and path.pool.free < len(part) and self._loading:
                self._finish_loads()
            land = path.read(part, wait_s=0.0)
            good = 0
            for v in land.views[:land.prefix]:
                assert v is not None
                why = check_object(v, self._layout, HEADER_BYTES + self._payload)
                if why is not None:
                    log.warning("kvpool block %d of request %s not loaded: %s", rng.first + done + good, rng.req_id,
                                why)
                    break
                good += 1
            if good:
                self._loading.append((rng.block_ids[done:done + good], land, good, land.rows(0, good)))
            else:
                land.release()
            done += good
            if good < len(part):
                break
        if done < n:
            self._load_errors.update(rng.block_ids[done:])
            self.stats["load_errors"] += n - done

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._loading or layer_name in self._layers_loaded:
            return
        ly = self._by_name.get(layer_name)
        if ly is None:
            return
        self._copy_in(ly)
        self._layers_loaded.add(layer_name)
        if len(self._layers_loaded) == len(self._layers):
            self._finish_loads()

    def _copy_in(self, ly: _Layer) -> None:
        for ids, land, good, rows in self._loading:
            if rows is not None and ly.load_rows(ids[:good], rows):
                continue  # one copy for all the blocks of this landing (16 × 32 KiB: ~12x fewer calls)
            for i in range(good):
                view = land.views[i]
                assert view is not None
                ly.load(ids[i], np.frombuffer(view, np.uint8))

    def _finish_loads(self) -> None:
        """Copy the layers nobody waited for, then release the views' lease."""
        if self._loading:
            for ly in self._layers:
                if ly.name not in self._layers_loaded:
                    self._copy_in(ly)
            for _, land, good, rows in self._loading:
                self.stats["loaded_blocks"] += good
                self.stats[PathStat.RUN_COPIES] += good if rows is not None and self._layers[0].host is not None else 0
                land.release()
        self._loading = []
        self._layers_loaded = set()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        # The whole block (every layer) is one object: the layer's slices are gathered when the
        # step's saves are submitted in wait_for_save, after every layer has been written.
        return

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPoolConnectorMetadata)
        self._finish_loads()
        if not meta.saves:
            return
        self._require_caches()
        for rng in meta.saves:
            self._saves.submit(self._save, rng)

    def _save(self, rng: BlockRange) -> None:
        """Gather the range's blocks from the paged cache straight into reserved arena extents
        (every layer's slice of a block, then its header) and commit them: one copy."""
        path = self._path
        assert path is not None
        n = len(rng.block_ids)
        keys = self._my_space(rng.space).block_keys(rng.tokens)[rng.first:rng.first + n]

        def fill(i: int, obj: memoryview) -> None:
            out = np.frombuffer(obj, np.uint8)
            for ly in self._layers:
                ly.save(rng.block_ids[i], out)
            _write_header(obj, self._layout)

        try:
            codes = path.write(keys, [HEADER_BYTES + self._payload] * n, fill, self.settings.traffic_class)
        except errors.KvpoolError as exc:
            log.warning("kvpool save of %d blocks failed: %s", n, exc)
            self.stats["save_refused"] += n
            return
        ok = sum(c in (pb.OK, pb.ALREADY_EXISTS) for c in codes)
        self.stats["saved_blocks"] += ok
        self.stats["save_refused"] += n - ok

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # A preempted request's blocks are reused after this call: its saves must be done.
        if isinstance(kv_connector_metadata, KVPoolConnectorMetadata):
            for rid in kv_connector_metadata.preempted:
                self._saves.wait(rid)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return (self._saves.finished(finished_req_ids) or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def wait_for_all_saves(self) -> None:
        """Block until every submitted save is stored (tests, shutdown)."""
        self._saves.wait()

    def shutdown(self) -> None:
        self._saves.shutdown()
        self._finish_loads()
        if self._path is not None:
            self._path.close()
        self.client.close()
