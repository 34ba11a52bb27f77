"""The pool's certificate plan (pure, real certificates): CA creation, rotation with the old CA
kept in the bundle, pruning, and when leaves are re-issued."""

from __future__ import annotations

import base64
import datetime as dt
import socket
import ssl
import threading
from pathlib import Path

import pytest

pytest.importorskip("cryptography", reason="the certificate builders need the dataplane extra")
from cryptography import x509  # noqa: E402

from kvpool.core import pki  # noqa: E402
from kvpool_operator import certs  # noqa: E402

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
POLICY = certs.CertPolicy(ca_days=100, ca_margin=dt.timedelta(days=20), leaf_days=30,
                          leaf_margin=dt.timedelta(days=5))


def _ca(data: certs.Data, now: dt.datetime = T0) -> certs.CaPlan:
    return certs.plan_ca(data, now, POLICY, "pool CA")


def _apply(data: certs.Data, write: certs.Data | None) -> certs.Data:
    return dict(write) if write is not None else data


def test_missing_ca_is_created_and_then_current() -> None:
    plan = _ca({})
    assert plan.reason == "Created" and plan.write is not None
    assert plan.write[certs.CA_CERT_KEY] == plan.signer.cert_pem == plan.bundle
    again = _ca(plan.write, T0 + dt.timedelta(days=10))
    assert again.reason == "Current" and again.write is None and again.signer == plan.signer


def test_unusable_ca_secret_is_replaced() -> None:
    a, b = pki.make_ca(now=T0), pki.make_ca(now=T0)
    for data in ({certs.CA_CERT_KEY: a.cert_pem}, {certs.CA_CERT_KEY: a.cert_pem, certs.CA_KEY_KEY: b.key_pem},
                 {certs.CA_CERT_KEY: b"junk", certs.CA_KEY_KEY: a.key_pem}):
        assert _ca(data).reason == "Created"


def _rotate(data: certs.Data, at: dt.datetime) -> tuple[certs.CaPlan, certs.CaPlan]:
    """A rotation's two steps: the new CA staged at ``at``, signing ``ca_propagation`` later."""
    staged = _ca(data, at)
    assert staged.reason == "Staged" and staged.write is not None
    return staged, _ca(staged.write, at + POLICY.ca_propagation)


def test_rotation_stages_the_new_ca_then_signs_with_it_keeping_the_old_until_it_expires() -> None:
    first = _ca({})
    assert first.write is not None
    before = T0 + dt.timedelta(days=79)  # 21 days left: not yet
    assert _ca(first.write, before).reason == "Current"
    day81 = T0 + dt.timedelta(days=81)
    staged = _ca(first.write, day81)
    # Step 1: the new CA is trusted (in the bundle, after the signer) but does not sign yet.
    assert staged.reason == "Staged" and staged.write is not None and staged.signer == first.signer
    new_ca = staged.write[certs.NEXT_CERT_KEY]
    assert pki.split_bundle(staged.bundle) == [first.signer.cert_pem, new_ca]
    waiting = _ca(staged.write, day81 + POLICY.ca_propagation - dt.timedelta(seconds=1))
    assert waiting.reason == "Current" and waiting.signer == first.signer and waiting.bundle == staged.bundle
    # Step 2, once every mounted bundle had time to be refreshed: it signs, the old stays trusted.
    rotated = _ca(staged.write, day81 + POLICY.ca_propagation)
    assert rotated.reason == "Rotated" and rotated.write is not None
    assert rotated.signer.cert_pem == new_ca and certs.NEXT_CERT_KEY not in rotated.write
    assert pki.split_bundle(rotated.bundle) == [new_ca, first.signer.cert_pem]
    # Idempotent while both live; the old CA leaves once it has expired.
    assert _ca(rotated.write, T0 + dt.timedelta(days=90)).reason == "Current"
    pruned = _ca(rotated.write, T0 + dt.timedelta(days=101))
    assert pruned.reason == "Pruned" and pruned.bundle == rotated.signer.cert_pem


def test_an_expired_signer_is_replaced_at_once() -> None:
    """An operator that was down past the CA's end: nothing it signed is trusted any more, so a
    staged CA (or a new one) signs at once."""
    first = _ca({})
    assert first.write is not None
    late = _ca(first.write, T0 + dt.timedelta(days=101))
    assert late.reason == "Rotated" and late.signer != first.signer and late.bundle == late.signer.cert_pem
    staged = _ca(first.write, T0 + dt.timedelta(days=81))
    assert staged.write is not None
    now = _ca(staged.write, T0 + dt.timedelta(days=101))
    assert now.reason == "Rotated" and now.signer.cert_pem == staged.write[certs.NEXT_CERT_KEY]


