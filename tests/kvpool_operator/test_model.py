"""Typed views of the custom resources: defaults, validation, tier resolution."""

from typing import Any

import pytest

from kvpool.core.traffic import DEFAULT_TTL_SECONDS
from kvpool_operator.model import (
    SpecError,
    parse_pool,
    parse_pool_ref,
    parse_tenant,
    parse_tier,
    resolve_layout,
)
from kvpool_operator.testing import pool_body, tenant_body, tier_body


def test_pool_defaults() -> None:
    p = parse_pool(pool_body())
    assert (p.block_tokens, p.hash, p.replicas, p.replication, p.port) == (128, "sha256", 1, 1, 7400)
    assert p.ttl_seconds == DEFAULT_TTL_SECONDS
    assert p.grace_period_seconds == 60 and p.utilization_limit == 0.8 and p.drain_bytes_per_second == 0
    assert parse_pool(pool_body(scaleDown={"drainBandwidth": "64Mi"})).drain_bytes_per_second == 64 << 20
    assert (p.warm_fraction, p.warm_seconds, p.warm_bytes_per_second) == (1.0, 300, 0)
    up = parse_pool(pool_body(scaleUp={"warmBandwidth": "32Mi", "warmFraction": 0.25, "warmDeadlineSeconds": 90}))
    assert (up.warm_fraction, up.warm_seconds, up.warm_bytes_per_second) == (0.25, 90, 32 << 20)
    assert parse_pool(pool_body(scaleUp={"warmFraction": 0, "warmDeadlineSeconds": 0})).warm_fraction == 0
    assert p.local_bytes == 256 << 20 and p.default_tenant is None and not p.force_scale_down
    assert p.member_unready_grace_seconds is None  # the operator's setting applies
    assert parse_pool(pool_body(storage={"memberUnreadyGraceSeconds": 0})).member_unready_grace_seconds == 0
    assert p.key == "ns.p"


def test_pool_ttl_override_and_annotation() -> None:
    body = pool_body(ttl={"agent": "1d", "batch": "2h"})
    body["metadata"]["annotations"] = {"kvpool.io/force-scale-down": "true"}
    p = parse_pool(body)
    assert p.ttl_seconds == {"agent": 86400, "chatbot": 7 * 86400, "batch": 7200}
    assert p.force_scale_down


@pytest.mark.parametrize(("spec", "match"), [
    ({"storage": {"replicas": 1, "replication": 2}}, "replication"),
    ({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}, "minReplicas"),
    ({"autoscaling": {"targetUtilization": 1.5}}, "targetUtilization"),
    ({"sidecar": {"localBytes": "0"}}, "localBytes"),
    ({"sidecar": {"localBytes": "lots"}}, "localBytes"),
    ({"ttl": {"agent": "forever"}}, "agent"),
    ({"scaleDown": {"utilizationLimit": 0}}, "utilizationLimit"),
    ({"storage": {"tiers": ["a", "a"]}}, "twice"),
    ({"blockTokens": 0}, "blockTokens"),
    ({"scaleUp": {"warmFraction": 1.5}}, "warmFraction"),
    ({"scaleUp": {"warmDeadlineSeconds": 0}}, "warmDeadlineSeconds"),
    ({"scaleUp": {"warmBandwidth": "fast"}}, "warmBandwidth"),
    ({"storage": {"memberUnreadyGraceSeconds": -1}}, "memberUnreadyGraceSeconds"),
    ({"storage": {"memberUnreadyGraceSeconds": "15s"}}, "memberUnreadyGraceSeconds"),
])
def test_pool_invalid(spec: dict[str, Any], match: str) -> None:
    with pytest.raises(SpecError, match=match):
        parse_pool(pool_body(**spec))


