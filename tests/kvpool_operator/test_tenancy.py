"""Tenancy: credential Secrets (reused, never rotated by accident) and what pools' nodes get."""

import base64
import json

from kvpool_operator.model import parse_pool, parse_tenant
from kvpool_operator.tenancy import (
    Credentials,
    choose_credentials,
    credentials_from_secret,
    new_credentials,
    node_tenants,
    plan_secrets,
    tenant_pool_status,
    tenant_secret,
)
from kvpool_operator.testing import pool_body, tenant_body

TN = parse_tenant(tenant_body("a", "team-a", ["ns1", "ns2"], [{"pool": "pools.shared", "quotaBytes": "1Gi",
                                                               "ttl": {"agent": "1d"}, "evictOwnOnQuota": True}]))


def test_new_credentials_are_random() -> None:
    a, b = new_credentials("t"), new_credentials("t")
    assert a != b and len(a.salt) == 32 and len(a.token) >= 32


def test_secret_round_trip() -> None:
    creds = Credentials("team-a", "tok", b"\x01" * 32)
    s = tenant_secret(TN, "ns1", creds)
    assert s["metadata"]["name"] == "kvpool-tenant-team-a" and s["metadata"]["namespace"] == "ns1"
    assert s["metadata"]["ownerReferences"][0]["kind"] == "TenantNamespace"
    doc = json.loads(base64.b64decode(s["data"]["credentials.json"]))
    assert doc == {"tenantId": "team-a", "token": "tok", "salt": base64.b64encode(b"\x01" * 32).decode()}
    assert base64.b64decode(s["data"]["token"]) == b"tok"
    assert credentials_from_secret(s, "team-a") == creds
    assert credentials_from_secret(s, "team-b") is None
    assert credentials_from_secret({"data": {"credentials.json": "!!"}}, "team-a") is None


def test_choose_and_plan() -> None:
    creds = Credentials("team-a", "tok", b"s" * 32)
    other = Credentials("team-a", "edited", b"s" * 32)
    secrets = [tenant_secret(TN, "ns1", creds), tenant_secret(TN, "ns2", creds), tenant_secret(TN, "ns3", other)]
    assert choose_credentials("team-a", secrets) == creds
    assert choose_credentials("team-a", []) is None
    plan = plan_secrets(TN, {"ns2": secrets[1], "old": secrets[0]}, creds)
    assert plan.apply == ("ns1",) and plan.delete == ("old",)
    plan = plan_secrets(TN, {"ns1": secrets[2], "ns2": secrets[1]}, creds)
    assert plan.apply == ("ns1",)  # a hand-edited copy is repaired


def test_node_tenants_only_for_listed_pools() -> None:
    creds = Credentials("team-a", "tok", b"s")
    b = parse_tenant(tenant_body("b", "team-b", ["nb"], [{"pool": "pools.other"}]))
    got = node_tenants(parse_pool(pool_body("shared", "pools")), [(TN, creds), (b, Credentials("team-b", "x", b""))])
    assert [t.tenant_id for t in got] == ["team-a"]
    assert (got[0].quota_bytes, got[0].ttl_seconds, got[0].evict_own_on_quota) == (1 << 30, {"agent": 86400}, True)


def test_tenant_pool_status() -> None:
    rows = tenant_pool_status(TN, {"pools.shared": {"tenants": [
        {"tenantId": "team-a", "usedBytes": 5, "physicalBytes": 10, "objects": 1, "refusals": 2, "evictions": 3},
        {"tenantId": "team-b", "usedBytes": 99}]}})
    assert rows == [{"pool": "pools.shared", "usedBytes": 5, "physicalBytes": 10, "quotaBytes": 1 << 30,
                     "objects": 1, "refusals": 2, "evictions": 3}]
    assert tenant_pool_status(TN, {})[0]["usedBytes"] == 0