def test_leaf_issued_with_names_identity_and_bundle() -> None:
    ca = _ca({})
    spec = certs.store_leaf("p", "ns")
    data = certs.plan_leaf({}, ca, spec, T0, POLICY)
    assert data is not None and data[certs.CA_CERT_KEY] == ca.bundle
    cert = x509.load_pem_x509_certificate(data[certs.TLS_CERT_KEY])
    dns = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert "p-store.ns.svc" in dns and "*.p-store.ns.svc.cluster.local" in dns
    assert pki.identity_of(data[certs.TLS_CERT_KEY]) == pki.node("p-store")
    assert certs.plan_leaf(data, ca, spec, T0 + dt.timedelta(days=20), POLICY) is None


def _handshake(tmp_path: Path, leaf: certs.Data, bundle: bytes, server_name: str) -> None:
    """A real TLS handshake over a socket pair: the store's certificate served, the bundle trusted."""
    (tmp_path / "c.pem").write_bytes(leaf[certs.TLS_CERT_KEY])
    (tmp_path / "k.pem").write_bytes(leaf[certs.TLS_KEY_KEY])
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(tmp_path / "c.pem", tmp_path / "k.pem")
    client = ssl.create_default_context(cadata=bundle.decode())
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(10)
        b.settimeout(10)
        errors: list[BaseException] = []

        def serve() -> None:
            try:
                with server.wrap_socket(a, server_side=True) as s:
                    s.recv(1)
            except (OSError, ssl.SSLError) as exc:
                errors.append(exc)

        t = threading.Thread(target=serve)
        t.start()
        try:
            with client.wrap_socket(b, server_hostname=server_name) as c:
                c.sendall(b"x")
        finally:
            t.join(10)
        assert not t.is_alive()


@pytest.mark.parametrize("name", ["p-store.ns.svc", "p-store-3.p-store.ns.svc.cluster.local", "p-store"])
def test_store_certificate_serves_the_service_and_pod_names(tmp_path: Path, name: str) -> None:
    now = dt.datetime.now(dt.UTC)
    ca = certs.plan_ca({}, now, POLICY, "pool CA")
    leaf = certs.plan_leaf({}, ca, certs.store_leaf("p", "ns"), now, POLICY)
    assert leaf is not None and certs.store_server_name("p", "ns") == "p-store.ns.svc"
    _handshake(tmp_path, leaf, ca.bundle, name)


def test_store_certificate_refused_for_another_pool_or_ca(tmp_path: Path) -> None:
    now = dt.datetime.now(dt.UTC)
    ca = certs.plan_ca({}, now, POLICY, "pool CA")
    leaf = certs.plan_leaf({}, ca, certs.store_leaf("p", "ns"), now, POLICY)
    assert leaf is not None
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(tmp_path, leaf, ca.bundle, "q-store.ns.svc")
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(tmp_path, leaf, pki.make_ca(now=now).cert_pem, "p-store.ns.svc")


def test_old_leaf_still_verifies_against_the_rotated_bundle(tmp_path: Path) -> None:
    """Through a rotation every pair of peers keeps verifying each other: an old leaf against the
    staged and the rotated bundle; a new leaf against the staged bundle (what a peer that has not
    yet picked up the rotated files holds) and the rotated one."""
    now = dt.datetime.now(dt.UTC)
    first = certs.plan_ca({}, now - dt.timedelta(days=85), POLICY, "pool CA")
    assert first.write is not None
    old_leaf = certs.plan_leaf({}, first, certs.store_leaf("p", "ns"), now - dt.timedelta(days=1), POLICY)
    staged = certs.plan_ca(first.write, now - POLICY.ca_propagation, POLICY, "pool CA")
    assert staged.write is not None and old_leaf is not None
    rotated = certs.plan_ca(staged.write, now, POLICY, "pool CA")
    assert rotated.reason == "Rotated"
    for bundle in (staged.bundle, rotated.bundle):
        _handshake(tmp_path, old_leaf, bundle, "p-store.ns.svc")
    new_leaf = certs.plan_leaf(old_leaf, rotated, certs.store_leaf("p", "ns"), now, POLICY)
    assert new_leaf is not None
    for bundle in (staged.bundle, rotated.bundle):
        _handshake(tmp_path, new_leaf, bundle, "p-store.ns.svc")
    with pytest.raises(ssl.SSLCertVerificationError):  # why the staging step: the old bundle alone
        _handshake(tmp_path, new_leaf, first.bundle, "p-store.ns.svc")


