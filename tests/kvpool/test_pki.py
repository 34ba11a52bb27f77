"""The pool's PKI builders and data-session tickets: pure functions, no sockets."""

from __future__ import annotations

import datetime as dt
import ssl

import pytest
from cryptography import x509

from kvpool.core import pki, tickets


def test_identities_round_trip_and_anything_else_is_none() -> None:
    for who in (pki.operator(), pki.tenant("acme"), pki.node("store-3"), pki.Identity(pki.ROLE_ROUTER)):
        assert pki.parse_identity(who.uri) == who
    for uri in ("spiffe://kvpool/root", "spiffe://other/operator", "spiffe://kvpool/tenant/a/b", "https://x"):
        assert pki.parse_identity(uri) is None


def test_issued_certificates_carry_names_identity_and_usages() -> None:
    ca = pki.make_ca(days=30)
    leaf = pki.issue(ca, pki.tenant("acme"), dns=["s.pool.svc"], ips=["127.0.0.1"], days=10, server=False)
    cert = x509.load_pem_x509_certificate(leaf.cert_pem)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["s.pool.svc"]
    assert [str(i) for i in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]
    assert pki.identity_of(leaf.cert_pem) == pki.tenant("acme")
    assert pki.identity_of(pki.issue(ca, None, dns=["x"]).cert_pem) is None
    assert 9 * 86400 < pki.seconds_left(leaf.cert_pem) <= 10 * 86400
    # A leaf never outlives its CA.
    assert pki.not_after(pki.issue(ca, pki.operator(), days=365).cert_pem) <= pki.not_after(ca.cert_pem)
    with pytest.raises(ValueError):
        pki.issue(ca, None)


def test_a_bundle_holds_each_ca_once_and_verifies_leaves_of_both() -> None:
    old, new = pki.make_ca("old"), pki.make_ca("new")
    both = pki.bundle(old.cert_pem, new.cert_pem, old.cert_pem)
    assert pki.split_bundle(both) == [old.cert_pem, new.cert_pem]
    later = dt.datetime.now(dt.UTC) + dt.timedelta(days=400)
    assert pki.seconds_left(both, now=later) < 0  # the earliest expiry of the bundle
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cadata=both.decode())
    assert len(ctx.get_ca_certs()) == 2


def test_a_ticket_admits_its_tenant_once_before_it_expires() -> None:
    book = tickets.TicketBook(ttl_ms=1000)
    t, expires = book.issue("acme", now_unix_ms=10_000)
    assert expires == 11_000
    assert book.admit(t, 10_500) == "acme"
    assert book.admit(t, 10_600) is None  # replayed
    t2, _ = book.issue("acme", now_unix_ms=10_000)
    assert book.admit(t2, 11_000) is None  # expired
    t3, _ = book.issue("acme", now_unix_ms=10_000)
    forged = t3[:-1] + bytes([t3[-1] ^ 1])
    assert book.admit(forged, 10_100) is None
    other = tickets.TicketBook()  # another node, or this node's next life
    assert other.admit(t3, 10_100) is None
    assert tickets.decode(b"k" * 32, b"short", 0) == "not a ticket"
