"""Tenancy (DESIGN §3, §7): credential Secrets of TenantNamespaces and what the nodes are told.

Pure except :func:`new_credentials`, which draws from :mod:`secrets`. A tenant has one token and
one salt, the same in every namespace it owns; the Secrets themselves are the only copy (no
token ever lands in a status), so an existing Secret is reused and a new one minted only when
none exists.
"""

from __future__ import annotations

import base64
import binascii
import json
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .model import API_VERSION, PoolSpec, TenantSpec

TENANT_LABEL = "kvpool.io/tenant"
OWNER_LABEL = "kvpool.io/tenant-namespace"
CREDENTIALS_KEY = "credentials.json"


@dataclass(frozen=True)
class Credentials:
    tenant_id: str
    token: str
    salt: bytes

    def to_json(self) -> str:
        """What the sidecar reads with ``--credentials`` (the salt in base64)."""
        return json.dumps({"tenantId": self.tenant_id, "token": self.token,
                           "salt": base64.b64encode(self.salt).decode()}, sort_keys=True)


def new_credentials(tenant_id: str) -> Credentials:
    return Credentials(tenant_id, secrets.token_urlsafe(32), secrets.token_bytes(32))


def new_admin_token() -> str:
    return secrets.token_urlsafe(32)


def _b64(data: Mapping[str, Any], key: str) -> bytes | None:
    v = data.get(key)
    if not isinstance(v, str):
        return None
    try:
        return base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError):
        return None


def credentials_from_secret(secret: Mapping[str, Any], tenant_id: str) -> Credentials | None:
    """The credentials a Secret holds, if it is a complete one for ``tenant_id``."""
    raw = _b64(secret.get("data") or {}, CREDENTIALS_KEY)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
        salt = base64.b64decode(doc["salt"], validate=True)
    except (ValueError, KeyError, TypeError, binascii.Error):
        return None
    if doc.get("tenantId") != tenant_id or not doc.get("token") or not salt:
        return None
    return Credentials(tenant_id, str(doc["token"]), salt)


def choose_credentials(tenant_id: str, existing: Iterable[Mapping[str, Any]]) -> Credentials | None:
    """The tenant's credentials from its existing Secrets (the most common one wins, so that one
    hand-edited copy does not rotate everyone's token)."""
    seen: dict[Credentials, int] = {}
    for s in existing:
        c = credentials_from_secret(s, tenant_id)
        if c is not None:
            seen[c] = seen.get(c, 0) + 1
    if not seen:
        return None
    return max(seen.items(), key=lambda kv: kv[1])[0]


def owner_reference(tn: TenantSpec) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "TenantNamespace", "name": tn.name, "uid": tn.uid,
            "controller": True, "blockOwnerDeletion": True}


def tenant_secret(tn: TenantSpec, namespace: str, creds: Credentials) -> dict[str, Any]:
    def enc(b: bytes) -> str:
        return base64.b64encode(b).decode()

    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {"name": tn.secret_name, "namespace": namespace,
                     "labels": {TENANT_LABEL: tn.tenant_id, OWNER_LABEL: tn.name,
                                "app.kubernetes.io/managed-by": "kvpool-operator"},
                     "ownerReferences": [owner_reference(tn)]},
        "data": {CREDENTIALS_KEY: enc(creds.to_json().encode()), "token": enc(creds.token.encode()),
                 "salt": enc(base64.b64encode(creds.salt)), "tenantId": enc(tn.tenant_id.encode())},
    }


@dataclass(frozen=True)
class SecretPlan:
    apply: tuple[str, ...]
    """Namespaces that must hold the Secret (created or repaired)."""
    delete: tuple[str, ...]
    """Namespaces holding a Secret of this TenantNamespace that are no longer listed."""


def plan_secrets(tn: TenantSpec, existing: Mapping[str, Mapping[str, Any]], creds: Credentials) -> SecretPlan:
    """``existing``: namespace → this TenantNamespace's Secret there (by its owner label)."""
    want = set(tn.namespaces)
    apply = []
    for ns in sorted(want):
        cur = existing.get(ns)
        if cur is None or credentials_from_secret(cur, tn.tenant_id) != creds:
            apply.append(ns)
    delete = sorted(ns for ns in existing if ns not in want)
    return SecretPlan(tuple(apply), tuple(delete))


# ---------------------------------------------------------------------------- towards nodes


@dataclass(frozen=True)
class NodeTenant:
    """One tenant as the store nodes of a pool get it (kvpool.wire.proto TenantConfig)."""

    tenant_id: str
    token: str
    salt: bytes
    quota_bytes: int = 0
    ttl_seconds: Mapping[str, float] = field(default_factory=dict)
    evict_own_on_quota: bool = False


def node_tenants(pool: PoolSpec, tenants: Iterable[tuple[TenantSpec, Credentials]]) -> list[NodeTenant]:
    """The tenants admitted to ``pool`` (those whose TenantNamespace lists it), sorted by id.

    Sent with replace=True: a tenant missing here (deleted TenantNamespace) has its token revoked.
    """
    out: dict[str, NodeTenant] = {}
    for tn, creds in tenants:
        entry = tn.pool(pool.key)
        if entry is None:
            continue
        out[tn.tenant_id] = NodeTenant(tn.tenant_id, creds.token, creds.salt, entry.quota_bytes,
                                       dict(entry.ttl_seconds), entry.evict_own_on_quota)
    return [out[k] for k in sorted(out)]


def tenant_pool_status(tn: TenantSpec, pool_statuses: Mapping[str, Mapping[str, Any] | None]) -> list[dict[str, Any]]:
    """Per listed pool: this tenant's usage, refusals and evictions from the pool's status."""
    rows = []
    for p in tn.pools:
        st = pool_statuses.get(p.key) or {}
        mine: Mapping[str, Any] = next((t for t in st.get("tenants") or [] if t.get("tenantId") == tn.tenant_id), {})
        # usedBytes and quotaBytes in one unit, logical bytes: the pool's quota against the pool's
        # usage (replicas count once; physicalBytes is what all replicas take).
        rows.append({"pool": p.key, "usedBytes": int(mine.get("usedBytes", 0)),
                     "physicalBytes": int(mine.get("physicalBytes", 0)),
                     "quotaBytes": p.quota_bytes or int(mine.get("quotaBytes", 0)),
                     "objects": int(mine.get("objects", 0)), "refusals": int(mine.get("refusals", 0)),
                     "evictions": int(mine.get("evictions", 0))})
    return rows