@pytest.mark.parametrize("later, reason", [(dt.timedelta(days=24), None), (dt.timedelta(days=26), "Expiring")])
def test_leaf_renewed_before_it_expires(later: dt.timedelta, reason: str | None) -> None:
    ca = _ca({})
    data = certs.plan_leaf({}, ca, certs.operator_leaf(), T0, POLICY)
    assert data is not None
    assert certs.leaf_reason(data, ca, certs.operator_leaf(), T0 + later, POLICY) == reason


def test_leaf_reissued_when_names_change_or_issuer_rotated() -> None:
    ca = _ca({})
    assert ca.write is not None
    day80 = T0 + dt.timedelta(days=80)
    data = certs.plan_leaf({}, ca, certs.tenant_leaf("a"), day80, POLICY)
    assert data is not None
    assert certs.leaf_reason(data, ca, certs.tenant_leaf("b"), day80, POLICY) == "NamesChanged"
    staged, rotated = _rotate(ca.write, T0 + dt.timedelta(days=85))
    # Staged: the leaf stays (only its bundle grows); rotated: it is re-issued.
    assert certs.leaf_reason(data, staged, certs.tenant_leaf("a"), T0 + dt.timedelta(days=85), POLICY) is None
    assert certs.leaf_reason(data, rotated, certs.tenant_leaf("a"), T0 + dt.timedelta(days=85), POLICY) \
        == "IssuerRotated"
    new = certs.plan_leaf(data, rotated, certs.tenant_leaf("a"), T0 + dt.timedelta(days=85), POLICY)
    assert new is not None and new[certs.CA_CERT_KEY] == rotated.bundle


def test_only_the_bundle_is_refreshed_when_the_leaf_is_current() -> None:
    ca = _ca({})
    data = certs.plan_leaf({}, ca, certs.operator_leaf(), T0, POLICY)
    assert data is not None
    other = pki.make_ca(now=T0)
    grown = certs.CaPlan(ca.signer, pki.bundle(ca.bundle, other.cert_pem), None, "Current")
    out = certs.plan_leaf(data, grown, certs.operator_leaf(), T0, POLICY)
    assert out is not None and out[certs.TLS_CERT_KEY] == data[certs.TLS_CERT_KEY]
    assert out[certs.CA_CERT_KEY] == grown.bundle


def test_unreadable_leaf_is_reissued() -> None:
    ca = _ca({})
    bad = {certs.TLS_CERT_KEY: b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
           certs.TLS_KEY_KEY: b"k"}
    assert certs.leaf_reason(bad, ca, certs.operator_leaf(), T0, POLICY) == "Unreadable"
    assert certs.leaf_reason({}, ca, certs.operator_leaf(), T0, POLICY) == "Missing"


def test_secret_manifests_round_trip_through_decode() -> None:
    ca = _ca({})
    assert ca.write is not None
    owner = {"apiVersion": "kvpool.io/v1alpha1", "kind": "KVPool", "name": "p", "uid": "u"}
    m = certs.ca_secret("p-ca", "ns", ca.write, {"a": "b"}, [owner])
    assert m["type"] == "Opaque" and m["metadata"]["ownerReferences"] == [owner]
    assert certs.decode(m) == ca.write
    leaf = certs.leaf_secret("p-store-tls", "ns", {"tls.crt": b"x"}, {}, [owner])
    assert leaf["type"] == "kubernetes.io/tls" and base64.b64decode(leaf["data"]["tls.crt"]) == b"x"
    assert certs.decode({"data": {"x": "%%%", "y": "eQ=="}}) == {"y": b"y"}


def test_expiry_seconds_is_the_earliest_of_a_bundle() -> None:
    first = _ca({})
    assert first.write is not None
    rotated = _ca(first.write, T0 + dt.timedelta(days=81))
    assert rotated.write is not None
    got = certs.expiry_seconds(rotated.write, certs.CA_CERT_KEY)
    assert got == pki.not_after(first.signer.cert_pem).timestamp()
    assert certs.expiry_seconds({}, certs.CA_CERT_KEY) is None


def test_stale_tenant_certificates() -> None:
    # Nothing changed: nothing stale.
    assert certs.stale_tenant_tls(["a", "b"], ["ns.p"], ["a", "b"], ["ns.p"]) == []
    # A namespace left: its certificates of every pool; a pool left: its certificate everywhere.
    assert certs.stale_tenant_tls(["a"], ["ns.p", "ns.q"], ["a", "b"], ["ns.p", "ns.q"]) == [
        ("b", "kvpool-tls-ns.p"), ("b", "kvpool-tls-ns.q")]
    assert certs.stale_tenant_tls(["a", "b"], ["ns.p"], ["a", "b"], ["ns.p", "ns.q"]) == [
        ("a", "kvpool-tls-ns.q"), ("b", "kvpool-tls-ns.q")]
    assert certs.tenant_tls_secret_name("ns", "p") == "kvpool-tls-ns.p"
