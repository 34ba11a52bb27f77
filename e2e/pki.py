"""Throw-away PKI for one harness cluster, made with ``cryptography``.

One CA signs everything: the kube-apiserver serving cert, the admin client cert (group
``system:masters``), the controller-manager and node-agent client certs, and a serving cert for
an admission webhook on 127.0.0.1 (the operator's, or a test's). Plus the service-account
signing key pair. kopf's own self-signed certificates need ``oscrypto``, which fails on this
machine's OpenSSL 3.0.x, which is why the webhook cert is made here.

Keys are EC P-256: generation takes microseconds, where RSA-2048 takes tens of milliseconds each.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = _dt.timedelta(days=7)  # outlives any test session, never outlives the machine


@dataclasses.dataclass(frozen=True)
class CertPair:
    """PEM file paths of one certificate and its private key."""

    cert: Path
    key: Path


@dataclasses.dataclass(frozen=True)
class Pki:
    """Every credential file the cluster and its clients use."""

    ca: CertPair
    apiserver: CertPair
    admin: CertPair
    controller_manager: CertPair
    node: CertPair
    webhook: CertPair
    kubelet: CertPair
    kubelet_client: CertPair
    sa_private: Path
    sa_public: Path


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _name(cn: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


def _issue(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    subject: x509.Name,
    *,
    server_names: list[str] | None = None,
    server_ips: list[str] | None = None,
    client: bool = False,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = _dt.datetime.now(_dt.UTC) - _dt.timedelta(minutes=5)  # tolerate clock skew
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] if client else [ExtendedKeyUsageOID.SERVER_AUTH]
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_encipherment=False, content_commitment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=False,
                crl_sign=False, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in server_names or []]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in server_ips or []]
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def _save(directory: Path, stem: str, key: ec.EllipticCurvePrivateKey,
          cert: x509.Certificate) -> CertPair:
    pair = CertPair(cert=directory / f"{stem}.crt", key=directory / f"{stem}.key")
    pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, pair.key)
    return pair


def make_pki(directory: Path, service_ip: str = "10.96.0.1", node_ip: str | None = None) -> Pki:
    """Create a fresh CA and every cert the harness needs under ``directory``.

    ``node_ip`` (the real-node tier's node address) is added to the apiserver's and the
    kubelet's serving certs: pods reach the apiserver there, the apiserver the kubelet."""
    extra_ips = [node_ip] if node_ip else []
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    now = _dt.datetime.now(_dt.UTC) - _dt.timedelta(minutes=5)
    ca_name = _name("kvpool-e2e-ca")
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_encipherment=False, content_commitment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _save(directory, "ca", ca_key, ca_cert)

    def issue(stem: str, subject: x509.Name, **kw: object) -> CertPair:
        key, cert = _issue(ca_key, ca_cert, subject, **kw)  # type: ignore[arg-type]
        return _save(directory, stem, key, cert)

    issue(
        "apiserver",
        _name("kube-apiserver"),
        server_names=["localhost", "kubernetes", "kubernetes.default",
                      "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"],
        server_ips=["127.0.0.1", service_ip, *extra_ips],
    )
    issue("admin", _name("kvpool-e2e-admin", "system:masters"), client=True)
    # system:masters too: without --use-service-account-credentials every controller acts as
    # this one identity, and the bootstrap role of system:kube-controller-manager is written for
    # the per-controller service accounts, so it alone lacks most of what the controllers do.
    issue("controller-manager", _name("system:kube-controller-manager", "system:masters"),
          client=True)
    # The node agent acts as a kubelet for the pods and uses the admin-equivalent group: the
    # Node authorizer is not enabled (RBAC only), so system:nodes alone would grant nothing.
    issue("node", _name("system:node:kvpool-e2e", "system:masters"), client=True)
    issue("webhook", _name("kvpool-webhook"), server_names=["localhost"], server_ips=["127.0.0.1"])
    # The node agent's kubelet API (container logs), and the apiserver's client cert for it.
    issue("kubelet", _name("kvpool-e2e-kubelet"),
          server_names=["localhost"], server_ips=["127.0.0.1", *extra_ips])
    issue("apiserver-kubelet-client",
          _name("kube-apiserver-kubelet-client", "system:masters"), client=True)

    sa_key = ec.generate_private_key(ec.SECP256R1())
    sa_private = directory / "sa.key"
    sa_public = directory / "sa.pub"
    _write_key(sa_key, sa_private)
    sa_public.write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return pki_paths(directory)


def pki_paths(directory: Path) -> Pki:
    """The paths ``make_pki(directory)`` wrote, for a process that did not make them (the
    real-node tier makes its PKI inside the node's namespace)."""
    def pair(stem: str) -> CertPair:
        return CertPair(cert=directory / f"{stem}.crt", key=directory / f"{stem}.key")

    return Pki(ca=pair("ca"), apiserver=pair("apiserver"), admin=pair("admin"),
               controller_manager=pair("controller-manager"), node=pair("node"),
               webhook=pair("webhook"), kubelet=pair("kubelet"),
               kubelet_client=pair("apiserver-kubelet-client"),
               sa_private=directory / "sa.key", sa_public=directory / "sa.pub")
