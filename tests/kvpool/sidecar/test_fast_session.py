"""The client↔sidecar fast session on a real sidecar: the same answers as gRPC, the tenant
check, one-way releases, and malformed or truncated frames that close only their connection."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

import kvpool
from kvpool.client.session import FastSession
from kvpool.core import errors
from kvpool.transfer.testing import RawConnection, unix_socket
from kvpool.wire import sidecar_frames as fp
from kvpool.wire.proto import store_pb2 as pb

MiB = 1 << 20
CLUSTER = {"stores": 1, "sidecars": 1, "store_bytes": 64 * MiB, "local_bytes": 32 * MiB}


def _path(cluster: Any) -> str:
    return fp.socket_path(cluster.sidecars[0][len("unix://"):])


class Raw(RawConnection):
    """A hand-driven fast-session connection."""

    def __init__(self, cluster: Any) -> None:
        super().__init__(unix_socket(_path(cluster)))

    def call(self, op: int, **kw: Any) -> tuple[fp.Response, str, bytes]:
        self.rid += 1
        self.send(fp.encode_request(op, self.rid, **kw))
        resp = fp.decode_response(self.recv(fp.RESPONSE_SIZE))
        msg = self.recv(resp.msg_len).decode() if resp.msg_len else ""
        return resp, msg, self.recv(resp.body_bytes()) if resp.body_bytes() else b""


@pytest.fixture
def raw(module_cluster: Any) -> Iterator[Raw]:
    r = Raw(module_cluster)
    yield r
    r.close()


def _still_serving(cluster: Any, rng: random.Random) -> None:
    assert cluster.sidecar_procs[0].popen.poll() is None
    with kvpool.connect(cluster.sidecars[0]) as c:
        keys = [rng.randbytes(32) for _ in range(2)]
        values = [rng.randbytes(100), rng.randbytes(5000)]
        assert c.put(keys, values) == [pb.OK, pb.OK]
        with c.get(keys) as got:
            assert [bytes(v) for v in got] == values


def test_a_one_way_release_frees_the_lease(module_cluster: Any, rng: random.Random, h: Any) -> None:
    """A removed object stays allocated while a read lease pins it; the release that the fast
    session sends without waiting frees it (seen in the sidecar's used bytes)."""
    with kvpool.connect(module_cluster.sidecars[0]) as c:
        [key] = [rng.randbytes(32)]
        assert c.put([key], [rng.randbytes(2 * MiB)]) == [pb.OK]
        h.wait_for(lambda: c.stats().pending_pool_bytes == 0, what="write-through")
        base = c.stats().local_used_bytes
        got = c.get([key])
        assert c.remove([key]) == [pb.OK]
        assert c.stats().local_used_bytes == base  # still pinned by the read
        c._release_async(got.lease_id)
        got.lease_id = 0
        h.wait_for(lambda: c.stats().local_used_bytes < base, what="the one-way release")


def test_hello_names_the_tenant_and_comes_first(module_cluster: Any, raw: Raw, rng: random.Random) -> None:
    keys = rng.randbytes(64)
    resp, msg, _ = raw.call(fp.OP_MATCH, keys=keys)
    assert resp.status == errors.SESSION_STATUS[errors.Unauthenticated] and "HELLO first" in msg
    resp, msg, _ = raw.call(fp.OP_HELLO, text=b"someone-else")
    assert resp.status == errors.SESSION_STATUS[errors.PermissionDenied] and "someone-else" in msg
    resp, _, _ = raw.call(fp.OP_READ, keys=keys)  # still not greeted
    assert resp.status == errors.SESSION_STATUS[errors.Unauthenticated]
    assert raw.call(fp.OP_HELLO, text=b"default")[0].status == 0
    resp, _, body = raw.call(fp.OP_READ, keys=keys)
    assert resp.status == 0 and fp.decode_table(resp, body, 1 << 40).codes == [pb.NOT_FOUND] * 2
    # A client that expects another tenant is refused at connect (there is no other wire to fall back to).
    with pytest.raises(errors.PermissionDenied):
        FastSession(_path(module_cluster), "someone-else", 1 << 20)


def test_bad_arguments_are_a_status_and_keep_the_connection(raw: Raw, rng: random.Random) -> None:
    assert raw.call(fp.OP_HELLO)[0].status == 0
    resp, msg, _ = raw.call(fp.OP_READ, keys=rng.randbytes(32), kind=7)
    assert resp.status == errors.SESSION_STATUS[errors.InvalidArgument] and "kind 7" in msg
    resp, msg, _ = raw.call(fp.OP_WRITE_START, keys=rng.randbytes(32), kind=9, values=[1])
    assert resp.status == errors.SESSION_STATUS[errors.InvalidArgument]
    resp, _, body = raw.call(fp.OP_WRITE_START, keys=rng.randbytes(64), values=[10, 10])
    assert resp.status == 0 and resp.ref and fp.decode_table(resp, body, 1 << 40).codes == [pb.OK] * 2
    resp, msg, _ = raw.call(fp.OP_WRITE_COMMIT, ref=resp.ref, values=[0])  # 1 checksum for 2 items
    assert resp.status == errors.SESSION_STATUS[errors.InvalidArgument] and "1 checksums for 2" in msg
    resp, _, body = raw.call(fp.OP_WRITE_COMMIT, ref=987654321, values=[0])
    assert fp.decode_table(resp, body, 1).codes == [pb.LEASE_EXPIRED]
    assert raw.call(fp.OP_RELEASE, releases=[0, 1, 2**63])[0].status == 0  # unknown leases: harmless


@pytest.mark.parametrize("case", ["magic", "version", "op", "count", "no-reply", "utf8"])
def test_malformed_frames_close_only_their_connection(module_cluster: Any, raw: Raw, rng: random.Random,
                                                      case: str) -> None:
    other = Raw(module_cluster)
    try:
        assert other.call(fp.OP_HELLO)[0].status == 0
        head = bytearray(b"".join(fp.encode_request(fp.OP_MATCH, 1, keys=rng.randbytes(32))))
        if case == "magic":
            head[:4] = b"XXXX"
        elif case == "version":
            head[4] = 99
        elif case == "op":
            head[5] = 77
        elif case == "count":
            head[12:16] = (fp.MAX_KEYS + 1).to_bytes(4, "little")
        elif case == "no-reply":
            head[7] = fp.FLAG_NO_REPLY
        else:
            head = bytearray(b"".join(fp.encode_request(fp.OP_HELLO, 1, text=b"ab")))
            head[-2:] = b"\xff\xfe"
        raw.send(bytes(head))
        assert raw.closed_by_peer()
        assert other.call(fp.OP_MATCH, keys=rng.randbytes(32))[0].status == 0  # unaffected
    finally:
        other.close()
    _still_serving(module_cluster, rng)


def test_truncated_frames_never_wedge_the_sidecar(module_cluster: Any, rng: random.Random) -> None:
    frame = b"".join(fp.encode_request(fp.OP_MATCH, 1, keys=rng.randbytes(32 * 4)))
    for cut in (3, fp.REQUEST_SIZE, len(frame) - 1):
        r = Raw(module_cluster)
        r.send(frame[:cut])
        r.close()
    _still_serving(module_cluster, rng)


def test_a_client_without_the_fast_socket_is_refused(module_cluster: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast session is the one wire for the hot calls: no gRPC fallback to fall into."""
    monkeypatch.setattr("kvpool.client.client.fast_socket_path", lambda p: p + ".nothing-here")
    with pytest.raises(errors.Unavailable, match="no fast session"):
        kvpool.connect(module_cluster.sidecars[0])


def test_a_forked_child_opens_its_own_connections(module_cluster: Any, rng: random.Random) -> None:
    """Engines fork workers after connecting: a child must not speak on its parent's streams."""
    import os

    with kvpool.connect(module_cluster.sidecars[0]) as c:
        keys = [rng.randbytes(32) for _ in range(2)]
        assert c.put(keys, [b"parent", b"both"]) == [pb.OK, pb.OK]
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: read through the inherited client, report, exit at once
            ok = b"0"
            try:
                with c.get(keys) as got:
                    ok = b"1" if [bytes(v) for v in got] == [b"parent", b"both"] else b"0"
            finally:
                os.write(w, ok)
                os._exit(0)
        os.close(w)
        for _ in range(50):  # the parent keeps using its own connections meanwhile
            assert c.match(keys) == 2
        assert os.read(r, 1) == b"1"
        os.waitpid(pid, 0)
        os.close(r)
        with c.get(keys) as got:
            assert bytes(got[0]) == b"parent"
