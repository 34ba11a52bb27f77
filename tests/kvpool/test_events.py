"""KV events, pure: the wire form of kvpool's events as vLLM's kv_events types decode it."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from kvpool.wire.kv_events import CLEARED, REMOVED, STORED, block_hash, coalesce, wire_events

msgspec = pytest.importorskip("msgspec", reason="the events extra is not installed")

K = [hashlib.sha256(bytes([i])).digest() for i in range(5)]


def test_block_hash_forms() -> None:
    assert block_hash(K[0], "bytes") == K[0]
    assert block_hash(K[0], "int") == int.from_bytes(K[0][-8:], "big") < 1 << 64


def test_coalesce_keeps_order_and_merges_runs() -> None:
    ev = [(STORED, K[0]), (STORED, K[1]), (REMOVED, K[0]), (CLEARED, b""), (CLEARED, b""), (STORED, K[2])]
    assert coalesce(ev) == [(STORED, [K[0], K[1]]), (REMOVED, [K[0]]), (CLEARED, []), (CLEARED, []),
                            (STORED, [K[2]])]


def _router_types() -> Any:
    """vLLM's kv_events types, as the router process of the integration test declares them."""
    path = Path(__file__).resolve().parent / "sidecar" / "_kv_router.py"
    spec = importlib.util.spec_from_file_location("_kv_router_types", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # msgspec resolves the (string) annotations through it
    spec.loader.exec_module(mod)
    return mod


V = _router_types()
BlockStored, BlockRemoved, AllBlocksCleared, KVEventBatch = V.BlockStored, V.BlockRemoved, V.AllBlocksCleared, \
    V.KVEventBatch


class OldBlockStored(V.KVCacheEvent, tag="BlockStored"):  # type: ignore[misc,call-arg]
    """vLLM before ``medium`` and ``lora_name``."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


@pytest.mark.parametrize("fmt", ["bytes", "int"])
def test_vllm_types_decode_kvpool_batches(fmt: str) -> None:
    ev = [(CLEARED, b""), (STORED, K[0]), (STORED, K[1]), (REMOVED, K[1])]
    payload = msgspec.msgpack.encode([12.5, wire_events(ev, "CPU", 16, fmt)])
    batch = msgspec.msgpack.Decoder(KVEventBatch).decode(payload)
    assert batch.ts == 12.5 and batch.data_parallel_rank is None
    cleared, stored, removed = batch.events
    assert isinstance(cleared, AllBlocksCleared)
    assert stored == BlockStored([block_hash(K[0], fmt), block_hash(K[1], fmt)], None, [], 16, None, "CPU", None)
    assert removed == BlockRemoved([block_hash(K[1], fmt)], "CPU")
    if fmt == "int":  # an older vLLM decoder ignores the trailing fields it does not know
        old: Any = msgspec.msgpack.Decoder(OldBlockStored).decode(msgspec.msgpack.encode(wire_events(ev, "CPU", 16,
                                                                                                     fmt)[1]))
        assert old.block_hashes == [block_hash(K[0], fmt), block_hash(K[1], fmt)] and old.block_size == 16
