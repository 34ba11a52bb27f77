"""The data session on real nodes: per-item answers, tokens, duplicates that cost no bytes, killed
writers, malformed frames, checksums, match leases, and a node without the session (no data)."""

from __future__ import annotations

import base64
import random
import socket
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from kvpool.core import errors
from kvpool.core.checksum import checksum
from kvpool.pool.node_client import StoreClient
from kvpool.transfer.testing import RawConnection, tcp_socket
from kvpool.wire import store_frames as dp
from kvpool.wire.counters import StoreCounter
from kvpool.wire.proto import store_pb2 as pb

KiB, MiB = 1 << 10, 1 << 20
TENANTS = [
    {"tenantId": "alpha", "token": "tok-alpha", "salt": base64.b64encode(b"a").decode(), "quotaBytes": 1 * MiB},
    {"tenantId": "beta", "token": "tok-beta", "salt": base64.b64encode(b"b").decode()},
]


@pytest.fixture(scope="module")
def nodes(module_stores: Any) -> Any:
    return module_stores.start_many({
        "open": {"dram": "32MiB"},
        "tenants": {"dram": "16MiB", "tenants": TENANTS, "closed": True},
    })


class Raw(RawConnection):
    """A hand-driven data-session connection (frames built with the protocol module)."""

    def __init__(self, node: Any) -> None:
        super().__init__(tcp_socket(node.transfer_address))

    def response(self) -> tuple[dp.Response, str, bytes]:
        resp = dp.decode_response(self.recv(dp.RESPONSE_SIZE))
        msg = self.recv(resp.msg_len).decode() if resp.msg_len else ""
        return resp, msg, self.recv(resp.body_bytes()) if resp.body_bytes() else b""

    def request(self, op: int, token: bytes, keys: bytes, **kw: Any) -> None:
        self.rid += 1
        self.send(dp.encode_request(op, self.rid, token, keys, **kw))

    def hello_ok(self) -> bool:
        self.request(dp.OP_HELLO, dp.HELLO_PADDING, b"")
        return self.response()[0].status == 0


def test_the_data_session_answers_per_item(nodes: Any, h: Any, rng: random.Random) -> None:
    c = nodes["open"].client()
    keys = h.rand_keys(rng, 7)
    vals = h.rand_values(rng, [1, 4 * KiB, 100_000, 1 * MiB, 3, 65 * KiB, 2 * MiB + 1])
    assert c.put(keys[:3], vals[:3]) == [pb.OK] * 3
    # A batch with already-stored items, a repeated key and an empty value.
    codes = c.put(keys[1:5] + [keys[4], keys[6]], vals[1:5] + [vals[4], b""])
    assert codes == [pb.ALREADY_EXISTS, pb.ALREADY_EXISTS, pb.OK, pb.OK, pb.INVALID, pb.INVALID]
    assert c.put([keys[5], keys[6]], [vals[5], vals[6]]) == [pb.OK, pb.OK]
    got = c.get(keys + [b"\x00" * 32])
    assert [bytes(g) if g is not None else None for g in got] == vals + [None]
    bufs = [bytearray(len(v)) for v in vals]
    assert c.get_into(keys, [memoryview(b) for b in bufs]) == [pb.OK] * 7
    assert [bytes(b) for b in bufs] == vals
    missing = h.rand_keys(rng, 1)[0]
    r = c.exists(keys[:3] + [missing] + keys[3:], prefix_only=False)
    assert (r.prefix, r.present) == (3, [True, True, True, False] + [True] * 4)
    assert c.exists(keys[:3] + [missing] + keys[3:]).present == [True] * 3 + [False] * 5
    # Block and state objects are separate kinds.
    assert c.get([keys[0]], kind=pb.STATE) == [None]
    assert c.put([keys[0]], [b"state"], kind=pb.STATE) == [pb.OK]
    assert [bytes(g) for g in c.get([keys[0]], kind=pb.STATE) if g is not None] == [b"state"]
    assert c.exists([keys[0]], kind=pb.STATE).present == [True]
    assert c.remove(keys) == [pb.OK] * 7
    assert c.get(keys) == [None] * 7


