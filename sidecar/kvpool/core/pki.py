"""The pool's small PKI, pure: a CA, the certificates it issues, and who a certificate names.

Builders only (PEM in, PEM out; no files, no sockets): the operator keeps a pool's CA in a
Secret and issues from it, ``LocalCluster`` and ``kvpool demo`` make a throw-away one, and the
nodes ask :func:`identity_of` who the peer of a mutually authenticated connection is.

Who is who rides in one URI subject-alternative name, ``spiffe://kvpool/<role>[/<name>]``
(:class:`Identity`): ``operator`` (the admin API's caller), ``tenant/<id>`` (a sidecar of that
tenant: its data calls, and the reads of its tenant's handoff exports), ``node/<id>`` (a store
node, also when it pushes to another node during a drain), ``router``.  Serving names (DNS and IP
SANs) are separate from it: one certificate may serve and be a client.

The identities (:class:`Identity`, :func:`parse_identity`) need nothing beyond the standard
library, so a node checks a peer with what ``ssl`` and gRPC report; the builders and parsers of
certificates import the ``cryptography`` package when called (the ``dataplane`` extra: an engine's
venv that only runs clients may lack it).

A CA *bundle* (several CA certificates back to back, :func:`bundle`) is what every peer trusts,
so a rotation is: add the new CA to the bundle everywhere, re-issue leaf certificates from it,
drop the old CA once no leaf it signed is left — no connection is refused at any step.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

URI_PREFIX = "spiffe://kvpool/"
ROLE_OPERATOR = "operator"
ROLE_TENANT = "tenant"
ROLE_NODE = "node"
ROLE_ROUTER = "router"
ROLES = (ROLE_OPERATOR, ROLE_TENANT, ROLE_NODE, ROLE_ROUTER)

_PEM_BEGIN = b"-----BEGIN CERTIFICATE-----"


@dataclass(frozen=True)
class Identity:
    """Who a certificate names: a role and, for tenants and nodes, a name."""

    role: str
    name: str = ""

    @property
    def uri(self) -> str:
        return URI_PREFIX + self.role + (f"/{self.name}" if self.name else "")

    def __str__(self) -> str:
        return self.uri


def operator() -> Identity:
    return Identity(ROLE_OPERATOR)


def tenant(tenant_id: str) -> Identity:
    return Identity(ROLE_TENANT, tenant_id)


def node(node_id: str) -> Identity:
    return Identity(ROLE_NODE, node_id)


def parse_identity(uri: str) -> Identity | None:
    """The :class:`Identity` of a ``spiffe://kvpool/...`` URI; None for anything else."""
    if not uri.startswith(URI_PREFIX):
        return None
    role, _, name = uri[len(URI_PREFIX):].partition("/")
    if role not in ROLES or "/" in name:
        return None
    return Identity(role, name)


@dataclass(frozen=True)
class KeyPair:
    """A certificate and its private key, PEM."""

    cert_pem: bytes
    key_pem: bytes


def _now(now: dt.datetime | None) -> dt.datetime:
    return now if now is not None else dt.datetime.now(dt.UTC)


def _key() -> ec.EllipticCurvePrivateKey:
    from cryptography.hazmat.primitives.asymmetric import ec
    # P-256: a handshake's signature costs a fraction of RSA-2048's, and every client has it.
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    from cryptography.hazmat.primitives import serialization
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_ca(common_name: str = "kvpool pool CA", days: int = 365, now: dt.datetime | None = None) -> KeyPair:
    """A self-signed CA valid ``days`` from ``now`` (a minute earlier, for clock skew)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID
    key = _key()
    start = _now(now) - dt.timedelta(minutes=1)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(start)
            .not_valid_after(start + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def issue(ca: KeyPair, identity: Identity | None = None, *, dns: Iterable[str] = (), ips: Iterable[str] = (),
          days: int = 90, server: bool = True, client: bool = True, now: dt.datetime | None = None) -> KeyPair:
    """A leaf certificate signed by ``ca``: serving names ``dns``/``ips`` (SANs), the
    ``identity`` URI, usable for serving and/or as a client (extended key usages)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError("the CA key is not an EC key")
    key = _key()
    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
    sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    if identity is not None:
        sans.append(x509.UniformResourceIdentifier(identity.uri))
    if not sans:
        raise ValueError("a certificate needs a serving name or an identity")
    usages = [u for u, on in ((ExtendedKeyUsageOID.SERVER_AUTH, server), (ExtendedKeyUsageOID.CLIENT_AUTH, client))
              if on]
    if not usages:
        raise ValueError("a certificate serves, is a client, or both")
    cn = identity.uri if identity is not None else next(iter([*dns, *ips]))
    start = _now(now) - dt.timedelta(minutes=1)
    end = min(start + dt.timedelta(days=days), ca_cert.not_valid_after_utc)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn[:64])]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def _load(cert: bytes) -> x509.Certificate:
    from cryptography import x509
    if cert.lstrip().startswith(b"-----"):
        return x509.load_pem_x509_certificate(cert)
    return x509.load_der_x509_certificate(cert)


def not_after(cert: bytes) -> dt.datetime:
    """When a certificate (PEM or DER; the first of a bundle) expires, UTC."""
    return _load(split_bundle(cert)[0] if cert.lstrip().startswith(b"-----") else cert).not_valid_after_utc


def seconds_left(cert: bytes, now: dt.datetime | None = None) -> float:
    """Seconds until the earliest expiry among the certificates of ``cert`` (negative: expired);
    what a rotation and the certificate-expiry alert look at."""
    certs = split_bundle(cert) if cert.lstrip().startswith(b"-----") else [cert]
    return min((_load(c).not_valid_after_utc - _now(now)).total_seconds() for c in certs)


def identity_of(cert: bytes) -> Identity | None:
    """The kvpool identity a certificate (PEM or DER) names in its SANs, None if none."""
    from cryptography import x509
    try:
        san = _load(cert).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    for uri in san.get_values_for_type(x509.UniformResourceIdentifier):
        found = parse_identity(uri)
        if found is not None:
            return found
    return None


def key_matches(cert: bytes, key: bytes) -> bool:
    """Whether ``key`` (PEM) is the private key of ``cert`` (PEM; the first of a chain): a
    certificate and key read while a rotation rewrote them may be of two generations."""
    from cryptography.hazmat.primitives import serialization
    try:
        private = serialization.load_pem_private_key(key, password=None)
        public = _load(split_bundle(cert)[0]).public_key()
    except (ValueError, TypeError, IndexError):
        return False  # a half-written file is no match either
    fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return bool(private.public_key().public_bytes(*fmt) == public.public_bytes(*fmt))


def bundle(*certs: bytes) -> bytes:
    """CA certificates back to back, each once (the trust of a pool during a rotation: old + new)."""
    seen: list[bytes] = []
    for pem in certs:
        for c in split_bundle(pem):
            if c not in seen:
                seen.append(c)
    return b"".join(seen)


def split_bundle(pem: bytes) -> list[bytes]:
    """The PEM certificates of a bundle, each ending in a newline."""
    out = []
    for part in pem.split(_PEM_BEGIN)[1:]:
        body = part.split(b"-----END CERTIFICATE-----", 1)[0]
        out.append(_PEM_BEGIN + body + b"-----END CERTIFICATE-----\n")
    return out
