"""A process's TLS files while a rotation rewrites them: read as one generation, their change
seen by a cheap stamp, and a renewed certificate served by a listening socket wrapped once.

A refresh replaces the certificate, the key and the bundle one after another (or swaps a mounted
Secret's ``..data`` symlink between two opens): :meth:`TlsConfig.read` never hands back a
certificate with another generation's key, it reads again until they match, within a bound.
"""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time
from pathlib import Path

import pytest

from kvpool.core import pki
from kvpool.wire import tls as wtls

pytest.importorskip("cryptography", reason="the certificates are made with the cryptography package")


@pytest.fixture(scope="module")
def ca() -> pki.KeyPair:
    return pki.make_ca("tls files test CA", days=1)


def _leaf(ca: pki.KeyPair) -> pki.KeyPair:
    return pki.issue(ca, pki.node("n"), dns=["localhost"], ips=["127.0.0.1"], days=1)


def _write(path: str, data: bytes) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def test_key_matches_only_its_own_certificate(ca: pki.KeyPair) -> None:
    a, b = _leaf(ca), _leaf(ca)
    assert pki.key_matches(a.cert_pem, a.key_pem)
    assert not pki.key_matches(a.cert_pem, b.key_pem)
    assert not pki.key_matches(a.cert_pem, b.key_pem[: len(b.key_pem) // 2])  # half-written


def test_a_certificate_read_before_its_key_is_written_waits_for_the_key(ca: pki.KeyPair, tmp_path: Path) -> None:
    old, new = _leaf(ca), _leaf(ca)
    cfg = wtls.write_dir(str(tmp_path), old, ca.cert_pem)
    assert cfg.read()[:2] == (old.cert_pem, old.key_pem)
    _write(cfg.cert_file, new.cert_pem)  # the refresh is half done: new certificate, old key
    threading.Timer(0.3, _write, (cfg.key_file, new.key_pem)).start()
    started = time.monotonic()
    cert, key, _ = cfg.read()
    assert (cert, key) == (new.cert_pem, new.key_pem)  # not (new cert, old key)
    assert 0.2 < time.monotonic() - started < wtls.READ_SECONDS


def test_a_key_that_never_matches_fails_within_the_bound(ca: pki.KeyPair, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wtls, "READ_SECONDS", 0.3)
    cfg = wtls.write_dir(str(tmp_path), _leaf(ca), ca.cert_pem)
    _write(cfg.key_file, _leaf(ca).key_pem)
    started = time.monotonic()
    with pytest.raises(wtls.TlsError, match="does not match"):
        cfg.read()
    assert time.monotonic() - started < 2.0


def test_a_secret_symlink_swap_changes_the_stamp_and_the_read(ca: pki.KeyPair, tmp_path: Path) -> None:
    """The kubelet's layout: tls.crt → ..data/tls.crt, ..data → ..<timestamp>, swapped atomically."""
    old, new = _leaf(ca), _leaf(ca)
    for gen, pair in (("..v1", old), ("..v2", new)):
        wtls.write_dir(str(tmp_path / gen), pair, ca.cert_pem)
    os.symlink("..v1", tmp_path / "..data")
    for name in (wtls.CERT_NAME, wtls.KEY_NAME, wtls.CA_NAME):
        os.symlink(f"..data/{name}", tmp_path / name)
    cfg = wtls.TlsConfig.from_dir(str(tmp_path))
    stamp = cfg.stamp()
    assert cfg.read()[0] == old.cert_pem
    os.symlink("..v2", tmp_path / "..data_tmp")
    os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
    assert cfg.stamp() != stamp
    assert cfg.read()[:2] == (new.cert_pem, new.key_pem)


def _served_cert(port: int, trust: wtls.TlsConfig) -> bytes:
    ctx = ssl.create_default_context(cafile=trust.ca_file)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            ctx.wrap_socket(raw, server_hostname="localhost") as conn:
        der = conn.getpeercert(binary_form=True)
        assert der is not None
        return der


def test_a_listening_socket_wrapped_once_serves_the_renewed_certificate(ca: pki.KeyPair, tmp_path: Path) -> None:
    cfg = wtls.write_dir(str(tmp_path), _leaf(ca), ca.cert_pem)
    listener = socket.create_server(("127.0.0.1", 0))
    wrapped = cfg.listening_context(client_auth=False).wrap_socket(listener, server_side=True)
    port = wrapped.getsockname()[1]
    stop = threading.Event()

    def serve() -> None:
        wrapped.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = wrapped.accept()
            except (TimeoutError, ssl.SSLError, OSError):
                continue
            conn.close()
    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        first = _served_cert(port, cfg)
        renewed = _leaf(ca)
        wtls.write_dir(str(tmp_path), renewed, ca.cert_pem)
        second = _served_cert(port, cfg)
        assert first != second
        assert ssl.DER_cert_to_PEM_cert(second).encode().strip() == renewed.cert_pem.strip()
    finally:
        stop.set()
        server.join(5)
        wrapped.close()
