"""The pool's match API for KV-aware routers without a sidecar: ``kvpool router-api``.

    kvpool router-api --pool ADDR[,ADDR...] [--listen HOST:PORT] [--http HOST:PORT]

Answers "how many leading tokens of this prompt does the pool hold, in this key space" over
gRPC (``kvpool.router.v1.Router/PoolMatch``, ``proto/router.proto``) and HTTP/JSON::

    POST /v1/pool/match   Authorization: Bearer <tenant token>
    {"key_space": {"model": "m", "block_tokens": 16, ...}, "tokens": [1, 2, ...]}
      (or "keys": ["<64 hex digits>", ...] instead of key_space + tokens)
    → 200 {"hit_blocks": 3, "hit_tokens": 48, "blocks": 4, "block_tokens": 16, "epoch": 7}
    → 400 (malformed), 401 (unknown token), 503 (no store node reachable)

It computes the block keys as the engines do (:class:`kvpool.KeySpace`), asks the keys' owners
for presence (metadata only, nothing pinned) and returns the leading run.  It holds no
credentials: the caller's token goes to the store nodes, which decide the tenant (and refuse
an unknown token before any lookup), so a router sees only its own tenant's objects.

With ``--tls-dir`` (or ``--tls-cert/--tls-key/--tls-ca``) both APIs serve TLS (HTTPS) with the
certificate the operator issues to the router, and the router reaches the store nodes with it
(mutual TLS, :mod:`kvpool.wire.tls`).  Its callers verify it against the pool's CA bundle; they
need no certificate of their own (their tenant token says who they are).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
import numpy as np

from kvpool.core import errors
from kvpool.core.keys import KEY_BYTES, KeySpace, pack_keys
from kvpool.core.signals import stop_on_signals
from kvpool.pool.fanout import Pool
from kvpool.wire.proto import router_pb2 as rpb
from kvpool.wire.proto import router_pb2_grpc as rpbg
from kvpool.wire.proto import store_pb2 as pb
from kvpool.wire.tls import TlsError, add_port, add_tls_args
from kvpool.wire.tls import from_args as tls_from_args
from kvpool.wire.tls import install as install_tls

log = logging.getLogger("kvpool.apps.router_api")

MAX_TOKENS = 1 << 22
"""A prompt longer than this (4 Mi tokens) is refused, not hashed."""
_KEY_SPACE_FIELDS = ("model", "revision", "lora", "kv_dtype", "layout")


# ------------------------------------------------------------------------------- pure parts


def key_space_from(doc: Mapping[str, Any]) -> KeySpace:
    """A :class:`KeySpace` from its JSON / protobuf fields; InvalidArgument naming the field."""
    if not isinstance(doc, Mapping):
        raise errors.InvalidArgument("key_space must be an object")
    unknown = set(doc) - {*_KEY_SPACE_FIELDS, "extra", "block_tokens"}
    if unknown:
        raise errors.InvalidArgument(f"key_space has unknown fields {sorted(unknown)}")
    vals = {f: doc.get(f, "") or "" for f in _KEY_SPACE_FIELDS}
    if not all(isinstance(v, str) for v in vals.values()) or not vals["model"]:
        raise errors.InvalidArgument("key_space.model is required; model, revision, lora, kv_dtype, layout are strings")
    extra = doc.get("extra") or {}
    if not isinstance(extra, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in extra.items()):
        raise errors.InvalidArgument("key_space.extra must map strings to strings")
    block = doc.get("block_tokens", 128)
    block = 128 if block is None else block
    if isinstance(block, bool) or not isinstance(block, int) or not 0 < block <= 65536:
        raise errors.InvalidArgument(f"key_space.block_tokens must be in [1, 65536], got {block!r}")
    return KeySpace(extra=dict(extra), block_tokens=block, **vals)


def leading_run(present: Sequence[bool] | np.ndarray) -> int:
    """Blocks held from the start: a prefix hit ends at the first missing block."""
    arr = np.asarray(present, dtype=bool)
    miss = np.flatnonzero(~arr)
    return int(miss[0]) if len(miss) else len(arr)


@dataclass(frozen=True)
class MatchResult:
    hit_blocks: int
    blocks: int
    block_tokens: int
    epoch: int

    @property
    def hit_tokens(self) -> int:
        return self.hit_blocks * self.block_tokens

    def as_dict(self) -> dict[str, int]:
        return {"hit_blocks": self.hit_blocks, "hit_tokens": self.hit_tokens, "blocks": self.blocks,
                "block_tokens": self.block_tokens, "epoch": self.epoch}


# -------------------------------------------------------------------------------- the service


class MatchService:
    """One :class:`~kvpool.pool.fanout.Pool` per tenant token (least recently used ones closed),
    each token checked with a store node before its first lookup and again every
    ``auth_seconds`` (a revoked token stops working within that time)."""

    def __init__(self, seeds: Sequence[str], auth_seconds: float = 30.0, ring_seconds: float = 5.0,
                 max_tokens: int = 64) -> None:
        if not [s for s in seeds if s]:
            raise ValueError("the router API needs at least one store node address (--pool)")
        self.seeds = list(seeds)
        self.auth_seconds, self.ring_seconds, self.max_tokens = auth_seconds, ring_seconds, max_tokens
        self._lock = threading.Lock()
        self._pools: OrderedDict[str, tuple[Pool, float, float]] = OrderedDict()  # token → pool, authed, ring

    def _pool(self, token: str) -> Pool:
        now = time.monotonic()
        with self._lock:
            hit = self._pools.get(token)
            if hit is not None:
                self._pools.move_to_end(token)
        if hit is None:
            pool = Pool(self.seeds, token)
            authed = ring = 0.0
        else:
            pool, authed, ring = hit
        if now - authed > self.auth_seconds:
            self._authenticate(pool)
            authed = now
        if now - ring > self.ring_seconds:
            pool.refresh_ring()
            ring = now
        old: list[Pool] = []
        with self._lock:
            self._pools[token] = (pool, authed, ring)
            while len(self._pools) > self.max_tokens:
                old.append(self._pools.popitem(last=False)[1][0])
        for p in old:
            p.close()
        return pool

    def _authenticate(self, pool: Pool) -> None:
        """A store node must know the token (Stats answers only with a valid one)."""
        last: BaseException | None = None
        for node in list(pool.nodes.values()):
            try:
                node.client.stats()
                return
            except errors.Unauthenticated:
                pool.close()
                raise
            except errors.KvpoolError as exc:
                last = exc
        raise errors.Unavailable(f"no store node answered: {last}")

    def match(self, token: str, key_blob: bytes, block_tokens: int) -> MatchResult:
        """Pool hit of the packed 32-byte keys ``key_blob`` (the wire form: no per-key objects)."""
        if len(key_blob) % KEY_BYTES:
            raise errors.InvalidArgument(f"keys: {len(key_blob)} bytes is not a multiple of {KEY_BYTES}")
        if not key_blob:
            return MatchResult(0, 0, block_tokens, 0)
        pool = self._pool(token)
        arr = np.frombuffer(key_blob, dtype=f"V{KEY_BYTES}")
        present = pool.present(arr, pb.BLOCK)
        return MatchResult(leading_run(present), len(arr), block_tokens, pool.ring.epoch)

    def match_tokens(self, token: str, key_space: KeySpace, tokens: Sequence[int] | np.ndarray) -> MatchResult:
        if len(tokens) > MAX_TOKENS:
            raise errors.InvalidArgument(f"{len(tokens)} tokens: more than {MAX_TOKENS}")
        try:
            keys = key_space.block_keys(tokens)
        except ValueError as exc:
            raise errors.InvalidArgument(str(exc)) from None
        return self.match(token, pack_keys(keys), key_space.block_tokens)

    def close(self) -> None:
        with self._lock:
            pools = [p for p, _, _ in self._pools.values()]
            self._pools.clear()
        for p in pools:
            p.close()


def _bearer(value: str | None) -> str:
    if value and value.lower().startswith("bearer "):
        return value[7:].strip()
    return ""


# ------------------------------------------------------------------------------------ gRPC


_GRPC_CODES = {errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
               errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED}


class RouterServicer(rpbg.RouterServicer):
    def __init__(self, service: MatchService) -> None:
        self.service = service

    def PoolMatch(self, request: rpb.PoolMatchRequest, context: grpc.ServicerContext) -> rpb.PoolMatchReply:
        token = _bearer(dict(context.invocation_metadata()).get("authorization"))
        try:
            if request.keys:
                r = self.service.match(token, request.keys, request.key_space.block_tokens or 128)
            else:
                ks = request.key_space
                space = key_space_from({"model": ks.model, "revision": ks.revision, "lora": ks.lora,
                                        "kv_dtype": ks.kv_dtype, "layout": ks.layout, "extra": dict(ks.extra),
                                        "block_tokens": ks.block_tokens or 128})
                r = self.service.match_tokens(token, space, np.asarray(request.tokens, dtype=np.uint32))
        except errors.KvpoolError as exc:
            context.abort(_GRPC_CODES.get(type(exc), grpc.StatusCode.UNAVAILABLE), str(exc))
        return rpb.PoolMatchReply(hit_blocks=r.hit_blocks, hit_tokens=r.hit_tokens, blocks=r.blocks,
                                  block_tokens=r.block_tokens, epoch=r.epoch)


# ------------------------------------------------------------------------------------ HTTP


_HTTP_CODES = {errors.InvalidArgument: 400, errors.Unauthenticated: 401}
MAX_BODY = 64 << 20


def http_match(service: MatchService, token: str, body: bytes) -> tuple[int, dict[str, Any]]:
    """One POST /v1/pool/match: (status, JSON answer)."""
    try:
        try:
            doc = json.loads(body)
        except ValueError as exc:
            raise errors.InvalidArgument(f"the body is not JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise errors.InvalidArgument("the body must be a JSON object")
        if "keys" in doc:
            hexes = doc["keys"]
            if not isinstance(hexes, list) or not all(isinstance(k, str) and len(k) == 2 * KEY_BYTES for k in hexes):
                raise errors.InvalidArgument("keys must be a list of 64-hex-digit block keys")
            try:
                keys = b"".join(bytes.fromhex(k) for k in hexes)
            except ValueError:
                raise errors.InvalidArgument("keys must be hex") from None
            r = service.match(token, keys, int((doc.get("key_space") or {}).get("block_tokens") or 128))
        else:
            tokens = doc.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
                raise errors.InvalidArgument("tokens must be a list of integers")
            r = service.match_tokens(token, key_space_from(doc.get("key_space") or {}), tokens)
        return 200, r.as_dict()
    except errors.KvpoolError as exc:
        return _HTTP_CODES.get(type(exc), 503), {"error": type(exc).__name__, "message": str(exc)}


def _http_handler(service: MatchService) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _reply(self, status: int, doc: Mapping[str, Any]) -> None:
            body = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 - the http.server protocol
            if self.path == "/healthz":
                self._reply(200, {"ok": True})
            else:
                self._reply(404, {"error": "NotFound", "message": self.path})

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/v1/pool/match":
                self._reply(404, {"error": "NotFound", "message": self.path})
                return
            try:
                n = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                n = -1
            if not 0 <= n <= MAX_BODY:
                self._reply(400, {"error": "InvalidArgument", "message": "a Content-Length up to 64 MiB is needed"})
                return
            self._reply(*http_match(service, _bearer(self.headers.get("Authorization")), self.rfile.read(n)))

        def log_message(self, format: str, *args: Any) -> None:  # no per-request log lines
            pass

    return Handler


# ---------------------------------------------------------------------------------- process


def _split(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host or "127.0.0.1", int(port)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvpool router-api", description=__doc__.split("\n\n")[0])
    member = ap.add_argument_group("pool membership")
    member.add_argument("--pool", required=True, help="comma-separated store node addresses (seeds)")
    serve = ap.add_argument_group("listening")
    serve.add_argument("--listen", default="127.0.0.1:7450", help="HOST:PORT of the gRPC API (port 0: any)")
    serve.add_argument("--http", default="127.0.0.1:7451", help="HOST:PORT of the HTTP/JSON API (empty: none)")
    add_tls_args(ap.add_argument_group("security"))
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        tls = tls_from_args(args)
    except TlsError as exc:
        print(f"kvpool router-api: {exc}", file=sys.stderr)
        return 2
    install_tls(tls)  # its clients of the store nodes
    service = MatchService([a.strip() for a in args.pool.split(",") if a.strip()])
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="router-rpc"))
    rpbg.add_RouterServicer_to_server(RouterServicer(service), server)
    host, port = _split(args.listen)
    bound = add_port(server, f"{host}:{port}", tls, client_auth=False)
    if bound == 0:
        print(f"kvpool router-api: cannot listen on {args.listen}", file=sys.stderr)
        return 2
    server.start()
    httpd: ThreadingHTTPServer | None = None
    http_addr = ""
    if args.http:
        httpd = ThreadingHTTPServer(_split(args.http), _http_handler(service))
        httpd.daemon_threads = True
        if tls is not None:
            # The handshake on the first read, in the request's thread, not in the accept loop.
            httpd.socket = tls.listening_context(client_auth=False).wrap_socket(
                httpd.socket, server_side=True, do_handshake_on_connect=False)
        threading.Thread(target=httpd.serve_forever, name="router-http", daemon=True).start()
        http_addr = f"{_split(args.http)[0]}:{httpd.server_port}"
    stop = stop_on_signals()
    print(f"READY {host}:{bound} http={http_addr}", flush=True)
    stop.wait()
    if httpd is not None:
        httpd.shutdown()
    server.stop(grace=0.5).wait()
    service.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
