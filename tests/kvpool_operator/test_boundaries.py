"""Boundaries of the operator (STYLE 3), checked on the source until an import-linter contract
covers them: only ``kube`` imports the Kubernetes client, only ``nodes`` the store nodes' admin
client (or gRPC), only handlers and ``main`` kopf, and of the data plane only the ring, the push
jobs' statuses, the proto modules and their conversions, the admin client and the errors it raises,
the master-key format of encryption at rest (the operator checks a Secret by the nodes' own rules),
the sizes of the tiers' memory files (the operator sizes pod volumes by the processes' own rules),
the pool quota's arithmetic (status counts a tenant's usage in the unit the nodes enforce), the
default traffic class and TTLs (``kvpool.core.traffic``) and the counter schema whose groups
status sums (``kvpool.wire.counters``)."""

from __future__ import annotations

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[2] / "operator" / "kvpool_operator"
DATA_PLANE_ALLOWED = ("kvpool.core.ring", "kvpool.core.push_status", "kvpool.wire.proto", "kvpool.wire.convert",
                      "kvpool.pool.admin_client", "kvpool.core.errors", "kvpool.tiers.atrest",
                      "kvpool.core.sizing", "kvpool.core.traffic", "kvpool.wire.counters", "kvpool.store.quota",
                      "kvpool.core.pki", "kvpool.wire.tls", "kvpool.wire.metric_names")


def _imports() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        mods: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                mods |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods.add(node.module)
        out[str(path.relative_to(PKG))] = mods
    return out


def _users(prefix: str) -> set[str]:
    return {f for f, mods in _imports().items() if any(m == prefix or m.startswith(prefix + ".") for m in mods)}


def test_one_module_talks_to_kubernetes() -> None:
    assert _users("kubernetes") == {"kube.py"}


def test_one_module_talks_to_store_nodes() -> None:
    assert _users("kvpool.pool.admin_client") == {"nodes.py"}
    assert _users("grpc") <= {"nodes.py"}


def test_kopf_only_in_handlers_and_main() -> None:
    assert {f for f in _users("kopf") if not f.startswith("handlers/")} <= {"main.py"}


def test_no_data_plane_internals() -> None:
    for f, mods in _imports().items():
        bad = {m for m in mods if (m == "kvpool" or m.startswith("kvpool.")) and not m.startswith(DATA_PLANE_ALLOWED)}
        assert not bad, f"{f} imports {bad}"
