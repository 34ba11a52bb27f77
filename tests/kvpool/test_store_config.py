"""Store node configuration parsing: CLI flags over the JSON file, fail fast with the field's name."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from kvpool.store.config import ConfigError, load_node_config, load_tenants


def _args(tmp_path: Path, doc: dict[str, Any] | None = None, **kw: Any) -> argparse.Namespace:
    path = None
    if doc is not None:
        path = tmp_path / "node.json"
        path.write_text(json.dumps(doc))
    base = {"config": str(path) if path else None, "node_id": "n1", "dram": None, "ssd_path": None, "ssd": None,
            "sharedfs": None, "closed": False}
    return argparse.Namespace(**{**base, **kw})


def test_defaults_and_overrides(tmp_path: Path) -> None:
    cfg = load_node_config(_args(tmp_path))
    assert cfg.node_id == "n1" and cfg.verify_on_commit is None and cfg.open_tenancy
    cfg = load_node_config(_args(tmp_path, {"dramBytes": 1 << 20, "ttlSeconds": {"chatbot": 1},
                                            "verifyOnCommit": True, "reservationSeconds": 0.5, "closed": True},
                                 dram=2 << 20))
    assert cfg.dram_bytes == 2 << 20  # the flag wins over the file
    assert cfg.ttl_seconds == {"chatbot": 1.0}
    assert cfg.verify_on_commit is True and cfg.reservation_seconds == 0.5 and not cfg.open_tenancy
    assert load_node_config(_args(tmp_path, {"verifyOnCommit": "auto"})).verify_on_commit is None
    assert load_node_config(_args(tmp_path, {"verifyOnCommit": False})).verify_on_commit is False


def test_tier_bounds_and_the_fault_hook(tmp_path: Path) -> None:
    cfg = load_node_config(_args(tmp_path))
    assert cfg.tier_read_seconds == 0.25 and cfg.demote_wait_seconds == 0.5 and cfg.fault_tier_delay_file == ""
    cfg = load_node_config(_args(tmp_path, {"tierReadSeconds": 1, "demoteWaitSeconds": 0, "faultTierDelayFile": "/a"}))
    assert cfg.tier_read_seconds == 1.0 and cfg.demote_wait_seconds == 0.0 and cfg.fault_tier_delay_file == "/a"
    cfg = load_node_config(_args(tmp_path, {"faultTierDelayFile": "/a"}, fault_tier_delay_file="/b"))
    assert cfg.fault_tier_delay_file == "/b"  # the flag wins over the file


@pytest.mark.parametrize("doc,field", [
    ({"verifyOnCommit": "yes"}, "verifyOnCommit"),
    ({"reservationSeconds": 0}, "reservationSeconds"),
    ({"reservationSeconds": "1"}, "reservationSeconds"),
    ({"ttlSeconds": {"chatbot": -1}}, "ttlSeconds"),
    ({"watermarks": {"high": 0.5, "low": 0.9}}, "watermarks"),
    ({"dramBytes": -5}, "dramBytes"),
    ({"tierReadSeconds": -1}, "tierReadSeconds"),
    ({"demoteWaitSeconds": "1"}, "demoteWaitSeconds"),
])
def test_bad_fields_fail_fast_with_their_name(tmp_path: Path, doc: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as ei:
        load_node_config(_args(tmp_path, doc))
    assert field in str(ei.value)


def test_tenants_file(tmp_path: Path) -> None:
    p = tmp_path / "t.json"
    p.write_text(json.dumps([{"tenantId": "a", "token": "t", "salt": "c2FsdA==", "quotaBytes": 10,
                              "evictOwnOnQuota": True, "ttlSeconds": {"agent": 5}}]))
    [t] = load_tenants(str(p))
    assert (t.tenant_id, t.token, t.salt, t.quota_bytes, t.evict_own_on_quota, t.ttl_seconds) == (
        "a", "t", b"salt", 10, True, {"agent": 5.0})
    p.write_text(json.dumps([{"tenantId": "a"}]))
    with pytest.raises(ConfigError):
        load_tenants(str(p))


def test_master_key_file(tmp_path: Path) -> None:
    key = tmp_path / "master"
    key.write_text("k" * 44 + "\n")
    cfg = load_node_config(_args(tmp_path, master_key_file=str(key)))
    assert cfg.master_key == b"k" * 44
    assert "kkkk" not in repr(cfg)  # the key never shows up in a log line of the config
    assert load_node_config(_args(tmp_path, {"masterKeyFile": str(key)})).master_key == b"k" * 44
    assert load_node_config(_args(tmp_path)).master_key == b""
    key.write_text("short")
    with pytest.raises(ConfigError, match="master-key-file.*at least 32 bytes"):
        load_node_config(_args(tmp_path, master_key_file=str(key)))
    with pytest.raises(ConfigError, match="master-key-file.*cannot read"):
        load_node_config(_args(tmp_path, master_key_file=str(tmp_path / "missing")))
