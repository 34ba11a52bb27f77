"""The transfer server and engine over TLS, in one process, with certificates of a real CA.

A client that expects an identity checks the server's certificate by it (and by nothing else):
a certificate that names no address serves, one of another identity is refused before a request
goes out.  The first bytes of a session, however slowly they come, are never lost.  The
server's connections are TLS sockets that own their descriptors: cutting them
(``drop_connections``, ``stop``) has to reach them.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpool.core import pki
from kvpool.transfer import Segment, SegmentRegistry, TransferCode, TransferEngine, TransferRequest, TransferServer
from kvpool.transfer.stream import Stream
from kvpool.transfer.testing import tcp_socket
from kvpool.wire import tls as wtls

pytest.importorskip("cryptography", reason="the certificates are made with the cryptography package")

Issue = Callable[..., wtls.TlsConfig]
DATA = bytes(range(256)) * 64


@pytest.fixture(scope="module")
def ca() -> pki.KeyPair:
    return pki.make_ca("transfer TLS test CA", days=1)


@pytest.fixture
def issue(ca: pki.KeyPair, tmp_path: Path) -> Issue:
    """``issue(name, identity, dns=(), ips=())``: a TLS directory of a leaf from the test CA."""
    def make(name: str, identity: pki.Identity, dns: tuple[str, ...] = (), ips: tuple[str, ...] = ()) -> wtls.TlsConfig:
        return wtls.write_dir(str(tmp_path / name), pki.issue(ca, identity, dns=dns, ips=ips, days=1), ca.cert_pem)
    return make


@pytest.fixture
def serve(issue: Issue) -> Iterator[Callable[..., TransferServer]]:
    """``serve(cfg, **server_args)``: a started TLS transfer server of segment ``seg`` (DATA)."""
    servers: list[TransferServer] = []

    def start(cfg: wtls.TlsConfig, **kw: object) -> TransferServer:
        registry = SegmentRegistry()
        registry.register(Segment("seg", bytearray(DATA)))
        server = TransferServer(registry, tls=cfg, **kw).start()  # type: ignore[arg-type]
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.stop()


def _read(engine: TransferEngine, address: str) -> tuple[TransferCode, str, bytes]:
    buf = bytearray(len(DATA))
    st = engine.submit(address, [TransferRequest("read", memoryview(buf), "seg", 0, len(DATA))]).wait(10.0)[0]
    return st.code, st.message, bytes(buf)


def test_a_client_expecting_an_identity_checks_it_instead_of_the_name(issue: Issue, serve: Callable[..., TransferServer]
                                                                      ) -> None:
    acme = pki.tenant("acme")
    server = serve(issue("server", acme))  # names no address: as a tenant's certificate in a pod
    reader = issue("reader", acme)
    with TransferEngine(tls=reader.expecting(acme), stall_timeout=5.0) as eng:
        assert _read(eng, server.address) == (TransferCode.OK, "", DATA)
    with TransferEngine(tls=reader, stall_timeout=5.0) as eng:  # by name: the certificate has none
        code, why, _ = _read(eng, server.address)
        assert code == TransferCode.CONNECTION and "mismatch" in why, why
    with TransferEngine(tls=reader.expecting(pki.tenant("globex")), stall_timeout=5.0) as eng:
        code, why, got = _read(eng, server.address)
        assert code == TransferCode.CONNECTION and got != DATA, why
        assert "is spiffe://kvpool/tenant/acme, not spiffe://kvpool/tenant/globex" in why, why
    assert server.stats().get("requests_ok", 0) == 1  # the refused clients sent no request


def test_a_server_whose_certificate_has_the_right_name_but_no_identity_is_refused(
        issue: Issue, serve: Callable[..., TransferServer]) -> None:
    server = serve(issue("server", pki.node("store"), dns=("localhost",), ips=("127.0.0.1",)))
    reader = issue("reader", pki.tenant("acme"))
    with TransferEngine(tls=reader, stall_timeout=5.0) as eng:
        assert _read(eng, server.address)[0] == TransferCode.OK  # a name check lets it pass
    with TransferEngine(tls=reader.expecting(pki.tenant("acme")), stall_timeout=5.0) as eng:
        code, why, _ = _read(eng, server.address)
        assert code == TransferCode.CONNECTION and "spiffe://kvpool/node/store, not" in why, why


def test_drop_connections_and_stop_reach_tls_connections(issue: Issue, serve: Callable[..., TransferServer]) -> None:
    acme = pki.tenant("acme")
    server = serve(issue("server", acme))
    with TransferEngine(tls=issue("reader", acme).expecting(acme), connections_per_peer=1, stall_timeout=5.0) as eng:
        assert _read(eng, server.address)[0] == TransferCode.OK
        assert server.drop_connections() == 1
        # The cut connection fails the next request's first attempt; its retry reconnects.
        assert _read(eng, server.address) == (TransferCode.OK, "", DATA)
        assert eng.stats()["connects"] == 2
        assert server.connection_count == 1
        t0 = time.monotonic()
        server.stop()  # an idle TLS connection is cut, not waited for (its thread joined at once)
        assert time.monotonic() - t0 < 3.0
        assert server.connection_count == 0


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_a_session_magic_sent_in_pieces_with_stalls_reaches_its_handler(issue: Issue, tls: bool) -> None:
    """A client whose first bytes come one at a time, each after a stall longer than the
    server's io_timeout: the server keeps what came before each stall (it used to start over
    and lose them: the rest was misread as the transfer protocol), and the session's handler
    sees its magic and the frame whole."""
    magic, body = b"TEST", b"hello"
    seen: list[bytes] = []

    def echo(stream: Stream, stop: threading.Event) -> None:
        got = bytearray(len(magic) + len(body))
        stream.recv_exact(got)
        seen.append(bytes(got))
        stream.send([bytes(got)])

    cfg = issue("server", pki.node("n"), ips=("127.0.0.1",)) if tls else None
    server = TransferServer(SegmentRegistry(), io_timeout=0.2, sessions={magic: echo}, tls=cfg).start()
    try:
        client = tcp_socket(server.address, timeout=10.0, tls=issue("client", pki.tenant("a")) if tls else None)
        with client:
            for b in magic[:-1]:
                client.sendall(bytes([b]))  # over TLS: a record each
                time.sleep(0.5)
            client.sendall(magic[-1:] + body)  # the frame's rest at once: a stall inside it is not idle
            answer = bytearray()
            while len(answer) < len(magic) + len(body):
                chunk = client.recv(64)
                assert chunk, f"closed by the server after {bytes(answer)!r}"
                answer += chunk
        assert bytes(answer) == magic + body and seen == [magic + body]
        assert server.stats().get("protocol_errors", 0) == 0
    finally:
        server.stop()


def test_every_read_of_a_stream_serves_the_bytes_read_ahead_first() -> None:
    """A server hands a session its first bytes (the magic, read off the connection): a handler
    that scatters or discards first sees them in order too, not the bytes after them."""
    a, b = socket.socketpair()
    with a, b:
        b.sendall(b"EFGHIJ")
        stream = Stream(a, head=b"ABCD")
        two, four = memoryview(bytearray(2)), memoryview(bytearray(4))
        stream.recv_buffers([two, four])
        assert (bytes(two), bytes(four)) == (b"AB", b"CDEF")
        b.sendall(b"KL")
        again = Stream(a, head=b"xyz")
        again.discard(4)  # the three read ahead, then one off the socket (G)
        rest = bytearray(5)
        again.recv_exact(rest)
        assert bytes(rest) == b"HIJKL" and again.received == 9