def test_tier_parse_and_invalid() -> None:
    t = parse_tier(tier_body("d", capacity={"bytes": "8Gi"}, watermarks={"high": 0.9, "low": 0.8}))
    assert (t.capacity_bytes, t.high_watermark, t.low_watermark, t.write_policy) == (8 << 30, 0.9, 0.8, "write-back")
    cases: list[tuple[dict[str, Any], str]] = [({"capacity": {}}, "exactly one"),
                        ({"capacity": {"bytes": "1Gi", "memoryFraction": 0.5}}, "exactly one"),
                        ({"watermarks": {"high": 0.5, "low": 0.6}}, "low < high"),
                        ({"medium": "tape"}, "medium")]
    for spec, match in cases:
        with pytest.raises(SpecError, match=match):
            parse_tier(tier_body("x", **spec))
    with pytest.raises(SpecError, match="memoryFraction"):
        parse_tier(tier_body("s", "ssd", capacity={"memoryFraction": 0.5}))
    with pytest.raises(SpecError, match="sharedfs.volume"):
        parse_tier(tier_body("f", "sharedfs"))
    with pytest.raises(SpecError, match="encryptAtRest is for ssd and sharedfs"):
        parse_tier(tier_body("d", encryptAtRest=True))
    with pytest.raises(SpecError, match="encryptAtRest must be true or false"):
        parse_tier(tier_body("s", "ssd", encryptAtRest="yes"))
    assert parse_tier(tier_body("s", "ssd", encryptAtRest=True)).encrypt_at_rest
    assert not parse_tier(tier_body("s", "ssd")).encrypt_at_rest


def test_pool_encryption() -> None:
    assert not parse_pool(pool_body()).encryption
    pool = parse_pool(pool_body(storage={"encryption": {"enabled": True, "secretName": "k"}}))
    assert (pool.encryption, pool.encryption_secret) == (True, "k")
    with pytest.raises(SpecError, match="encryption.enabled"):
        parse_pool(pool_body(storage={"encryption": {"enabled": "on"}}))


def test_layout_builtin_and_tiers() -> None:
    lay = resolve_layout(parse_pool(pool_body()), {}, 1 << 30, 256 << 20)
    assert lay.dram_bytes == 1 << 30 and lay.ssd is None and lay.memory_limit_bytes == (1 << 30) + (256 << 20)
    tiers = {"d": parse_tier(tier_body("d", capacity={"bytes": "2Gi"})),
             "s": parse_tier(tier_body("s", "ssd", capacity={"bytes": "10Gi"})),
             "f": parse_tier(tier_body("f", "sharedfs", sharedfs={"volume": {"hostPath": {"path": "/x"}}}))}
    lay = resolve_layout(parse_pool(pool_body(storage={"tiers": ["d", "s", "f"]})), tiers, 1, 0)
    assert lay.tier_names == ("d", "s", "f") and lay.capacity_bytes == 12 << 30


def test_layout_errors() -> None:
    tiers = {"d": parse_tier(tier_body("d")), "s": parse_tier(tier_body("s", "ssd")),
             "m": parse_tier(tier_body("m", capacity={"memoryFraction": 0.5}))}
    for names, reason in [(["x"], "TierNotFound"), (["s"], "InvalidTiers"), (["d", "d2"], "TierNotFound"),
                          (["s", "d"], "InvalidTiers"), (["m"], "InvalidTiers")]:
        with pytest.raises(SpecError) as err:
            resolve_layout(parse_pool(pool_body(storage={"tiers": names})), tiers, 1, 0)
        assert err.value.reason == reason, names
    lay = resolve_layout(parse_pool(pool_body(storage={"tiers": ["m"], "resources": {"limits": {"memory": "4Gi"}}})),
                         tiers, 1, 0)
    assert lay.dram_bytes == 2 << 30 and lay.memory_limit_bytes == 4 << 30


def test_pool_refs() -> None:
    assert parse_pool_ref("p", "ns") == ("ns", "p")
    assert parse_pool_ref("other.p.v2", "ns") == ("other", "p.v2")
    assert parse_pool_ref("", "ns") is None and parse_pool_ref(".p", "ns") is None
    assert parse_pool_ref("p", None) is None


def test_tenant_parse() -> None:
    t = parse_tenant(tenant_body("a", "team-a", ["ns-a"], [{"pool": "pools.shared", "quotaBytes": "1Gi",
                                                            "ttl": {"chatbot": "1d"}}]))
    assert t.secret_name == "kvpool-tenant-team-a" and t.namespaces == ("ns-a",)
    entry = t.pool("pools.shared")
    assert entry is not None and entry.quota_bytes == 1 << 30 and entry.ttl_seconds == {"chatbot": 86400}
    with pytest.raises(SpecError, match="namespace.name"):
        parse_tenant(tenant_body("a", "a", ["x"], [{"pool": "shared"}]))
    with pytest.raises(SpecError, match="namespaces"):
        parse_tenant(tenant_body("a", "a", []))
