"""The edge of a pool's certificates: read its CA and leaf Secrets, apply what
:mod:`kvpool_operator.certs` plans, and hand the operator its own client certificate.

Called at the start of every KVPool reconcile (before any admin call), with the pool's
ownerReference on every Secret (deleted with the pool). The operator's client certificate is
also written under :attr:`Settings.tls_dir` as ``<namespace>/<pool>/{tls.crt,tls.key,ca.crt}``:
the admin client reads files (:class:`kvpool.wire.tls.TlsConfig`), and re-reads them when a
renewal rewrites them. The expiry of each certificate in use is the gauge
``kvpool_certificate_expiry_timestamp_seconds{pool, kind}`` (``ca``: the earliest of the
bundle, ``serving``: the store nodes', ``client``: the operator's).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import kvpool.core.pki as pki
from kvpool.wire.tls import TlsConfig, TlsError, write_dir

from . import certs, children, metrics
from .kube import Kube, KubeError
from .model import PoolSpec, SpecError, TenantSpec, parse_pool
from .settings import Settings
from .tenancy import OWNER_LABEL, TENANT_LABEL
from .tenancy import owner_reference as tenant_owner

log = logging.getLogger("kvpool.operator.tls")


def _labels(pool: PoolSpec) -> dict[str, str]:
    return {**children.common_labels(pool), "app.kubernetes.io/component": "tls"}


def _write_secret(kube: Kube, manifest: Mapping[str, Any], existed: bool) -> None:
    if existed:
        kube.apply(manifest)
    elif kube.create(manifest) is None:
        # Another writer created it since we read: never overwrite a CA others may already
        # trust; the conflict makes the handler re-read and re-plan shortly.
        raise KubeError(409, f"Secret {manifest['metadata']['name']} created concurrently")


def ensure_ca(kube: Kube, pool: PoolSpec, now: dt.datetime, policy: certs.CertPolicy) -> certs.CaPlan:
    name = certs.ca_secret_name(pool.name)
    found = kube.get("v1", "Secret", name, pool.namespace)
    plan = certs.plan_ca(certs.decode(found), now, policy, f"kvpool {pool.key} CA")
    if plan.write is not None:
        _write_secret(kube, certs.ca_secret(name, pool.namespace, plan.write, _labels(pool),
                                            [children.owner_reference(pool)]), found is not None)
        log.info("pool %s: CA %s", pool.key, plan.reason.lower())
    return plan


def ensure_leaf(kube: Kube, name: str, namespace: str, spec: certs.LeafSpec, ca: certs.CaPlan, now: dt.datetime,
                policy: certs.CertPolicy, labels: Mapping[str, str], owners: list[dict[str, Any]]) -> certs.Data:
    """The leaf Secret ``name`` as it is after this call (issued, renewed or left alone)."""
    found = kube.get("v1", "Secret", name, namespace)
    data = certs.decode(found)
    write = certs.plan_leaf(data, ca, spec, now, policy)
    if write is None:
        return data
    _write_secret(kube, certs.leaf_secret(name, namespace, write, labels, owners), found is not None)
    return write


def ensure_tenant_tls(kube: Kube, tn: TenantSpec, pool_namespace: str, pool_name: str, policy: certs.CertPolicy,
                      now: dt.datetime | None = None) -> list[str]:
    """The tenant's client certificate of one pool in each of its namespaces (the Secret
    injection mounts into its sidecars, owned by the TenantNamespace). Issued from the pool's
    CA as it is: a CA still to be created or rotated is the pool reconcile's to write, so this
    waits for it. Returns the namespaces that do not exist (yet)."""
    at = now or dt.datetime.now(dt.UTC)
    found = kube.get("v1", "Secret", certs.ca_secret_name(pool_name), pool_namespace)
    if found is None:
        return []
    ca = certs.plan_ca(certs.decode(found), at, policy, "")
    if ca.write is not None:
        return []
    name = certs.tenant_tls_secret_name(pool_namespace, pool_name)
    labels = {TENANT_LABEL: tn.tenant_id, OWNER_LABEL: tn.name, "app.kubernetes.io/managed-by": "kvpool-operator",
              "app.kubernetes.io/component": "tls"}
    missing = []
    for ns in tn.namespaces:
        try:
            ensure_leaf(kube, name, ns, certs.tenant_leaf(tn.tenant_id), ca, at, policy, labels,
                        [tenant_owner(tn)])
        except KubeError as exc:
            if exc.status != 404:
                raise
            missing.append(ns)
    return missing


def prune_tenant_tls(kube: Kube, tn: TenantSpec, previous_namespaces: Sequence[str],
                     previous_pool_keys: Sequence[str]) -> None:
    """Delete the tenant's certificates its TenantNamespace no longer asks for (a namespace or a
    pool it left), and only those it made (its owner label)."""
    for ns, name in certs.stale_tenant_tls(tn.namespaces, [p.key for p in tn.pools], previous_namespaces,
                                           previous_pool_keys):
        sec = kube.get("v1", "Secret", name, ns)
        if sec is not None and ((sec.get("metadata") or {}).get("labels") or {}).get(OWNER_LABEL) == tn.name:
            kube.delete("v1", "Secret", name, ns)


def ensure_ca_bundle(kube: Kube, pool: PoolSpec, bundle: bytes) -> None:
    """The ConfigMap ``<pool>-ca-bundle`` (``ca.crt``): what the router API's callers verify it
    with, current through a rotation (old + new CA while both are live)."""
    name = certs.ca_bundle_config_map_name(pool.name)
    found = kube.get("v1", "ConfigMap", name, pool.namespace)
    if ((found or {}).get("data") or {}).get(certs.CA_CERT_KEY) == bundle.decode():
        return
    kube.apply({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": name, "namespace": pool.namespace, "labels": _labels(pool),
                             "ownerReferences": [children.owner_reference(pool)]},
                "data": {certs.CA_CERT_KEY: bundle.decode()}})


DEFAULT_TLS_COMPONENT = "tls-default-tenant"
"""``app.kubernetes.io/component`` of a pool's default-tenant Secrets (found again to prune them)."""


