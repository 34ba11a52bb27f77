"""Store node configuration: CLI flags over an optional JSON file (the operator's ConfigMap).

Fails fast with a message naming the field; the result is a :class:`NodeConfig`.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import socket
from typing import Any

from kvpool.store.node import NodeConfig, Tenant
from kvpool.tiers.atrest import MasterKeyError, load_master_key, load_previous_keys
from kvpool.wire.kv_events import events_config


class ConfigError(SystemExit):
    def __init__(self, message: str) -> None:
        super().__init__(f"kvpool store: {message}")


def _bytes(doc: dict[str, Any], name: str, default: int) -> int:
    v = doc.get(name, default)
    if not isinstance(v, int) or v < 0:
        raise ConfigError(f"{name} must be a non-negative integer of bytes, got {v!r}")
    return v


def load_node_config(args: argparse.Namespace) -> NodeConfig:
    doc: dict[str, Any] = {}
    if args.config:
        try:
            with open(args.config) as f:
                doc = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read --config {args.config}: {exc}") from None
        if not isinstance(doc, dict):
            raise ConfigError("--config must hold a JSON object")
    node_id = args.node_id or doc.get("nodeId") or os.environ.get("KVPOOL_NODE_ID") or socket.gethostname()
    cfg = NodeConfig(node_id=str(node_id))
    cfg.dram_bytes = args.dram if args.dram is not None else _bytes(doc, "dramBytes", cfg.dram_bytes)
    cfg.ssd_path = args.ssd_path or doc.get("ssdPath", "")
    cfg.ssd_bytes = args.ssd if args.ssd is not None else _bytes(doc, "ssdBytes", 0)
    cfg.sharedfs_path = args.sharedfs or doc.get("sharedfsPath", "")
    if cfg.ssd_bytes and not cfg.ssd_path:
        raise ConfigError("--ssd needs --ssd-path")
    cfg.events = events_config(args)
    cfg.events_tenant = getattr(args, "events_tenant", None) or cfg.events_tenant
    key_file = getattr(args, "master_key_file", None) or doc.get("masterKeyFile", "")
    prev_file = getattr(args, "previous_master_keys_file", None) or doc.get("previousMasterKeysFile", "")
    if prev_file and not key_file:
        raise ConfigError("--previous-master-keys-file needs --master-key-file")
    if key_file:
        try:
            cfg.master_key = load_master_key(str(key_file))
        except MasterKeyError as exc:
            raise ConfigError(f"--master-key-file: {exc}") from None
        try:
            cfg.previous_master_keys = load_previous_keys(str(prev_file)) if prev_file else []
        except MasterKeyError as exc:
            raise ConfigError(f"--previous-master-keys-file: {exc}") from None
        cfg.master_key_file, cfg.previous_master_keys_file = str(key_file), str(prev_file or "")
        reload = doc.get("masterKeyReloadSeconds", cfg.master_key_reload_seconds)
        if not isinstance(reload, int | float) or reload < 0:
            raise ConfigError(f"masterKeyReloadSeconds must be a non-negative number, got {reload!r}")
        cfg.master_key_reload_seconds = float(reload)
    if cfg.dram_bytes <= 0:
        raise ConfigError("--dram (or dramBytes) must be a positive byte size")
    wm = doc.get("watermarks", {})
    cfg.high_watermark = float(wm.get("high", cfg.high_watermark))
    cfg.low_watermark = float(wm.get("low", cfg.low_watermark))
    if not 0 < cfg.low_watermark < cfg.high_watermark <= 1:
        raise ConfigError("watermarks must satisfy 0 < low < high <= 1")
    ttl = doc.get("ttlSeconds")
    if ttl is not None:
        if not isinstance(ttl, dict) or not all(isinstance(v, int | float) and v >= 0 for v in ttl.values()):
            raise ConfigError("ttlSeconds must map traffic classes to non-negative seconds")
        cfg.ttl_seconds = {str(k): float(v) for k, v in ttl.items()}
    cfg.open_tenancy = not (args.closed or doc.get("closed", False))
    verify = doc.get("verifyOnCommit", "auto")
    if verify not in (True, False, "auto"):
        raise ConfigError(f"verifyOnCommit must be true, false or \"auto\", got {verify!r}")
    cfg.verify_on_commit = None if verify == "auto" else bool(verify)
    res = doc.get("reservationSeconds", cfg.reservation_seconds)
    if not isinstance(res, int | float) or res <= 0:
        raise ConfigError(f"reservationSeconds must be a positive number, got {res!r}")
    cfg.reservation_seconds = float(res)
    cfg.max_range_bytes = _bytes(doc, "maxRangeBytes", cfg.max_range_bytes)
    per_key = doc.get("maxRangesPerKey", cfg.max_ranges_per_key)
    if cfg.max_range_bytes <= 0 or not isinstance(per_key, int) or isinstance(per_key, bool) or per_key <= 0:
        raise ConfigError("maxRangeBytes and maxRangesPerKey must be positive")
    cfg.max_ranges_per_key = per_key
    for name, attr in (("tierReadSeconds", "tier_read_seconds"), ("demoteWaitSeconds", "demote_wait_seconds")):
        v = doc.get(name, getattr(cfg, attr))
        if not isinstance(v, int | float) or isinstance(v, bool) or v < 0:
            raise ConfigError(f"{name} must be a non-negative number of seconds, got {v!r}")
        setattr(cfg, attr, float(v))
    cfg.fault_tier_delay_file = str(getattr(args, "fault_tier_delay_file", None) or doc.get("faultTierDelayFile", ""))
    cfg.rdma = str(getattr(args, "rdma", None) or doc.get("rdma", ""))
    shared = bool(getattr(args, "rdma_shared_tenants", False)) or doc.get("rdmaSharedTenants", False)
    if not isinstance(shared, bool):
        raise ConfigError(f"rdmaSharedTenants must be true or false, got {shared!r}")
    cfg.rdma_shared_tenants = shared
    if "shmDir" in doc:
        cfg.shm_dir = str(doc["shmDir"])
    return cfg


def load_tenants(path: str) -> list[Tenant]:
    """A JSON list of {tenantId, token, salt (base64), quotaBytes, ttlSeconds, evictOwnOnQuota}."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read tenants file {path}: {exc}") from None
    out = []
    for i, t in enumerate(doc if isinstance(doc, list) else []):
        if not isinstance(t, dict) or not t.get("tenantId") or not t.get("token"):
            raise ConfigError(f"tenant {i}: tenantId and token are required")
        out.append(Tenant(str(t["tenantId"]), str(t["token"]), base64.b64decode(t.get("salt", "")),
                          int(t.get("quotaBytes", 0)), {k: float(v) for k, v in t.get("ttlSeconds", {}).items()},
                          bool(t.get("evictOwnOnQuota", False))))
    return out
