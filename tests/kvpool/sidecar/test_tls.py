"""TLS of a pool's channels, with real store processes: who is refused, and a CA rotation.

A client that does not trust the pool's CA is refused at the handshake (a clear error, at once:
no hang); a client without a certificate from the pool's CA as well; an admin call needs the
operator's certificate *and* the admin token; a plaintext data connection needs a fresh ticket
(a replayed one is refused).  A rotation (the CA bundle widened to old + new, then the node's
certificate re-issued from the new CA) is picked up by the running node with no restart and no
failed call.
"""

from __future__ import annotations

import time

import pytest

from kvpool.apps.cluster import LocalCluster
from kvpool.core import errors, pki
from kvpool.pool.admin_client import AdminClient
from kvpool.pool.data_client import DataSession
from kvpool.pool.node_client import StoreClient
from kvpool.wire import tls as wtls
from kvpool.wire.proto import store_pb2 as pb

KEY = b"k" * 32


CLUSTER = dict(stores=1, sidecars=0, tenants=[], store_bytes=16 << 20)


@pytest.fixture
def lc(module_cluster: LocalCluster) -> LocalCluster:
    return module_cluster


def _quick(fn: object) -> errors.KvpoolError:
    t0 = time.monotonic()
    with pytest.raises(errors.KvpoolError) as err:
        fn()  # type: ignore[operator]
    assert time.monotonic() - t0 < 5.0, "refused only after a wait"
    return err.value


def test_a_client_that_does_not_trust_the_pool_ca_fails_to_connect(lc: LocalCluster) -> None:
    stranger = pki.make_ca("another pool's CA")
    # Its certificate and its trust are the stranger CA's: the node's certificate fails its check.
    other = wtls.write_dir(f"{lc.workdir}/tls/stranger", pki.issue(stranger, pki.operator()), stranger.cert_pem)
    with StoreClient(lc.stores[0], tls=other, timeout=3.0) as c:
        err = _quick(c.health)
    assert isinstance(err, errors.Unavailable), err
    with StoreClient(lc.stores[0], tls=lc.client_tls, timeout=3.0) as c:
        transfer = c.health().transfer_address
    ds = DataSession(transfer, timeout=3.0, connections=1, tls=other)
    try:
        err = _quick(ds.hello)
        assert isinstance(err, errors.Unavailable) and "CERTIFICATE_VERIFY_FAILED" in str(err), err
    finally:
        ds.close()


def test_a_client_without_a_pool_certificate_is_refused(lc: LocalCluster) -> None:
    with StoreClient(lc.stores[0], tls=False, timeout=3.0) as c:  # plaintext to a TLS node
        assert isinstance(_quick(c.health), errors.Unavailable)
    with StoreClient(lc.stores[0], tls=lc.client_tls, timeout=3.0) as c:
        transfer = c.health().transfer_address
    ds = DataSession(transfer, timeout=3.0, connections=1, tls=None)
    try:
        assert isinstance(_quick(ds.hello), errors.Unavailable)
    finally:
        ds.close()
    # A certificate that names a pool identity but comes from another CA: refused by the node.
    forged = lc.issue("forged-operator", pki.operator(), ca=pki.make_ca("forger"))
    with AdminClient(lc.stores[0], lc.admin_token, timeout=3.0, tls=forged) as a:
        assert isinstance(_quick(a.drain_status), errors.Unavailable)


def test_an_admin_call_needs_the_operators_certificate_and_the_token(lc: LocalCluster) -> None:
    tenant = lc.issue("a-tenant", pki.tenant("acme"))
    node = lc.issue("a-node", pki.node("store-9"))
    for who in (tenant, node):
        with AdminClient(lc.stores[0], lc.admin_token, timeout=3.0, tls=who) as a:
            err = _quick(a.drain_status)
            assert isinstance(err, errors.PermissionDenied) and "operator's client certificate" in str(err), err
            # Nor does the token open every tenant's Stats without the operator's certificate.
            assert isinstance(_quick(a.stats), errors.Unauthenticated)
    with AdminClient(lc.stores[0], "not-the-token", timeout=3.0, tls=lc.client_tls) as a:
        assert isinstance(_quick(a.drain_status), errors.PermissionDenied)
    with AdminClient(lc.stores[0], lc.admin_token, timeout=3.0, tls=lc.client_tls) as a:
        a.drain_status()  # both: served
        assert a.stats().node_id == lc.store_ids[0]


def test_a_replayed_data_session_ticket_is_refused() -> None:
    with LocalCluster(stores=1, sidecars=0, store_bytes=16 << 20, store_args=["--plaintext-data-session"]) as lc:
        with StoreClient(lc.stores[0], timeout=3.0) as c:
            health = c.health()
            assert health.data_session_plaintext
            assert c.put([KEY], [b"v" * 1000]) == [pb.OK]  # the client follows the node: tickets
            assert c.get([KEY]) == [bytearray(b"v" * 1000)]
            ticket = bytes(c.stub.DataTicket(pb.Empty(), timeout=3.0).ticket)
        first = DataSession(health.transfer_address, timeout=3.0, connections=1, ticket=lambda t: ticket)
        again = DataSession(health.transfer_address, timeout=3.0, connections=1, ticket=lambda t: ticket)
        none = DataSession(health.transfer_address, timeout=3.0, connections=1)  # a token, no ticket
        try:
            assert first.exists(KEY).prefix == 1  # the ticket's tenant, no token in the frame
            assert isinstance(_quick(again.hello), errors.Unauthenticated)
            assert isinstance(_quick(lambda: none.exists(KEY)), errors.Unauthenticated)
        finally:
            for ds in (first, again, none):
                ds.close()


def test_a_ca_rotation_is_picked_up_by_a_running_node_without_a_failed_call() -> None:
    with LocalCluster(stores=1, sidecars=0, store_bytes=16 << 20) as lc:
        assert lc.ca is not None and lc.client_tls is not None
        old = lc.ca
        node_dir = f"{lc.workdir}/tls/store-0"
        with StoreClient(lc.stores[0], timeout=3.0) as c:
            assert c.put([KEY], [b"r" * 4096]) == [pb.OK]
            new = pki.make_ca("kvpool LocalCluster CA (next)", days=7)
            both = pki.bundle(old.cert_pem, new.cert_pem)
            # Step 1: everyone trusts old + new.  Step 2: the node's certificate from the new CA.
            cert, key, _ = lc.client_tls.read()
            client_pair = pki.KeyPair(cert, key)
            client = wtls.write_dir(f"{lc.workdir}/tls/operator-rotated", client_pair, both)
            node_pair = pki.issue(new, pki.node("store-0"), dns=["localhost"], ips=["127.0.0.1"])
            wtls.write_dir(node_dir, node_pair, both)
            # The client of before keeps its connections; new connections, with the bundle, verify
            # the node's new certificate.
            assert c.get([KEY]) == [bytearray(b"r" * 4096)]
        with StoreClient(lc.stores[0], timeout=3.0, tls=client) as c2:
            assert c2.get([KEY]) == [bytearray(b"r" * 4096)]
            assert c2.exists([KEY]).prefix == 1
        # Step 3: a client certificate from the new CA, trusting only it, is served too.
        fresh = wtls.write_dir(f"{lc.workdir}/tls/operator-new", pki.issue(new, pki.operator()), new.cert_pem)
        with StoreClient(lc.stores[0], timeout=3.0, tls=fresh) as c3, \
                AdminClient(lc.stores[0], lc.admin_token, timeout=3.0, tls=fresh) as a:
            assert c3.get([KEY]) == [bytearray(b"r" * 4096)]
            a.drain_status()
