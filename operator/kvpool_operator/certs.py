"""A pool's certificates, planned: its CA Secret and the leaf Secrets issued from it. Pure:
(Secrets as read, the time) → the Secret data to write, or None to leave a Secret as it is.

The CloudNativePG way: the operator keeps one CA per pool in ``<pool>-ca`` (``ca.crt``,
``ca.key``) and issues from it

* ``<pool>-store-tls``: the store nodes' serving and client certificate, one for every pod of
  the StatefulSet (DNS SANs: the headless Service and each pod's name under it; identity
  ``spiffe://kvpool/node/<pool>-store``); clients check it as ``<pool>-store.<ns>.svc``
  (``--tls-server-name``), since pod IPs are not known when it is issued;
* ``<pool>-operator-tls``: the operator's client certificate for the pool's admin API
  (identity ``spiffe://kvpool/operator``);
* ``<pool>-router-tls`` (with ``spec.router.enabled``): the router API's, serving the names of its
  Service; its callers verify it with the bundle of the ConfigMap ``<pool>-ca-bundle``;
* tenants' certificates (``kvpool-tls-<pool key>``, by the TenantNamespace reconcile) and the
  default tenant's (``kvpool-default-tls-<pool key>``), mounted into injected sidecars.

Each leaf Secret is a ``kubernetes.io/tls`` Secret plus ``ca.crt``: mounted as a directory, it
is what ``--tls-dir`` reads (:mod:`kvpool.wire.tls`).

Rotation, without a refused connection, in two steps. ``ca.crt`` of the CA Secret is the
*bundle* every peer trusts, the signing CA first. ``ca_margin`` before the signing CA expires, a
new CA is *staged*: added to the bundle (``next.crt``/``next.key`` hold it) while the old one keeps
signing, and every leaf Secret gets the grown bundle. ``ca_propagation`` later — time for the
kubelet to refresh every mounted copy (it syncs Secret volumes about once a minute), so every
peer trusts the new CA — the staged CA takes over: it signs, and every leaf not issued by it is
re-issued at once. A peer still holding an old leaf is trusted through the old CA, which stays in
the bundle until it expires, then leaves it. Leaves are also re-issued ``leaf_margin`` before they
expire, or when their names change. A signer that has already expired (an operator that was down)
is replaced at once: nothing it signed is trusted any more anyway.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import kvpool.core.pki as pki

from .model import STORE_DEFAULT_TENANT

CA_CERT_KEY, CA_KEY_KEY = "ca.crt", "ca.key"
NEXT_CERT_KEY, NEXT_KEY_KEY, NEXT_SINCE_KEY = "next.crt", "next.key", "next.since"
"""The staged CA of a rotation (already in the bundle, not yet signing) and when it was staged
(Unix seconds, ASCII)."""
TLS_CERT_KEY, TLS_KEY_KEY = "tls.crt", "tls.key"
TLS_SECRET_TYPE = "kubernetes.io/tls"

Data = dict[str, bytes]


@dataclass(frozen=True)
class CertPolicy:
    """How long certificates live and how early they are renewed (CloudNativePG's defaults:
    leaves of 90 days renewed 7 days before their end)."""

    ca_days: int = 365
    """Validity of a new CA."""
    ca_margin: dt.timedelta = dt.timedelta(days=30)
    """A CA with less than this left is rotated (and stays trusted, in the bundle, until it expires)."""
    ca_propagation: dt.timedelta = dt.timedelta(minutes=10)
    """How long a staged CA is only trusted before it signs: the time for every mounted copy of
    the bundle to be refreshed (the kubelet's sync period, about a minute, with a wide margin)."""
    leaf_days: int = 90
    """Validity of a leaf (capped by the signing CA's own end)."""
    leaf_margin: dt.timedelta = dt.timedelta(days=7)
    """A leaf with less than this left is re-issued."""


@dataclass(frozen=True)
class LeafSpec:
    """What one leaf Secret must name and allow."""

    identity: pki.Identity
    dns: tuple[str, ...] = ()
    server: bool = True
    client: bool = True


@dataclass(frozen=True)
class CaPlan:
    """The pool's CA after this reconcile: the signing pair, the trusted bundle, and the data to
    write to the CA Secret (None: it is already so)."""

    signer: pki.KeyPair
    bundle: bytes
    write: Data | None
    reason: str
    """``Created``, ``Staged``, ``Rotated``, ``Pruned`` or ``Current``: for an Event and the logs."""


def ca_secret_name(pool_name: str) -> str:
    return f"{pool_name}-ca"


def store_tls_secret_name(pool_name: str) -> str:
    return f"{pool_name}-store-tls"


def operator_tls_secret_name(pool_name: str) -> str:
    return f"{pool_name}-operator-tls"


def router_tls_secret_name(pool_name: str) -> str:
    return f"{pool_name}-router-tls"


def ca_bundle_config_map_name(pool_name: str) -> str:
    """The pool's CA bundle alone (``ca.crt``, no key), for clients that only verify the pool's
    servers: the router API's callers. A ConfigMap, like ``kube-root-ca.crt``: it is public."""
    return f"{pool_name}-ca-bundle"


def tenant_tls_secret_name(pool_namespace: str, pool_name: str) -> str:
    """A tenant's certificate of one pool, in each namespace of its TenantNamespace (mounted by
    injection into the sidecars of that pool)."""
    return _tenant_tls_secret_name(f"{pool_namespace}.{pool_name}")


def _tenant_tls_secret_name(pool_key: str) -> str:
    return f"kvpool-tls-{pool_key}"


def default_tenant_tls_secret_name(pool_namespace: str, pool_name: str) -> str:
    """The pool's default tenant's certificate (sidecars of namespaces no TenantNamespace binds),
    in each namespace of :func:`default_tenant_namespaces`. A name of its own, never a
    TenantNamespace's: a namespace that gets bound later keeps its running sidecars' files."""
    return f"kvpool-default-tls-{pool_namespace}.{pool_name}"


def default_tenant_namespaces(pool_namespace: str, allowed: Sequence[str]) -> tuple[str, ...]:
    """Where a pool with a default tenant issues its certificate: the namespaces its sidecars may
    be injected into (``spec.sidecar.namespaces``), else its own. Any other namespace cannot be
    known before a pod is admitted there, so injection skips such pods (``NoCertificate``)."""
    return tuple(allowed) or (pool_namespace,)


def stale_tenant_tls(namespaces: Sequence[str], pool_keys: Sequence[str], previous_namespaces: Sequence[str],
                     previous_pool_keys: Sequence[str]) -> list[tuple[str, str]]:
    """(namespace, Secret name) of a tenant's certificates its TenantNamespace no longer asks
    for: every pool's in a namespace it left, and a pool it left in every namespace. Pool keys
    are ``<namespace>.<name>``, as in the TenantNamespace's status."""
    keep = {(ns, _tenant_tls_secret_name(k)) for ns in namespaces for k in pool_keys}
    had = {(ns, _tenant_tls_secret_name(k)) for ns in {*namespaces, *previous_namespaces}
           for k in {*pool_keys, *previous_pool_keys}}
    return sorted(had - keep)


def decode(secret: Mapping[str, Any] | None) -> Data:
    """The entries of a Secret as read (base64 ``data``); unreadable entries are left out."""
    out: Data = {}
    for k, v in ((secret or {}).get("data") or {}).items():
        try:
            out[k] = base64.b64decode(v, validate=True)
        except (binascii.Error, ValueError, TypeError):
            continue
    return out


def _expires(cert: bytes) -> dt.datetime | None:
    try:
        return pki.not_after(cert)
    except ValueError:
        return None


def _pair(data: Data, cert_key: str, key_key: str) -> pki.KeyPair | None:
    """The pair of ``key_key`` and the first certificate of ``cert_key``, if that certificate is a
    CA whose public key is the key's."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    certs = pki.split_bundle(data.get(cert_key, b""))
    key_pem = data.get(key_key, b"")
    if not certs or not key_pem:
        return None
    try:
        cert = x509.load_pem_x509_certificate(certs[0])
        key = serialization.load_pem_private_key(key_pem, password=None)
        if not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca:
            return None
    except (ValueError, TypeError, x509.ExtensionNotFound):
        return None
    raw = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if cert.public_key().public_bytes(*raw) != key.public_key().public_bytes(*raw):
        return None
    return pki.KeyPair(certs[0], key_pem)


def _staged_since(data: Data) -> dt.datetime | None:
    try:
        return dt.datetime.fromtimestamp(float(data.get(NEXT_SINCE_KEY, b"").decode()), dt.UTC)
    except (ValueError, UnicodeDecodeError, OverflowError):
        return None


def plan_ca(data: Data, now: dt.datetime, policy: CertPolicy, common_name: str) -> CaPlan:
    """The CA Secret's next state: created when missing or unusable; ``ca_margin`` before the
    signer expires a new CA staged (trusted, not signing); ``ca_propagation`` after it was made,
    the staged CA signing (the old one stays in the bundle); expired CAs pruned from the bundle."""
    signer = _pair(data, CA_CERT_KEY, CA_KEY_KEY)
    if signer is None:
        ca = pki.make_ca(common_name, days=policy.ca_days, now=now)
        return CaPlan(ca, ca.cert_pem, {CA_CERT_KEY: ca.cert_pem, CA_KEY_KEY: ca.key_pem}, "Created")
    staged = _pair(data, NEXT_CERT_KEY, NEXT_KEY_KEY)
    since = _staged_since(data) or now  # unreadable: staged now, as far as anyone can tell
    live = [c for c in pki.split_bundle(data[CA_CERT_KEY]) if (_expires(c) or now) > now]
    left = pki.not_after(signer.cert_pem) - now
    reason = "Current"
    if left < policy.ca_margin and staged is None and left > dt.timedelta(0):
        staged, since = pki.make_ca(common_name, days=policy.ca_days, now=now), now
        reason = "Staged"
    elif staged is not None and (now - since >= policy.ca_propagation or left <= dt.timedelta(0)):
        signer, staged = staged, None
        reason = "Rotated"
    elif left <= dt.timedelta(0):  # expired unseen: no staging helps any more
        signer = pki.make_ca(common_name, days=policy.ca_days, now=now)
        reason = "Rotated"
    extra = [staged.cert_pem] if staged is not None else []
    bundle = pki.bundle(signer.cert_pem, *extra, *live)
    if reason == "Current" and bundle != data[CA_CERT_KEY]:
        reason = "Pruned"
    write = None
    if reason != "Current":
        write = {CA_CERT_KEY: bundle, CA_KEY_KEY: signer.key_pem}
        if staged is not None:
            write.update({NEXT_CERT_KEY: staged.cert_pem, NEXT_KEY_KEY: staged.key_pem,
                          NEXT_SINCE_KEY: str(since.timestamp()).encode()})
    return CaPlan(signer, bundle, write, reason)


def _issued_by(cert: bytes, ca: bytes) -> bool:
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature
    try:
        x509.load_pem_x509_certificate(cert).verify_directly_issued_by(x509.load_pem_x509_certificate(ca))
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _names(cert: bytes) -> tuple[pki.Identity | None, frozenset[str]]:
    from cryptography import x509
    san = x509.load_pem_x509_certificate(cert).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    return pki.identity_of(cert), frozenset(san.value.get_values_for_type(x509.DNSName))


def leaf_reason(data: Data, ca: CaPlan, spec: LeafSpec, now: dt.datetime, policy: CertPolicy) -> str | None:
    """Why a leaf Secret must be (re-)issued, None if its certificate may stay."""
    from cryptography import x509
    cert, key = data.get(TLS_CERT_KEY), data.get(TLS_KEY_KEY)
    if not cert or not key:
        return "Missing"
    try:
        if (pki.not_after(cert) - now) < policy.leaf_margin:
            return "Expiring"
        if _names(cert) != (spec.identity, frozenset(spec.dns)):
            return "NamesChanged"
    except (ValueError, TypeError, x509.ExtensionNotFound):
        return "Unreadable"
    if not _issued_by(cert, ca.signer.cert_pem):
        return "IssuerRotated"
    return None


def plan_leaf(data: Data, ca: CaPlan, spec: LeafSpec, now: dt.datetime, policy: CertPolicy) -> Data | None:
    """A leaf Secret's data to write: a new certificate when :func:`leaf_reason` says so, else
    only a new ``ca.crt`` when the bundle changed; None when it is current."""
    if leaf_reason(data, ca, spec, now, policy) is not None:
        leaf = pki.issue(ca.signer, spec.identity, dns=spec.dns, days=policy.leaf_days, server=spec.server,
                         client=spec.client, now=now)
        return {TLS_CERT_KEY: leaf.cert_pem, TLS_KEY_KEY: leaf.key_pem, CA_CERT_KEY: ca.bundle}
    if data.get(CA_CERT_KEY) != ca.bundle:
        return {**data, CA_CERT_KEY: ca.bundle}
    return None


# ------------------------------------------------------------------------------ what to issue


def store_dns_names(pool_name: str, namespace: str) -> tuple[str, ...]:
    """The store nodes' serving names: the headless Service (short, namespaced, ``.svc`` and the
    cluster-domain form) and a wildcard for the StatefulSet pods' names under it (one wildcard
    covers every ordinal, so a scale-up needs no re-issue)."""
    svc = f"{pool_name}-store"
    base = [svc, f"{svc}.{namespace}", f"{svc}.{namespace}.svc", f"{svc}.{namespace}.svc.cluster.local"]
    return (*base, *(f"*.{name}" for name in base[1:]))


def store_server_name(pool_name: str, namespace: str) -> str:
    """The name clients check in a store node's certificate (``--tls-server-name``)."""
    return f"{pool_name}-store.{namespace}.svc"


