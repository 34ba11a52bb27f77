"""A CA rotation end to end through running sidecars: their long-lived store clients pick up the
rewritten TLS files, so a reconnect after the rotation (a store node restarted with a certificate
from the new CA, every bundle trimmed to the new CA) verifies, and no read fails.

The steps are the operator's (docs/architecture.md, certificates): the new CA joins every bundle,
then every leaf is re-issued from it, then the old CA leaves the bundles; the files are rewritten
in place, as the kubelet refreshes a mounted Secret.  Before this, a sidecar's gRPC channel kept
the bundle and certificate it was created with and its reconnect to the restarted node failed.
"""

from __future__ import annotations

import os
import time

from kvpool.apps.cluster import LocalCluster
from kvpool.core import pki
from kvpool.pool.node_client import TLS_CHECK_SECONDS
from kvpool.wire import tls as wtls
from kvpool.wire.proto import store_pb2 as pb

BLOCK = 64 << 10
READMIT_SECONDS = 30.0
"""Bound for the sidecars to take a restarted node back (breaker backoff 8 s at most, a file
check every second, a loaded machine's process start)."""


def _value(tag: int) -> bytes:
    return bytes([tag & 0xFF]) * (BLOCK - 7) + tag.to_bytes(7, "little")


def _rewrite_all(lc: LocalCluster, bundle: bytes, issuer: pki.KeyPair | None = None) -> None:
    """Every TLS directory of the cluster rewritten in place: its bundle ``bundle``, and with
    ``issuer`` its certificate re-issued from it (same identity and names)."""
    root = os.path.join(lc.workdir, "tls")
    for name in sorted(os.listdir(root)):
        cert, key, _ = wtls.TlsConfig.from_dir(os.path.join(root, name)).read()
        pair = pki.KeyPair(cert, key)
        if issuer is not None:
            pair = pki.issue(issuer, pki.identity_of(cert), dns=["localhost"], ips=["127.0.0.1"], days=7)
        wtls.write_dir(os.path.join(root, name), pair, bundle)


def _read_back(client: object, keys: list[bytes], tags: list[int]) -> None:
    blocks = client.get(keys)  # type: ignore[attr-defined]
    try:
        assert [bytes(b) for b in blocks] == [_value(t) for t in tags]
    finally:
        blocks.release()


def test_sidecars_reconnect_to_a_restarted_node_after_a_ca_rotation_with_no_failed_read() -> None:
    with LocalCluster(stores=1, sidecars=2, store_bytes=32 << 20, local_bytes=16 << 20) as lc:
        assert lc.ca is not None
        old = lc.ca
        writer, reader = lc.connect(0), lc.connect(1)
        try:
            before = [f"before-{i}".encode().ljust(32, b".") for i in range(8)]
            assert set(writer.put(before, [_value(i) for i in range(8)], wait=True)) <= {pb.OK}
            _read_back(reader, before, list(range(8)))  # the reader's channel and session to the node open

            new = pki.make_ca("kvpool LocalCluster CA (next)", days=7)
            _rewrite_all(lc, pki.bundle(old.cert_pem, new.cert_pem))  # 1: the new CA joins every bundle
            _rewrite_all(lc, pki.bundle(old.cert_pem, new.cert_pem), issuer=new)  # 2: leaves from the new CA
            _read_back(reader, before, list(range(8)))
            lc.restart_store(0)  # its DRAM tier starts empty; the sidecars must reconnect
            _rewrite_all(lc, new.cert_pem)  # 3: the old CA leaves the bundles
            lc.ca = new

            # The restarted node lost before (DRAM); the writer's local tier still has it.
            _read_back(writer, before, list(range(8)))
            # A sidecar that met the node down skips it until a probe answers (backoff up to 8 s,
            # kvpool.core.breaker), and a client checks its files at most every
            # TLS_CHECK_SECONDS: within that bound the node is written and read again, on the
            # current files.  Before, it never was (every reconnect failed verification).
            values = [_value(100 + i) for i in range(8)]
            deadline = time.monotonic() + READMIT_SECONDS
            for attempt in range(1000):  # new keys each time: a retried put is the local tier's ALREADY_EXISTS
                after = [f"after-{attempt}-{i}".encode().ljust(32, b".") for i in range(8)]
                if set(codes := writer.put(after, values, wait=True, wait_seconds=2.0)) == {pb.OK}:
                    break
                assert time.monotonic() < deadline, f"the restarted node never took a write: {codes}"
                time.sleep(0.5)
            while True:  # read from the node, not a local copy: the reader never had these
                with reader.get_many(after) as reads:
                    for code, view, want in zip(reads.codes, reads.views, values, strict=True):
                        assert code in (pb.OK, pb.UNAVAILABLE), code
                        assert code != pb.OK or bytes(view) == want  # never a wrong byte
                    if reads.codes == [pb.OK] * 8:
                        break
                assert time.monotonic() < deadline, f"the reader never read the restarted node: {reads.codes}"
                time.sleep(0.5)
            _read_back(reader, after, [100 + i for i in range(8)])
        finally:
            writer.close()
            reader.close()


def test_a_store_client_of_before_the_rotation_calls_a_restarted_node_on_the_current_files() -> None:
    """The client every long-lived peer holds (a sidecar's, the router's, a store node's drain and
    warm-up pushes): its channel and data session reconnect with the rewritten files."""
    from kvpool.pool.node_client import StoreClient

    with LocalCluster(stores=1, sidecars=0, store_bytes=16 << 20) as lc:
        assert lc.ca is not None
        old = lc.ca
        peer = lc.issue("peer", pki.node("peer"))
        key = b"p" * 32
        with StoreClient(lc.stores[0], timeout=3.0, tls=peer) as c:
            assert c.put([key], [_value(1)]) == [pb.OK]
            new = pki.make_ca("kvpool LocalCluster CA (next)", days=7)
            _rewrite_all(lc, pki.bundle(old.cert_pem, new.cert_pem))
            _rewrite_all(lc, pki.bundle(old.cert_pem, new.cert_pem), issuer=new)
            lc.restart_store(0)
            _rewrite_all(lc, new.cert_pem)
            time.sleep(TLS_CHECK_SECONDS * 1.2)
            assert c.put([key], [_value(2)]) == [pb.OK]  # the restarted node's DRAM is empty
            assert c.get([key]) == [bytearray(_value(2))]
            assert c.health(3.0).transfer_address
