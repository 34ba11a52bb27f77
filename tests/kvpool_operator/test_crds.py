"""The CRD manifests: structure, names, printer columns, CEL rules; the examples fit the schemas.

Structural checks only: that the API server accepts them and enforces each rule is tested on the
real control plane (e2e/test_operator_crds.py).
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from kvpool.core.traffic import DEFAULT_TRAFFIC_CLASS, DEFAULT_TTL, DEFAULT_TTL_SECONDS
from kvpool_operator.model import parse_pool, parse_tenant, parse_tier
from kvpool_operator.units import parse_duration

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRDS = {p.stem: yaml.safe_load(p.read_text()) for p in sorted((ROOT / "crds").glob("*.yaml"))
        if p.stem != "kopf-peering"}
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def _schema(name: str) -> dict[str, Any]:
    v = CRDS[name]["spec"]["versions"][0]
    return dict(v["schema"]["openAPIV3Schema"])


def _at(schema: dict[str, Any], path: str) -> dict[str, Any]:
    cur = schema
    for part in path.split("."):
        cur = cur["items"] if part == "[]" else cur["properties"][part]
    return cur


def _rules(schema: Any) -> Iterator[dict[str, Any]]:
    if isinstance(schema, dict):
        yield from schema.get("x-kubernetes-validations", [])
        for v in schema.values():
            yield from _rules(v)
    elif isinstance(schema, list):
        for v in schema:
            yield from _rules(v)


def test_three_crds_with_names_and_scopes() -> None:
    want = {"kvpool": ("KVPool", "Namespaced", "kvp"), "kvtier": ("KVTier", "Cluster", "kvt"),
            "tenantnamespace": ("TenantNamespace", "Cluster", "tns")}
    assert set(CRDS) == set(want)
    for stem, (kind, scope, short) in want.items():
        crd = CRDS[stem]
        assert crd["apiVersion"] == "apiextensions.k8s.io/v1" and crd["spec"]["group"] == "kvpool.io"
        assert crd["metadata"]["name"] == f"{crd['spec']['names']['plural']}.kvpool.io"
        assert crd["spec"]["names"]["kind"] == kind and crd["spec"]["scope"] == scope
        assert short in crd["spec"]["names"]["shortNames"]
        (version,) = crd["spec"]["versions"]
        assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
        assert version["subresources"]["status"] == {}
        assert version["additionalPrinterColumns"]


def test_kopf_peering_crds() -> None:
    docs = list(yaml.safe_load_all((ROOT / "crds" / "kopf-peering.yaml").read_text()))
    assert {d["metadata"]["name"] for d in docs} == {"clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"}


def test_kvpool_printer_columns() -> None:
    cols = [c["name"] for c in CRDS["kvpool"]["spec"]["versions"][0]["additionalPrinterColumns"]]
    assert cols == ["Ready", "Replicas", "Capacity", "Used", "Utilization", "HitRate", "Phase", "Age"]


@pytest.mark.parametrize("path", [
    "spec.blockTokens", "spec.hash", "spec.storage.replicas", "spec.storage.tiers", "spec.storage.replication",
    "spec.autoscaling.minReplicas", "spec.autoscaling.maxReplicas", "spec.autoscaling.targetUtilization",
    "spec.scaleDown.gracePeriodSeconds", "spec.ttl", "spec.sidecar.localBytes", "spec.tenancy.defaultTenant",
    "status.conditions.[].type", "status.conditions.[].status", "status.conditions.[].reason",
    "status.conditions.[].message", "status.ring", "status.drain", "status.hitRate", "status.phase",
    "spec.scaleUp.warmBandwidth", "spec.scaleUp.warmFraction", "spec.scaleUp.warmDeadlineSeconds",
    "status.rebalance", "status.lastRebalance", "spec.storage.memberUnreadyGraceSeconds",
    "spec.router.allowedFrom", "spec.router.allowedFrom.[].ipBlock.cidr", "status.networkPolicies",
    "spec.security.dataSession",
])
def test_kvpool_fields(path: str) -> None:
    assert _at(_schema("kvpool"), path)


@pytest.mark.parametrize("path", ["spec.tenantId", "spec.namespaces", "spec.pools.[].pool",
                                  "spec.pools.[].quotaBytes", "spec.pools.[].ttl", "status.conditions.[].reason",
                                  "status.pools.[].refusals"])
def test_tenantnamespace_fields(path: str) -> None:
    assert _at(_schema("tenantnamespace"), path)


@pytest.mark.parametrize("crd", ["crds/kvpool.yaml", "charts/kvpool/crds/kvpool.yaml"])
def test_the_crd_ttl_default_is_the_data_planes_with_the_default_traffic_class(crd: str) -> None:
    """A KVPool that names no TTL gets, from the API server, the TTLs a store node applies
    when its configuration names none (kvpool.core.traffic): one set of defaults, and the
    class of a write that names none is among them."""
    doc = yaml.safe_load((ROOT / crd).read_text())
    ttl = _at(dict(doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]), "spec.ttl")["default"]
    assert ttl == DEFAULT_TTL
    assert DEFAULT_TRAFFIC_CLASS in ttl
    assert {c: parse_duration(v) for c, v in ttl.items()} == DEFAULT_TTL_SECONDS


def test_defaults() -> None:
    s = _schema("kvpool")
    assert _at(s, "spec.blockTokens")["default"] == 128
    assert _at(s, "spec.ttl")["default"] == DEFAULT_TTL  # the data plane's defaults (kvpool.core.traffic)
    assert _at(s, "spec.scaleDown.gracePeriodSeconds")["default"] == 60
    assert _at(s, "spec.scaleDown.utilizationLimit")["default"] == 0.8
    assert _at(_schema("kvtier"), "spec.watermarks.high")["default"] == 0.95
    session = _at(s, "spec.security.dataSession")
    assert session["default"] == "Encrypted" and session["enum"] == ["Encrypted", "Plaintext"]


def test_cel_rules_present() -> None:
    pool = {r["rule"]: r["message"] for r in _rules(_schema("kvpool"))}
    tier = {r["rule"]: r["message"] for r in _rules(_schema("kvtier"))}
    tenant = {r["rule"]: r["message"] for r in _rules(_schema("tenantnamespace"))}
    assert any("self.minReplicas" in r and "<=" in r and "self.maxReplicas" in r for r in pool)
    assert any("self.low" in r and "<" in r and "self.high" in r for r in tier)
    assert any("self.storage.replication <= self.storage.replicas" in r for r in pool)
    assert any("self.warmFraction == 0.0" in r and "self.warmDeadlineSeconds > 0" in r for r in pool)
    assert any(m.startswith("scaleUp.warmBandwidth") for m in pool.values())
    assert any("quantity(self).isGreaterThan(quantity('0'))" in r for r in tenant)  # quota positive
    assert any("quantity(self).isGreaterThan(quantity('0'))" in r for r in tier)  # capacity positive
    assert sum("self == oldSelf" == r for r in _rules_list("kvpool")) == 2  # blockTokens and hash
    assert _at(_schema("kvpool"), "spec.blockTokens")["x-kubernetes-validations"][0]["rule"] == "self == oldSelf"
    assert _at(_schema("kvpool"), "spec.hash")["x-kubernetes-validations"][0]["rule"] == "self == oldSelf"
    assert _at(_schema("tenantnamespace"), "spec.tenantId")["x-kubernetes-validations"][0]["rule"] == "self == oldSelf"
    for rules in (pool, tier, tenant):
        assert all(m and m[0].islower() for m in rules.values())  # every rule explains itself


def _rules_list(name: str) -> list[str]:
    return [r["rule"] for r in _rules(_schema(name))]


def _structural(schema: dict[str, Any], where: str) -> None:
    """Every node has a type, or is int-or-string, or preserves unknown fields (structural schema)."""
    assert "type" in schema or schema.get("x-kubernetes-int-or-string") or schema.get(
        "x-kubernetes-preserve-unknown-fields"), where
    for k, v in schema.get("properties", {}).items():
        _structural(v, f"{where}.{k}")
    if "items" in schema:
        _structural(schema["items"], f"{where}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        _structural(schema["additionalProperties"], f"{where}.*")


@pytest.mark.parametrize("name", ["kvpool", "kvtier", "tenantnamespace"])
def test_schemas_are_structural(name: str) -> None:
    _structural(_schema(name), name)


# ------------------------------------------------------------------------------- examples


def _check(value: Any, schema: dict[str, Any], where: str) -> None:
    """A small OpenAPI subset: types, enums, required, unknown fields (what kubectl would refuse)."""
    if schema.get("x-kubernetes-int-or-string"):
        assert isinstance(value, int | str), where
        return
    t = schema.get("type")
    if t == "object":
        assert isinstance(value, dict), where
        for r in schema.get("required", []):
            assert r in value, f"{where}.{r} is required"
        props = schema.get("properties", {})
        for k, v in value.items():
            if k in props:
                _check(v, props[k], f"{where}.{k}")
            elif isinstance(schema.get("additionalProperties"), dict):
                _check(v, schema["additionalProperties"], f"{where}.{k}")
            else:
                assert schema.get("x-kubernetes-preserve-unknown-fields") or where.endswith("metadata"), \
                    f"unknown field {where}.{k}"
    elif t == "array":
        assert isinstance(value, list), where
        for i, v in enumerate(value):
            _check(v, schema["items"], f"{where}[{i}]")
    elif t == "string":
        assert isinstance(value, str), where
    elif t == "integer":
        assert isinstance(value, int), where
    elif t == "number":
        assert isinstance(value, int | float), where
    elif t == "boolean":
        assert isinstance(value, bool), where
    if "enum" in schema:
        assert value in schema["enum"], where


KIND_TO_CRD = {"KVPool": "kvpool", "KVTier": "kvtier", "TenantNamespace": "tenantnamespace"}
PARSERS = {"KVPool": parse_pool, "KVTier": parse_tier, "TenantNamespace": parse_tenant}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_fit_the_schemas(path: pathlib.Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs
    for d in docs:
        if d["kind"] in KIND_TO_CRD:
            assert d["apiVersion"] == "kvpool.io/v1alpha1"
            _check(d, _schema(KIND_TO_CRD[d["kind"]]), d["kind"])
            PARSERS[d["kind"]](d)


def test_example_set() -> None:
    assert {p.name for p in EXAMPLES} >= {"minimal.yaml", "dram-ssd.yaml", "two-tenants.yaml",
                                          "engine-deployment.yaml"}
    minimal = [d for d in yaml.safe_load_all((ROOT / "examples/minimal.yaml").read_text()) if d]
    assert [d["kind"] for d in minimal] == ["KVPool"] and minimal[0]["spec"]["tenancy"]["defaultTenant"]
    engine = yaml.safe_load((ROOT / "examples/engine-deployment.yaml").read_text())
    assert engine["spec"]["template"]["metadata"]["labels"]["kvpool.io/pool"]