def _default_labels(pool: PoolSpec) -> dict[str, str]:
    return {**children.common_labels(pool), "app.kubernetes.io/component": DEFAULT_TLS_COMPONENT}


def ensure_default_tenant_tls(kube: Kube, pool: PoolSpec, ca: certs.CaPlan, now: dt.datetime,
                              policy: certs.CertPolicy) -> list[str]:
    """The default tenant's certificate in each namespace its sidecars may be injected into
    (:func:`certs.default_tenant_namespaces`; none without a default tenant), and no longer in
    the namespaces it left. Owned by the pool in its own namespace; elsewhere an ownerReference
    cannot cross namespaces, so the labels find them again (and :func:`forget_pool` deletes
    them). Returns the namespaces that do not exist (yet): the next reconcile tries again."""
    name = certs.default_tenant_tls_secret_name(pool.namespace, pool.name)
    wanted = certs.default_tenant_namespaces(pool.namespace, pool.allowed_namespaces) if pool.default_tenant else ()
    missing = []
    for ns in wanted:
        owners = [children.owner_reference(pool)] if ns == pool.namespace else []
        try:
            ensure_leaf(kube, name, ns, certs.default_tenant_leaf(), ca, now, policy, _default_labels(pool), owners)
        except KubeError as exc:
            if exc.status != 404:
                raise
            missing.append(ns)
    for ns in stale_default_tenant_tls(kube, pool, wanted):
        kube.delete("v1", "Secret", name, ns)
    return missing


def stale_default_tenant_tls(kube: Kube, pool: PoolSpec, wanted: Sequence[str]) -> list[str]:
    """Namespaces holding this pool's default-tenant Secret outside ``wanted``."""
    name = certs.default_tenant_tls_secret_name(pool.namespace, pool.name)
    selector = ",".join(f"{k}={v}" for k, v in sorted(_default_labels(pool).items()))
    found = kube.list("v1", "Secret", None, selector)
    return sorted({str(s["metadata"].get("namespace")) for s in found if s["metadata"].get("name") == name}
                  - set(wanted))


