"""Thin kopf adapters, one module per custom resource (plus the admission webhook).

Each module has ``register(registry, runtime)``, so handlers bind to an explicit registry and
runtime (no import-time globals): :func:`register_all` is what ``main`` calls.
"""

from __future__ import annotations

from typing import Any

from ..runtime import Runtime
from . import kvpool, kvtier, tenantnamespace, webhook


def register_all(registry: Any, rt: Runtime, with_webhook: bool = True) -> None:
    kvpool.register(registry, rt)
    kvtier.register(registry, rt)
    tenantnamespace.register(registry, rt)
    if with_webhook:
        webhook.register(registry, rt)
