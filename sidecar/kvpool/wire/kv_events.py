"""KV events for KV-aware routers, in the wire format of vLLM's ``kv_events`` (what the vLLM,
Dynamo and llm-d routers consume).

Wire (as vLLM's ``ZmqEventPublisher``):

- a ZMQ PUB socket sends 3-frame messages ``[topic, seq (8 bytes, big-endian), payload]``;
- ``payload`` is msgpack of an array-like ``KVEventBatch``: ``[ts, [event, ...]]``;
- events are tagged arrays: ``["BlockStored", block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium, lora_name]``, ``["BlockRemoved", block_hashes, medium]``,
  ``["AllBlocksCleared"]`` (decoders of older vLLM versions ignore the trailing fields);
- a ZMQ ROUTER socket serves replay: a request ``[start_seq (8 bytes)]`` is answered by one
  ``[seq, payload]`` frame pair per buffered batch from ``start_seq`` on, then ``[-1, b""]``.

kvpool's mapping: a block hash is the block's 32-byte key, sent whole (``hash_format="bytes"``,
vLLM's default since it moved to SHA-256 hashes) or as the unsigned big-endian integer of its
last 8 bytes (``"int"``, vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` form, for routers that
index 64-bit hashes).  ``parent_block_hash`` is null and ``token_ids`` empty: the keys are
prefix-chained (DESIGN §3), so a flat hash → instance index answers prefix hits by walking a
prompt's keys in order (``kvpool.KeySpace.block_keys``).  ``medium`` is ``"CPU"`` for a
sidecar's local tier and ``"EXTERNAL"`` for the pool's store nodes.

Two kvpool additions that a vLLM consumer never notices:

- sequence numbers start at the publisher's start time in microseconds, so a restarted
  publisher continues above its previous life and a subscriber sees a gap, never a rewind;
- a replay request older than the replay buffer is answered with a snapshot first — one batch
  ``[AllBlocksCleared, BlockStored(every block held now)]`` numbered as the last batch sent —
  so a router that joins late or missed too much converges instead of guessing.

Each life starts with an ``AllBlocksCleared`` event.  A sidecar restarted on the arena of its
previous life (``kvpool.sidecar.journal``) follows it at once with ``BlockStored`` of every block
it adopted (in the same batch, up to ``max_batch`` events): a router's index then holds exactly
what was kept — the blocks dropped at adoption (torn, uncommitted) and any event the killed
process never sent are corrected together.  ``pyzmq`` and ``msgspec`` come with the
``events`` extra and are imported only when a publisher starts.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.wire.counters import EventsCounter

log = logging.getLogger("kvpool.wire.kv_events")

TOPIC = "kv-events"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM_LOCAL = "CPU"
MEDIUM_POOL = "EXTERNAL"
HASH_FORMATS = ("bytes", "int")

# Event tuples handed from the hooks to the publisher (pure data, cheap under the caller's lock).
STORED, REMOVED, CLEARED = 0, 1, 2


def block_hash(key: bytes, hash_format: str) -> bytes | int:
    """The wire form of a block key (see the module docstring)."""
    return key if hash_format == "bytes" else int.from_bytes(key[-8:], "big")


def coalesce(events: Sequence[tuple[int, bytes]]) -> list[tuple[int, list[bytes]]]:
    """Consecutive events of one kind become one event with many hashes (order preserved)."""
    out: list[tuple[int, list[bytes]]] = []
    for kind, key in events:
        if out and out[-1][0] == kind and kind != CLEARED:
            out[-1][1].append(key)
        else:
            out.append((kind, [key] if kind != CLEARED else []))
    return out


def wire_events(events: Sequence[tuple[int, bytes]], medium: str, block_size: int,
                hash_format: str) -> list[list[Any]]:
    """Tagged, array-like events as vLLM encodes them (msgpack-ready lists)."""
    out: list[list[Any]] = []
    for kind, keys in coalesce(events):
        hashes = [block_hash(k, hash_format) for k in keys]
        if kind == STORED:
            out.append(["BlockStored", hashes, None, [], block_size, None, medium, None])
        elif kind == REMOVED:
            out.append(["BlockRemoved", hashes, medium])
        else:
            out.append(["AllBlocksCleared"])
    return out


@dataclass
class EventsConfig:
    """Where and how a sidecar or store node publishes its events."""

    endpoint: str
    """ZMQ endpoint the PUB socket binds (e.g. ``tcp://*:5557``)."""
    replay_endpoint: str = ""
    """ZMQ endpoint of the replay ROUTER socket (empty: no replay, no snapshots)."""
    topic: str = TOPIC
    hash_format: str = "bytes"
    block_size: int = 128
    """Tokens per block, as the routers' BlockStored.block_size."""
    interval: float = 0.02
    """Longest time an event waits to be batched."""
    max_batch: int = 1024
    """Events per batch at most (a larger backlog goes out in several batches)."""
    buffer_batches: int = 4096
    """Batches kept for replay."""
    heartbeat: float = 1.0
    """An empty batch after this long without one: a subscriber that missed the last batches
    (or a restart's first) sees the gap within this time even when nothing else happens."""


class EventPublisher:
    """Batches stored/removed events and publishes them on ZMQ (one thread owns both sockets).

    :meth:`stored`, :meth:`removed` and :meth:`cleared` only append to a list: safe to call
    under the caller's index lock, never blocking on the network.  ``snapshot`` (optional)
    returns every block key held now together with the events not yet taken
    (:meth:`take_pending`), both under the caller's lock, so a snapshot is exact at its
    sequence number.
    """

    def __init__(self, cfg: EventsConfig, medium: str,
                 snapshot: Callable[[], tuple[list[bytes], list[tuple[int, bytes]]]] | None = None) -> None:
        if cfg.hash_format not in HASH_FORMATS:
            raise ValueError(f"hash format must be one of {HASH_FORMATS}, got {cfg.hash_format!r}")
        import msgspec
        import zmq

        self.cfg, self.medium, self._snapshot = cfg, medium, snapshot
        self._zmq = zmq
        self._encode = msgspec.msgpack.Encoder().encode
        self._lock = threading.Lock()
        self._pending: list[tuple[int, bytes]] = [(CLEARED, b"")]
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.seq = time.time_ns() // 1000  # microseconds: a restart continues above the last life
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=cfg.buffer_batches)
        self.counters: collections.Counter[str] = collections.Counter()
        self._last_send = 0.0
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.bind(cfg.endpoint)
        self._replay = None
        if cfg.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(cfg.replay_endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else ""
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    # -- hooks (called under the owner's lock) --------------------------------------------------

    def stored(self, key: bytes) -> None:
        with self._lock:
            self._pending.append((STORED, key))
            if len(self._pending) >= self.cfg.max_batch:
                self._wake.set()

    def removed(self, key: bytes) -> None:
        with self._lock:
            self._pending.append((REMOVED, key))
            if len(self._pending) >= self.cfg.max_batch:
                self._wake.set()

    def cleared(self) -> None:
        with self._lock:
            self._pending.append((CLEARED, b""))

    def take_pending(self) -> list[tuple[int, bytes]]:
        with self._lock:
            out, self._pending = self._pending, []
            return out

    # -- the publisher thread ----------------------------------------------------------------------

    def _batch(self, events: Sequence[tuple[int, bytes]]) -> bytes:
        return bytes(self._encode([time.time(), wire_events(events, self.medium, self.cfg.block_size,
                                                            self.cfg.hash_format)]))

    def _send(self, events: Sequence[tuple[int, bytes]]) -> None:
        self._last_send = time.monotonic()
        for i in range(0, max(len(events), 1), self.cfg.max_batch):
            payload = self._batch(events[i:i + self.cfg.max_batch])
            self.seq += 1
            self._buffer.append((self.seq, payload))
            self._pub.send_multipart([self.cfg.topic.encode(), self.seq.to_bytes(8, "big"), payload])
            self.counters[EventsCounter.BATCHES] += 1
        self.counters[EventsCounter.EVENTS] += len(events)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        zmq = self._zmq
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                self.counters[EventsCounter.REPLAY_MALFORMED] += 1
                continue
            ident, _, raw = frames
            start = int.from_bytes(raw, "big")
            oldest = self._buffer[0][0] if self._buffer else self.seq + 1
            if start < oldest and self._snapshot is not None:
                keys, pending = self._snapshot()
                if pending:
                    self._send(pending)  # everything before the snapshot, in order
                snap = [(CLEARED, b"")] + [(STORED, k) for k in keys]
                self._replay.send_multipart([ident, b"", self.seq.to_bytes(8, "big"), self._batch(snap)])
                self.counters[EventsCounter.SNAPSHOTS] += 1
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._replay.send_multipart([ident, b"", seq.to_bytes(8, "big"), payload])
            self._replay.send_multipart([ident, b"", END_SEQ, b""])
            self.counters[EventsCounter.REPLAYS] += 1

    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if self._replay is not None:
                    if poller.poll(int(self.cfg.interval * 1000)):
                        self._serve_replay()
                else:
                    self._wake.wait(self.cfg.interval)
                self._wake.clear()
                events = self.take_pending()
                if events or time.monotonic() - self._last_send >= self.cfg.heartbeat:
                    self._send(events)
            except Exception:  # a router's bad request or a full queue must not stop the events
                log.exception("kv events publisher")
                self.counters[EventsCounter.ERRORS] += 1
        events = self.take_pending()
        if events:
            self._send(events)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)
        self._ctx.term()


def add_event_args(ap: Any) -> None:
    """The ``--events-*`` options of ``kvpool sidecar`` and ``kvpool store``."""
    ap.add_argument("--events-endpoint", default="",
                    help="ZMQ endpoint to publish KV events on (vLLM kv_events format), e.g. tcp://*:5557")
    ap.add_argument("--events-replay-endpoint", default="", help="ZMQ endpoint of the events replay socket")
    ap.add_argument("--events-topic", default=TOPIC, help=f"topic of the published events (default {TOPIC})")
    ap.add_argument("--events-hash-format", choices=HASH_FORMATS, default="bytes",
                    help="block hashes as the 32-byte keys or as the integer of their last 8 bytes")
    ap.add_argument("--events-block-size", type=int, default=128, help="tokens per block (BlockStored.block_size)")


def events_config(args: Any) -> EventsConfig | None:
    if not getattr(args, "events_endpoint", ""):
        return None
    if args.events_block_size <= 0:
        raise SystemExit("--events-block-size must be positive")
    return EventsConfig(endpoint=args.events_endpoint, replay_endpoint=args.events_replay_endpoint,
                        topic=args.events_topic, hash_format=args.events_hash_format,
                        block_size=args.events_block_size)
