"""The pool's match API for routers without a sidecar (``kvpool router-api``), gRPC and HTTP/JSON,
against a real pool: hit lengths follow what the tenant's sidecar wrote, other tenants and
unknown tokens see nothing.  The router serves TLS with a certificate from the pool's CA, and
its callers verify it (they present none)."""

from __future__ import annotations

import json
import os
import random
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from kvpool.apps.cluster import LocalCluster
from kvpool.core import pki
from kvpool.core.keys import KeySpace
from kvpool.wire.proto import router_pb2 as rpb
from kvpool.wire.proto import router_pb2_grpc as rpbg

B = 16


@pytest.fixture
def pool() -> Iterator[tuple[LocalCluster, str, str]]:
    with LocalCluster(stores=2, sidecars=2, tenants=["t1", "t2"], store_bytes=32 << 20, local_bytes=8 << 20,
                      block_tokens=B) as lc:
        router = lc.issue("router", pki.Identity(pki.ROLE_ROUTER))
        proc = subprocess.Popen([sys.executable, "-m", "kvpool", "router-api", "--pool", ",".join(lc.stores),
                                 "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0",
                                 "--tls-dir", os.path.dirname(router.cert_file)],
                                stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            assert proc.stdout is not None
            ready = proc.stdout.readline().split()
            assert ready and ready[0] == "READY", ready
            yield lc, ready[1], ready[2].removeprefix("http=")
        finally:
            proc.kill()
            proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()


def _ca(lc: LocalCluster) -> bytes:
    assert lc.ca is not None
    return lc.ca.cert_pem


def _http(addr: str, token: str, doc: Any, ca: bytes) -> tuple[int, dict[str, Any]]:
    ctx = ssl.create_default_context(cadata=ca.decode())
    req = urllib.request.Request(f"https://{addr}/v1/pool/match", data=json.dumps(doc).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"} if token else {})})
    try:
        with urllib.request.urlopen(req, timeout=30, context=ctx) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_pool_hit_length_over_grpc_and_http(pool: tuple[LocalCluster, str, str], h: Any) -> None:
    lc, grpc_addr, http_addr = pool

    def http(token: str, doc: Any) -> tuple[int, dict[str, Any]]:
        return _http(http_addr, token, doc, _ca(lc))
    rng = random.Random(3)
    space = {"model": "m", "revision": "r1", "block_tokens": B}
    ks = KeySpace("m", revision="r1", block_tokens=B)
    prompt = [rng.randrange(50000) for _ in range(6 * B + 5)]
    keys = ks.block_keys(prompt)
    t1, t2 = lc.tokens["t1"], lc.tokens["t2"]
    c1 = lc.connect(0)
    assert c1.put(keys[:4], [rng.randbytes(4096) for _ in range(4)]) == [0] * 4
    # Written through to the pool in the background: wait for the router to see it (liveness).
    doc = {"key_space": space, "tokens": prompt}
    st, got = h.wait_for(lambda: (lambda r: r if r[1].get("hit_blocks") == 4 else None)(http(t1, doc)),
                         30, what="the blocks in the pool")
    assert st == 200 and got["hit_tokens"] == 4 * B and got["blocks"] == 6 and got["block_tokens"] == B
    assert got["epoch"] >= 1
    # A prompt sharing two blocks, then diverging; the block keys themselves.
    other = prompt[:2 * B] + [50001] * (4 * B)
    assert http(t1, {"key_space": space, "tokens": other})[1]["hit_blocks"] == 2
    assert http(t1, {"keys": [k.hex() for k in keys[:3] + keys[5:]]})[1]["hit_blocks"] == 3
    # Another key space (another revision): nothing.
    assert http(t1, {"key_space": {**space, "revision": "r2"}, "tokens": prompt})[1]["hit_blocks"] == 0
    # Another tenant's view of the same prompt is empty; unknown and missing tokens are refused.
    assert http(t2, doc) == (200, {**got, "hit_blocks": 0, "hit_tokens": 0})
    assert http("not-a-token", doc)[0] == 401
    assert http("", doc)[0] == 401
    assert http(t1, {"key_space": {"block_tokens": B}, "tokens": prompt})[0] == 400  # no model
    assert http(t1, {"key_space": space, "tokens": [-1] * B})[0] == 400
    assert http(t1, {"keys": ["zz"]})[0] == 400

    # A caller that does not trust the pool's CA is refused at the handshake, at once.
    stranger = ssl.create_default_context(cadata=pki.make_ca("another CA").cert_pem.decode())
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(f"https://{http_addr}/v1/pool/match", data=b"{}", timeout=10, context=stranger)
    creds = grpc.ssl_channel_credentials(root_certificates=_ca(lc))
    with grpc.secure_channel(grpc_addr, creds, options=[("grpc.enable_http_proxy", 0)]) as ch:
        stub = rpbg.RouterStub(ch)  # type: ignore[no-untyped-call]
        req = rpb.PoolMatchRequest(key_space=rpb.KeySpace(model="m", revision="r1", block_tokens=B), tokens=prompt)
        r = stub.PoolMatch(req, metadata=(("authorization", f"Bearer {t1}"),), timeout=30)
        assert (r.hit_blocks, r.hit_tokens, r.blocks, r.block_tokens) == (4, 4 * B, 6, B)
        r = stub.PoolMatch(rpb.PoolMatchRequest(keys=b"".join(keys)), metadata=(("authorization", f"Bearer {t1}"),),
                           timeout=30)
        assert r.hit_blocks == 4
        assert stub.PoolMatch(req, metadata=(("authorization", f"Bearer {t2}"),), timeout=30).hit_blocks == 0
        with pytest.raises(grpc.RpcError) as err:
            stub.PoolMatch(req, metadata=(("authorization", "Bearer nope"),), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            stub.PoolMatch(rpb.PoolMatchRequest(keys=b"short"), metadata=(("authorization", f"Bearer {t1}"),),
                           timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Blocks written later count as soon as the pool holds them (nothing is cached but the token check).
    assert c1.put(keys[4:6], [rng.randbytes(4096) for _ in range(2)]) == [0] * 2
    h.wait_for(lambda: http(t1, doc)[1].get("hit_blocks") == 6, 30, what="the new blocks seen")
