"""A KV-aware router's event consumer, as a separate process: it knows nothing of kvpool.

It decodes the events with vLLM's own ``kv_events`` types (copied here the way vLLM's example
subscriber does), so passing means a vLLM-style router understands kvpool's events.  It keeps
one index per instance (block hash → present), recovers from gaps through the replay socket,
and answers on stdin/stdout, one JSON line each:

    {"op": "add", "name": N, "pub": ENDPOINT, "replay": ENDPOINT}  → {"ok": true}
    {"op": "dump"}  → {"index": {N: [hash as hex, ...]}, "last_seq": {N: seq}, "batches": {N: n}}
"""

from __future__ import annotations

import json
import sys
from typing import Any

import msgspec
import zmq
from msgspec.msgpack import Decoder


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class of the KV cache events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def _hex(h: bytes | int) -> str:
    return h.hex() if isinstance(h, bytes) else f"{h:016x}"


class Instance:
    def __init__(self, ctx: zmq.Context[Any], name: str, pub: str, replay: str) -> None:
        self.name = name
        self.sub = ctx.socket(zmq.SUB)
        self.sub.connect(pub)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
        # DEALER, not REQ: a replay answers with one message per batch, and a REQ socket takes
        # only the first.  The empty frame is REQ's envelope, which the publisher expects.
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.setsockopt(zmq.RCVTIMEO, 5000)  # a publisher that died mid-replay: retry on the next gap
        self.replay.connect(replay)
        self.index: set[str] = set()
        self.last: int | None = None
        self.batches = 0

    def apply(self, seq: int, payload: bytes, decoder: Decoder[KVEventBatch]) -> None:
        if self.last is not None and seq <= self.last:
            return  # a duplicate (a replayed batch the snapshot already covered)
        for ev in decoder.decode(payload).events:
            if isinstance(ev, BlockStored):
                self.index.update(_hex(h) for h in ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self.index.difference_update(_hex(h) for h in ev.block_hashes)
            else:
                self.index.clear()
        self.last = seq
        self.batches += 1

    def resync(self, decoder: Decoder[KVEventBatch]) -> None:
        start = 0 if self.last is None else self.last + 1
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            try:
                _, seq_bytes, payload = self.replay.recv_multipart()
            except zmq.Again:
                return
            if not payload:
                return  # the end-of-replay marker
            self.apply(int.from_bytes(seq_bytes, "big"), payload, decoder)

    def on_message(self, decoder: Decoder[KVEventBatch]) -> None:
        _, seq_bytes, payload = self.sub.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big")
        if self.last is None or seq > self.last + 1:
            self.resync(decoder)
        self.apply(seq, payload, decoder)


def main() -> int:
    ctx: zmq.Context[Any] = zmq.Context()
    decoder = Decoder(type=KVEventBatch)
    instances: dict[str, Instance] = {}
    poller = zmq.Poller()
    poller.register(sys.stdin.fileno(), zmq.POLLIN)
    print(json.dumps({"ready": True}), flush=True)
    while True:
        ready = dict(poller.poll(1000))
        for inst in list(instances.values()):
            if inst.sub in ready:
                while inst.sub.poll(0):
                    inst.on_message(decoder)
        if sys.stdin.fileno() in ready:
            line = sys.stdin.readline()
            if not line:
                return 0
            req = json.loads(line)
            if req["op"] == "add":
                inst = instances[req["name"]] = Instance(ctx, req["name"], req["pub"], req["replay"])
                poller.register(inst.sub, zmq.POLLIN)
                inst.resync(decoder)  # a router that joins late starts from a snapshot
                print(json.dumps({"ok": True}), flush=True)
            elif req["op"] == "dump":
                print(json.dumps({"index": {n: sorted(i.index) for n, i in instances.items()},
                                  "last_seq": {n: i.last for n, i in instances.items()},
                                  "batches": {n: i.batches for n, i in instances.items()}}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