def test_tokens_quota_and_tenant_isolation(nodes: Any, h: Any, rng: random.Random) -> None:
    node = nodes["tenants"]
    a, b = node.client("tok-alpha"), node.client("tok-beta")
    [key] = h.rand_keys(rng, 1)
    assert a.put([key], [b"alpha bytes"]) == [pb.OK]
    assert b.get([key]) == [None] and b.exists([key]).present == [False]
    assert b.put([key], [b"beta bytes"]) == [pb.OK]
    assert [bytes(g) for g in a.get([key]) if g] == [b"alpha bytes"]
    assert [bytes(g) for g in b.get([key]) if g] == [b"beta bytes"]
    # The quota (1 MiB for alpha) refuses in batch order, item by item.
    keys = h.rand_keys(rng, 6)
    codes = a.put(keys, [b"q" * (256 * KiB)] * 6)
    assert codes == [pb.OK] * 3 + [pb.QUOTA_EXCEEDED] * 3
    a.remove(keys + [key])
    b.remove([key])
    for token in ("", "tok-nobody"):
        c = node.client(token)
        calls: list[Any] = [lambda c=c: c.get([key]), lambda c=c: c.put([key], [b"x"]), lambda c=c: c.exists([key])]
        for call in calls:
            with pytest.raises(errors.Unauthenticated):
                call()


def test_parts_of_one_batch_reserve_in_batch_order(nodes: Any, h: Any, rng: random.Random) -> None:
    """Part 1 of a batch arrives first, on its own connection: the node holds it until part 0
    has reserved, so alpha's quota (1 MiB) goes to part 0's items, as in one frame."""
    node = nodes["tenants"]
    first, second = Raw(node), Raw(node)
    try:
        keys = h.rand_keys(rng, 8)
        size = 256 * KiB
        sizes = np.full(4, size, np.uint64)
        batch = rng.randrange(1, 1 << 48)
        second.request(dp.OP_PUT, b"tok-alpha", b"".join(keys[4:]), sizes=sizes,
                       lease_id=dp.order_ticket(batch, 1, 2))
        second.sock.settimeout(0.1)
        with pytest.raises(TimeoutError):
            second.recv(1)  # waiting for its turn: no PUT_READY yet
        second.sock.settimeout(10)
        first.request(dp.OP_PUT, b"tok-alpha", b"".join(keys[:4]), sizes=sizes,
                      lease_id=dp.order_ticket(batch, 0, 2))
        r0, _, codes0 = first.response()
        r1, _, codes1 = second.response()
        assert list(codes0) == [pb.OK] * 4 and list(codes1) == [pb.QUOTA_EXCEEDED] * 4
        first.send([bytes([k]) * size for k in range(4)] + [dp.encode_checksums([checksum(bytes([k]) * size)
                                                                                for k in range(4)])])
        assert list(first.response()[2]) == [pb.OK] * 4
    finally:
        first.close()
        second.close()
    client = node.client("tok-alpha")
    assert [bytes(g) if g is not None else None for g in client.get(keys)] == \
        [bytes([k]) * size for k in range(4)] + [None] * 4
    client.remove(keys[:4])


def test_a_part_whose_predecessor_never_comes_is_served_after_the_bounded_wait(
        nodes: Any, h: Any, rng: random.Random) -> None:
    node = nodes["open"]
    raw = Raw(node)
    try:
        [key] = h.rand_keys(rng, 1)
        raw.request(dp.OP_PUT, b"", key, sizes=np.array([5], np.uint64),
                    lease_id=dp.order_ticket(rng.randrange(1, 1 << 48), 1, 2))
        resp, _, codes = raw.response()  # part 0 never arrives: served once the wait ran out
        assert resp.status == 0 and list(codes) == [pb.OK]
        raw.send([b"hello", dp.encode_checksums([checksum(b"hello")])])
        assert list(raw.response()[2]) == [pb.OK]
        assert node.client().stats().counters[StoreCounter.PUT_ORDER_WAITED_OUT] >= 1
        # A ticket that makes no sense (part past the count) is served unordered, not refused.
        [other] = h.rand_keys(rng, 1)
        raw.request(dp.OP_PUT, b"", other, sizes=np.array([2], np.uint64), lease_id=(7 << 16) | (1 << 8) | 5)
        assert list(raw.response()[2]) == [pb.OK]
        raw.send([b"ok", dp.encode_checksums([checksum(b"ok")])])
        assert list(raw.response()[2]) == [pb.OK]
    finally:
        raw.close()
    assert [bytes(g) for g in node.client().get([key, other]) if g is not None] == [b"hello", b"ok"]