def store_leaf(pool_name: str, namespace: str) -> LeafSpec:
    return LeafSpec(pki.node(f"{pool_name}-store"), store_dns_names(pool_name, namespace))


def router_leaf(pool_name: str, namespace: str) -> LeafSpec:
    """The router API: it serves the names of its Service (callers dial the Service) and is a
    client of the store nodes (identity ``spiffe://kvpool/router``)."""
    svc = f"{pool_name}-router"
    return LeafSpec(pki.Identity(pki.ROLE_ROUTER),
                    (svc, f"{svc}.{namespace}", f"{svc}.{namespace}.svc", f"{svc}.{namespace}.svc.cluster.local"))


def operator_leaf() -> LeafSpec:
    return LeafSpec(pki.operator(), server=False)


def tenant_leaf(tenant_id: str) -> LeafSpec:
    """A tenant's sidecars: a client of the store nodes, and the server of its handoff exports."""
    return LeafSpec(pki.tenant(tenant_id))


def default_tenant_leaf() -> LeafSpec:
    """The default tenant's sidecars: a sidecar without ``--tenant`` is the store's tokenless
    partition ``default`` (not the pool's display name for it), and its handoff exports check
    that name, so the certificate names it too."""
    return tenant_leaf(STORE_DEFAULT_TENANT)


def leaf_secret(name: str, namespace: str, data: Mapping[str, bytes], labels: Mapping[str, str],
                owners: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A leaf Secret manifest (``kubernetes.io/tls`` + ``ca.crt``)."""
    return {"apiVersion": "v1", "kind": "Secret", "type": TLS_SECRET_TYPE,
            "metadata": {"name": name, "namespace": namespace, "labels": dict(labels),
                         "ownerReferences": [dict(o) for o in owners]},
            "data": {k: base64.b64encode(v).decode() for k, v in sorted(data.items())}}


def ca_secret(name: str, namespace: str, data: Mapping[str, bytes], labels: Mapping[str, str],
              owners: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return {**leaf_secret(name, namespace, data, labels, owners), "type": "Opaque"}


def expiry_seconds(data: Data, key: str) -> float | None:
    """When the earliest certificate of an entry expires (Unix seconds), for the
    ``kvpool_certificate_expiry_timestamp_seconds`` gauge; None when absent or unreadable."""
    raw = data.get(key)
    if not raw:
        return None
    certs = pki.split_bundle(raw)
    ends = [e for e in (_expires(c) for c in certs) if e is not None]
    return min(ends).timestamp() if ends else None