def _write_files(directory: str, data: certs.Data) -> None:
    """The operator's client certificate of a pool as a TLS directory, rewritten (atomically,
    by :func:`kvpool.wire.tls.write_dir`) only when it changed."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    wanted = data[certs.TLS_CERT_KEY], data[certs.TLS_KEY_KEY], data[certs.CA_CERT_KEY]
    try:
        if TlsConfig.from_dir(directory).read() == wanted:
            return
    except TlsError:  # not written yet
        pass
    write_dir(directory, pki.KeyPair(wanted[0], wanted[1]), wanted[2])


def ensure_pool_tls(kube: Kube, pool: PoolSpec, tls_root: str, policy: certs.CertPolicy,
                    now: dt.datetime | None = None, body: Mapping[str, Any] | None = None) -> TlsConfig:
    """The pool's CA, the store nodes' Secret and the operator's client certificate, current;
    returns the operator's TLS configuration for this pool's admin calls. With the pool's
    ``body``, a created or rotated CA is an Event about it."""
    at = now or dt.datetime.now(dt.UTC)
    ca = ensure_ca(kube, pool, at, policy)
    if body is not None and ca.reason in ("Created", "Staged", "Rotated"):
        what = {"Created": "created",
                "Staged": f"about to expire: a new CA is trusted from now on and signs in {policy.ca_propagation}",
                "Rotated": "rotated (the old CA stays trusted until it expires; every certificate is re-issued "
                           "from the new one)"}[ca.reason]
        try:
            kube.event(body, "Normal", f"CertificateAuthority{ca.reason}",
                       f"CA of the pool {what}: Secret {certs.ca_secret_name(pool.name)}, valid until "
                       f"{pki.not_after(ca.signer.cert_pem).isoformat()}")
        except KubeError as exc:  # an Event is worth less than the reconcile that made it
            log.info("event CertificateAuthority%s not posted: %s", ca.reason, exc)
    owners = [children.owner_reference(pool)]
    store = ensure_leaf(kube, certs.store_tls_secret_name(pool.name), pool.namespace,
                        certs.store_leaf(pool.name, pool.namespace), ca, at, policy, _labels(pool), owners)
    mine = ensure_leaf(kube, certs.operator_tls_secret_name(pool.name), pool.namespace, certs.operator_leaf(), ca, at,
                       policy, _labels(pool), owners)
    router: certs.Data = {}
    if pool.router_enabled:  # (pruned with the router's Deployment when it is switched off)
        router = ensure_leaf(kube, certs.router_tls_secret_name(pool.name), pool.namespace,
                             certs.router_leaf(pool.name, pool.namespace), ca, at, policy, _labels(pool), owners)
    ensure_ca_bundle(kube, pool, ca.bundle)
    missing = ensure_default_tenant_tls(kube, pool, ca, at, policy)
    if missing:
        log.info("pool %s: no default-tenant certificate in %s (namespace not found)", pool.key, ", ".join(missing))
    directory = os.path.join(tls_root, pool.namespace, pool.name)
    _write_files(directory, mine)
    for kind, data, key in (("ca", {certs.CA_CERT_KEY: ca.bundle}, certs.CA_CERT_KEY),
                            ("serving", store, certs.TLS_CERT_KEY), ("client", mine, certs.TLS_CERT_KEY),
                            ("router", router, certs.TLS_CERT_KEY)):
        when = certs.expiry_seconds(data, key)
        if when is not None:
            metrics.CERT_EXPIRY.labels(pool.namespace, pool.name, kind).set(when)
        elif kind == "router":
            _forget_series(pool.namespace, pool.name, (kind,))
    return TlsConfig.from_dir(directory, certs.store_server_name(pool.name, pool.namespace))


def pool_tls_or_problem(kube: Kube, pool: PoolSpec, tls_root: str, policy: certs.CertPolicy,
                        body: Mapping[str, Any] | None = None,
                        now: dt.datetime | None = None) -> tuple[TlsConfig | None, tuple[str, str] | None]:
    """:func:`ensure_pool_tls`, or why it could not run: a refused Secret write (RBAC, a quota on
    Secrets, an admission webhook) is a condition of the pool, not a reconcile that fails
    without saying why.  The operator then keeps using the certificate it wrote before, if any,
    so running nodes stay reachable for admin calls."""
    try:
        return ensure_pool_tls(kube, pool, tls_root, policy, now=now, body=body), None
    except KubeError as exc:
        problem = ("CertificatesUnavailable",
                   f"the pool's certificates could not be read or written ({exc}); running store nodes keep "
                   f"theirs, new ones wait for Secret {certs.store_tls_secret_name(pool.name)}")
    last = TlsConfig.from_dir(os.path.join(tls_root, pool.namespace, pool.name),
                              certs.store_server_name(pool.name, pool.namespace))
    return (last if os.path.exists(last.cert_file) else None), problem


CERT_KINDS = ("ca", "serving", "client", "router")
"""The ``kind`` label of ``kvpool_certificate_expiry_timestamp_seconds``."""


def _forget_series(pool_namespace: str, name: str, kinds: Sequence[str]) -> None:
    for kind in kinds:
        try:
            metrics.CERT_EXPIRY.remove(pool_namespace, name, kind)
        except KeyError:
            pass


def cert_policy(settings: Settings) -> certs.CertPolicy:
    """The certificate policy the operator's settings give (CloudNativePG's validity defaults)."""
    return certs.CertPolicy(ca_propagation=dt.timedelta(seconds=settings.tls_ca_propagation_seconds))


def forget_pool(kube: Kube | None, body: Mapping[str, Any]) -> None:
    """Drop a deleted pool's expiry series; its Secrets go with it by owner reference, except the
    default tenant's outside its namespace, deleted here with ``kube`` (best effort: a missed one
    is a certificate of a CA that no longer exists)."""
    meta = body.get("metadata") or {}
    _forget_series(str(meta.get("namespace")), str(meta.get("name")), CERT_KINDS)
    try:
        pool = parse_pool(body)
    except SpecError:  # an unparsable spec names no namespaces to clean
        return
    if kube is not None:
        try:
            for ns in stale_default_tenant_tls(kube, pool, ()):
                kube.delete("v1", "Secret", certs.default_tenant_tls_secret_name(pool.namespace, pool.name), ns)
        except KubeError as exc:
            log.info("pool %s: default-tenant certificates not deleted: %s", pool.key, exc)