def test_concurrent_parts_keep_the_quota_in_batch_order(nodes: Any, h: Any, rng: random.Random) -> None:
    """Many batches, each cut over two connections: every one refuses from the same item on
    (alpha's quota of 1 MiB holds 4 of the 6 values)."""
    client = nodes["tenants"].client("tok-alpha")
    for _ in range(20):
        keys = h.rand_keys(rng, 6)
        assert client.put(keys, [b"q" * (256 * KiB)] * 6) == [pb.OK] * 4 + [pb.QUOTA_EXCEEDED] * 2
        assert client.remove(keys[:4]) == [pb.OK] * 4


def test_a_read_takes_as_many_connections_as_it_is_told(nodes: Any, h: Any, rng: random.Random) -> None:
    """A sidecar reading several nodes at once asks each for one stream; by default a batch is
    cut over the session's two connections."""
    client = StoreClient(nodes["open"].address)
    try:
        keys = h.rand_keys(rng, 4)
        assert client.put(keys, [bytes([k]) * 1000 for k in range(4)]) == [pb.OK] * 4
        ds = client.session()
        assert ds.connections == 2
        for streams, want in ((1, 1), (None, 2)):
            for s in ds._idle:
                s.close()
            ds._idle.clear()
            bufs = [bytearray(1000) for _ in keys]
            r = client.read(b"".join(keys), lambda i, size, bufs=bufs: memoryview(bufs[i]), streams=streams)
            assert r.codes == [pb.OK] * 4 and [bytes(b) for b in bufs] == [bytes([k]) * 1000 for k in range(4)]
            assert len(ds._idle) == want  # the connections this read opened, back in the pool
        client.remove(keys)
    finally:
        client.close()


def test_wrong_token_is_a_status_and_keeps_the_connection(nodes: Any, h: Any, rng: random.Random) -> None:
    node = nodes["tenants"]
    [key] = h.rand_keys(rng, 1)
    assert node.client("tok-alpha").put([key], [b"secret"]) == [pb.OK]
    raw = Raw(node)
    try:
        for op in (dp.OP_GET, dp.OP_EXISTS):
            raw.request(op, b"tok-beta-guess", key)
            resp, msg, body = raw.response()
            assert resp.status == errors.SESSION_STATUS[errors.Unauthenticated] and "token" in msg
            assert (resp.payload_len, body) == (0, b"")
        raw.request(dp.OP_PUT, b"", key, sizes=np.array([6], np.uint64))
        resp, _, body = raw.response()
        assert resp.op == dp.OP_PUT_READY and resp.status == errors.SESSION_STATUS[errors.Unauthenticated]
        assert raw.hello_ok()  # the same connection still serves
        raw.request(dp.OP_GET, b"tok-alpha", key)
        resp, _, body = raw.response()
        assert resp.status == 0 and resp.payload_len == 6 and raw.recv(6) == b"secret"
    finally:
        raw.close()


def test_duplicate_put_is_answered_before_any_byte(nodes: Any, h: Any, rng: random.Random) -> None:
    node = nodes["open"]
    c = node.client()
    keys = h.rand_keys(rng, 2)
    assert c.put(keys[:1], [b"first"]) == [pb.OK]
    raw = Raw(node)
    try:
        raw.request(dp.OP_PUT, b"", keys[0], sizes=np.array([MiB], np.uint64))
        resp, _, body = raw.response()
        assert resp.op == dp.OP_PUT_READY and list(body) == [pb.ALREADY_EXISTS]
        # No payload follows and no PUT_DONE comes: the next frame is served at once.
        assert raw.hello_ok()
        # A mixed batch: only the new item's bytes are sent, then PUT_DONE.
        value = rng.randbytes(10 * KiB)
        raw.request(dp.OP_PUT, b"", keys[0] + keys[1], sizes=np.array([MiB, len(value)], np.uint64))
        resp, _, body = raw.response()
        assert list(body) == [pb.ALREADY_EXISTS, pb.OK]
        raw.send(value + dp.encode_checksums([0, checksum(value)]))  # the payload, then every checksum
        resp, _, body = raw.response()
        assert resp.op == dp.OP_PUT_DONE and list(body) == [pb.INVALID, pb.OK]
    finally:
        raw.close()
    assert [bytes(g) if g is not None else None for g in c.get(keys)] == [b"first", value]
    c.remove(keys)


