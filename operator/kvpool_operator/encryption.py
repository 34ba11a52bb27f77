"""Whether a pool's master-key Secret can be used by its store nodes (encryption at rest).

Pure: the Secret as read → None, or the (reason, message) of a Degraded condition.  Checked by
the same rules as the node applies at start (``kvpool.tiers.atrest``), so a Secret the operator
accepts never crash-loops the nodes, and a missing or broken one is said in the pool's status
instead of as pods stuck in ContainerCreating.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

from kvpool.tiers.atrest import MasterKeyError, parse_master_key, parse_previous_keys

from .children import MASTER_KEY_KEY, PREVIOUS_KEYS_KEY


def master_key_problem(secret: Mapping[str, Any] | None, name: str, namespace: str) -> tuple[str, str] | None:
    where = f"Secret {namespace}/{name}"
    if secret is None:
        return ("MasterKeySecretMissing",
                f"{where} (the master key of encryption at rest) does not exist; store nodes are not started "
                f"without it")
    data = secret.get("data") or {}

    def entry(k: str) -> bytes | None:
        raw = data.get(k)
        if raw is None:
            return None
        try:
            return base64.b64decode(raw, validate=True)
        except (binascii.Error, ValueError):
            return b""

    key = entry(MASTER_KEY_KEY)
    if not key:
        return "MasterKeyInvalid", f"{where} has no {MASTER_KEY_KEY!r} entry"
    try:
        parse_master_key(key)
        prev = entry(PREVIOUS_KEYS_KEY)
        if prev is not None:
            parse_previous_keys(prev)
    except MasterKeyError as exc:
        return "MasterKeyInvalid", f"{where}: {exc}"
    return None