def test_writer_killed_mid_put_leaves_nothing(nodes: Any, h: Any, rng: random.Random) -> None:
    node = nodes["open"]
    c = node.client()
    used0 = h.stats_tier(c.stats(), "dram").used_bytes
    revoked0 = c.stats().counters[StoreCounter.REVOKED]
    [key] = h.rand_keys(rng, 1)
    proc = subprocess.Popen([sys.executable, str(h.here / "_killed_writer.py"), node.address, "session", key.hex(),
                             str(MiB), "60000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("WROTE"), (line, proc.stderr.read() if proc.stderr else "")
        assert c.exists([key]).present == [False] and c.get([key]) == [None]
        assert c.put([key], [b"x"]) == [pb.IN_FLIGHT]  # reserved by the writer, not visible
    finally:
        proc.kill()
        proc.communicate(timeout=10)
    # The node sees the stream break and revokes at once (not after the 60 s reservation).
    h.wait_for(lambda: c.stats().counters[StoreCounter.REVOKED] == revoked0 + 1, 10,
               what="the broken put to be revoked")
    assert h.stats_tier(c.stats(), "dram").used_bytes == used0
    assert c.get([key]) == [None]
    assert c.put([key], [b"after"]) == [pb.OK]
    c.remove([key])


MALFORMED = {
    "bad version": dp.REQUEST_MAGIC + bytes([99]) + bytes(dp.REQUEST_SIZE - 5),
    "unknown op": dp.REQUEST.pack(dp.REQUEST_MAGIC, dp.VERSION, 77, 0, 0, 1, 0, 0, 0, 0, 0, 0),
    "too many keys": dp.REQUEST.pack(dp.REQUEST_MAGIC, dp.VERSION, dp.OP_GET, 0, 0, 1, dp.MAX_KEYS + 1, 0, 0, 0, 0, 0),
    "token too long": dp.REQUEST.pack(dp.REQUEST_MAGIC, dp.VERSION, dp.OP_GET, 0, 0, 1, 1, 0, 60000, 0, 0, 0),
    "hello with keys": dp.REQUEST.pack(dp.REQUEST_MAGIC, dp.VERSION, dp.OP_HELLO, 0, 0, 1, 2, 0, 0, 0, 0, 0),
    "token not utf-8": dp.REQUEST.pack(dp.REQUEST_MAGIC, dp.VERSION, dp.OP_GET, 0, 0, 1, 1, 0, 2, 0, 0, 0)
    + b"\xff\xfe" + bytes(32),
    "object over the limit": b"".join(dp.encode_request(dp.OP_PUT, 1, b"", bytes(32),
                                                        sizes=np.array([1 << 50], np.uint64))),
    "garbage after a frame": b"".join(dp.encode_request(dp.OP_HELLO, 1, b"", b"")) + dp.REQUEST_MAGIC + b"junk" * 20,
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_frames_close_only_their_connection(nodes: Any, h: Any, rng: random.Random, case: str) -> None:
    node = nodes["open"]
    c = node.client()
    [key] = h.rand_keys(rng, 1)
    assert c.put([key], [b"still here"]) == [pb.OK]
    other = Raw(node)  # an open session beside the bad one
    bad = Raw(node)
    try:
        assert other.hello_ok()
        bad.send(MALFORMED[case])
        if case == "garbage after a frame":
            assert bad.response()[0].op == dp.OP_HELLO
        assert bad.closed_by_peer()
        assert other.hello_ok()
    finally:
        bad.close()
        other.close()
    assert [bytes(g) for g in c.get([key]) if g] == [b"still here"]
    assert node.alive()
    c.remove([key])


def test_truncated_frames_never_wedge_the_node(nodes: Any, h: Any, rng: random.Random) -> None:
    """Every prefix of a valid GET and PUT frame, then EOF: each connection ends, none hangs."""
    node = nodes["open"]
    keys = b"".join(h.rand_keys(rng, 2))
    frames = [b"".join(dp.encode_request(dp.OP_GET, 1, b"", keys)),
              b"".join(dp.encode_request(dp.OP_PUT, 1, b"", keys, sizes=np.array([5, 5], np.uint64)))]
    for frame in frames:
        for cut in sorted({1, 3, 4, 5, dp.REQUEST_SIZE - 1, dp.REQUEST_SIZE, dp.REQUEST_SIZE + 7, len(frame) - 1}):
            raw = Raw(node)
            raw.send(frame[:cut])
            raw.sock.shutdown(socket.SHUT_WR)
            assert raw.closed_by_peer()
            raw.close()
    c = node.client()
    assert c.put([keys[:32]], [b"ok"]) == [pb.OK] and c.get([keys[:32]])[0] == bytearray(b"ok")
    c.remove([keys[:32]])


def test_checksums_are_verified_on_read(nodes: Any, h: Any, rng: random.Random) -> None:
    """A node without tenants does not rehash commits: a writer's wrong checksum is stored, and
    the reader's verification turns it into a CHECKSUM miss (verify=False hands the bytes over)."""
    node = nodes["open"]
    [key] = h.rand_keys(rng, 1)
    value = rng.randbytes(5000)
    raw = Raw(node)
    try:
        raw.request(dp.OP_PUT, b"", key, sizes=np.array([len(value)], np.uint64))
        assert list(raw.response()[2]) == [pb.OK]
        raw.send(value + dp.encode_checksums([checksum(value) ^ 1]))
        assert list(raw.response()[2]) == [pb.OK]
    finally:
        raw.close()
    buf = bytearray(len(value))
    assert node.client().get_into([key], [memoryview(buf)]) == [pb.CHECKSUM]
    assert node.client().get([key]) == [None]
    assert node.client(verify=False).get_into([key], [memoryview(buf)]) == [pb.OK] and bytes(buf) == value
    node.client().remove([key])


def test_a_read_drops_the_match_lease_it_supersedes(nodes: Any, h: Any, rng: random.Random) -> None:
    c = nodes["open"].client()
    keys = h.rand_keys(rng, 3)
    assert c.put(keys, [b"a", b"b", b"c"]) == [pb.OK] * 3
    m = c.exists(keys, pin=True, lease_ms=60000)
    assert m.prefix == 3 and m.lease_id
    assert c.remove(keys[:1]) == [pb.IN_FLIGHT]  # pinned by the match
    got: dict[int, bytearray] = {}

    def dest(i: int, size: int) -> memoryview:
        got[i] = bytearray(size)
        return memoryview(got[i])
    r = c.read(keys, dest, lease_id=m.lease_id)
    assert r.codes == [pb.OK] * 3 and r.sizes == [1, 1, 1] and [bytes(got[i]) for i in range(3)] == [b"a", b"b", b"c"]
    assert c.remove(keys) == [pb.OK] * 3  # the lease went with the read


def test_an_exists_of_no_keys_releases_a_lease_of_its_own_tenant_only(nodes: Any, h: Any,
                                                                      rng: random.Random) -> None:
    """The session's release (what a sidecar drops its match leases with): another tenant's
    frame naming the lease leaves it pinned; the owner's frees it."""
    node = nodes["tenants"]
    a, b = node.client("tok-alpha"), node.client("tok-beta")
    keys = h.rand_keys(rng, 2)
    assert a.put(keys, [b"a", b"b"]) == [pb.OK] * 2
    m = a.exists(keys, pin=True, lease_ms=60000)
    assert m.prefix == 2 and m.lease_id
    assert a.remove(keys[:1]) == [pb.IN_FLIGHT]
    b.release([m.lease_id])  # beta's frame: not its lease
    assert a.remove(keys[:1]) == [pb.IN_FLIGHT]
    a.release([m.lease_id])
    assert a.remove(keys) == [pb.OK] * 2
    raw = Raw(node)
    try:  # the frame itself: an EXISTS of no keys, answered like any EXISTS
        raw.request(dp.OP_EXISTS, b"tok-alpha", b"", lease_id=12345)
        resp, _, body = raw.response()
        assert resp.status == 0 and resp.items == 0 and resp.prefix == 0 and body == b""
    finally:
        raw.close()


def test_a_removal_during_the_send_succeeds_and_the_reply_stays_whole(nodes: Any, h: Any,
                                                                      rng: random.Random) -> None:
    """A read's own pin is only an in-flight mark: removing the object while its bytes are on
    the wire is OK (the reader asked for a copy, not a lease), the bytes sent are still the
    object's, and the space is counted free again."""
    node = nodes["open"]
    c = node.client()
    [key] = h.rand_keys(rng, 1)
    value = rng.randbytes(16 * MiB)
    used0 = h.stats_tier(c.stats(), "dram").used_bytes
    assert c.put([key], [value]) == [pb.OK]
    raw = Raw(node)
    try:
        raw.request(dp.OP_GET, b"", key)
        # The first bytes of the reply mean the node has pinned the object and is sending; 16 MiB
        # cannot fit in the socket buffers, so the send is still running.
        head = raw.recv(dp.RESPONSE_SIZE)
        assert c.remove([key]) == [pb.OK]
        assert c.get([key]) == [None]
        resp = dp.decode_response(head)
        table = dp.decode_get_table(resp, raw.recv(resp.body_bytes()))
        assert list(table.codes) == [pb.OK] and list(table.sizes) == [len(value)]
        assert raw.recv(resp.payload_len) == value
    finally:
        raw.close()
    assert h.stats_tier(c.stats(), "dram").used_bytes == used0


def test_buffers_that_are_too_small_or_refused(nodes: Any, h: Any, rng: random.Random) -> None:
    c = nodes["open"].client()
    keys = h.rand_keys(rng, 3)
    vals = h.rand_values(rng, [3000, 5000, 7000])
    assert c.put(keys, vals) == [pb.OK] * 3
    bufs = [bytearray(3000), bytearray(10), bytearray(7000)]
    assert c.get_into(keys, [memoryview(b) for b in bufs]) == [pb.OK, pb.INVALID, pb.OK]
    assert bytes(bufs[0]) == vals[0] and bytes(bufs[2]) == vals[2]  # the stream stayed in sync
    r = c.read(keys, lambda i, size: None if i == 0 else memoryview(bytearray(size)))
    assert r.codes == [pb.INVALID, pb.OK, pb.OK] and r.sizes == [3000, 5000, 7000]
    c.remove(keys)


def test_a_broken_idle_connection_is_replaced_once(nodes: Any, h: Any, rng: random.Random) -> None:
    """A pooled connection that broke while idle (here: shut down under the client, as when the
    node closed it) costs one fresh connection, not an error."""
    c = nodes["open"].client()
    [key] = h.rand_keys(rng, 1)
    assert c.put([key], [b"v"]) == [pb.OK]
    ds = c.session()
    assert ds._idle
    for s in list(ds._idle):
        s._sock.shutdown(socket.SHUT_RDWR)
    assert c.exists([key]).present == [True]
    assert [bytes(g) for g in c.get([key]) if g] == [b"v"]
    c.remove([key])


def test_a_node_back_on_another_transfer_port_is_found_again(stores: Any, h: Any, rng: random.Random) -> None:
    """Same control address, new transfer port (a restart): one call fails as unreachable,
    then the client asks the node again where its data session is, and goes on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    listen = ["--listen", f"127.0.0.1:{port}", "--transfer-port", "0"]
    first = stores.start("8MiB", extra=listen)
    c = StoreClient(first.address)
    try:
        [key] = h.rand_keys(rng, 1)
        assert c.put([key], [b"one"]) == [pb.OK]
        old = c.session()
        assert old.address == first.transfer_address
        first.kill()
        second = stores.start("8MiB", extra=listen)
        assert second.address == first.address and second.transfer_address != first.transfer_address
        with pytest.raises(errors.Unavailable):
            c.get([key])
        assert c.put([key], [b"two"]) == [pb.OK]  # a fresh node: the old object died with the first
        ds = c.session()
        assert ds.address == second.transfer_address
        assert [bytes(g) for g in c.get([key]) if g] == [b"two"]
    finally:
        c.close()
