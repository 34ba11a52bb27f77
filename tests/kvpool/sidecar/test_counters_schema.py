"""Every counter a store node or a sidecar sends is in the schema (``kvpool.wire.counters``),
and no counter name is spelled as a string literal in the data plane any more."""

from __future__ import annotations

import ast
import random
from pathlib import Path
from typing import Any

from kvpool.apps.cluster import LocalCluster
from kvpool.core.errors import Code
from kvpool.core.handoff_record import StateOutcome
from kvpool.core.retry import UNREACHABLE
from kvpool.wire import counters
from kvpool.wire.counters import EventsCounter, SidecarCounter, StoreCounter
from kvpool.wire.proto import store_pb2 as pb

KiB, MiB = 1 << 10, 1 << 20
ROOT = Path(__file__).resolve().parents[3]
DATA_PLANE = ROOT / "sidecar" / "kvpool"


def test_a_small_workload_sends_only_counters_of_the_schema(h: Any) -> None:
    rng = random.Random(20)
    # A small local tier and a small DRAM over an SSD tier: local eviction, demotion and
    # promotion, pool reads and writes, ranged reads all happen.
    with LocalCluster(stores=2, sidecars=1, store_bytes=2 * MiB, local_bytes=2 * MiB, ssd_bytes=32 * MiB) as lc:
        with lc.connect(0) as c:
            keys = h.keys(rng, 96)
            vals = h.values(rng, [48 * KiB] * len(keys))
            for i in range(0, len(keys), 16):
                assert c.put(keys[i:i + 16], vals[i:i + 16]) == [pb.OK] * 16
            h.wait_for(lambda: c.stats().pending_pool_bytes == 0, what="write-through backlog")
            assert c.match(keys) > 0
            for i in range(0, len(keys), 16):
                with c.get(keys[i:i + 16]) as got:
                    assert [bytes(v) for v in got] == vals[i:i + 16]
            c.match(h.keys(rng, 4))  # misses too
            sidecar = dict(c.stats().counters)
        stores = [lc.admin(a).stats() for a in lc.stores]
    store_names = {k for s in stores for k in s.counters}
    tenant_names = {k for s in stores for t in s.tenants for k in t.counters}
    # The workload did reach the paths it is meant to cover (else the check below proves little).
    assert sidecar.get(SidecarCounter.EVICTED, 0) > 0 and sidecar.get(SidecarCounter.READ_HITS_POOL, 0) > 0, sidecar
    assert {StoreCounter.STORED, StoreCounter.DEMOTED} <= store_names, store_names
    assert counters.unknown(sidecar, SidecarCounter) == []
    assert counters.unknown(store_names | tenant_names, StoreCounter) == []
    # Per tenant: the TENANT_COUNTERS and the hit-by-tier and miss-reason families.
    assert all(counters.is_tenant_counter(n) for n in tenant_names), tenant_names - counters.TENANT_COUNTERS


def test_built_names_are_in_the_schema() -> None:
    for code in [*Code, UNREACHABLE]:
        if code not in (Code.OK, Code.ALREADY_EXISTS):
            assert counters.is_sidecar_counter(counters.pool_write_failed(code))
        if code not in (Code.OK, UNREACHABLE):
            assert counters.is_sidecar_counter(counters.handoff_refused(code))
        if code != UNREACHABLE:
            assert counters.copyover_result(code) in SidecarCounter
    for tier in counters.TIER_NAMES:
        assert counters.is_tenant_counter(counters.tier_hits(tier))
    for reason in counters.STORE_MISS_REASONS:
        assert counters.is_tenant_counter(counters.miss_reason(reason))
    assert not counters.is_tenant_counter(counters.miss_reason(counters.MissReason.NO_ROOM))
    for outcome in StateOutcome:
        assert counters.is_sidecar_counter(counters.handoff_state(outcome))
    assert counters.handoff_state(StateOutcome.PEER) == "handoff_state_peer"
    assert counters.pool_write_failed(UNREACHABLE) == "pool_write_unreachable"
    assert not counters.is_sidecar_counter("pool_write_ok")
    assert not counters.is_store_counter("pool_writes")


def test_groups_the_operator_sums_are_store_counters_kept_per_tenant() -> None:
    assert set(counters.REFUSALS) | set(counters.EVICTIONS) <= counters.TENANT_COUNTERS
    assert all(c.startswith("restart_") for c in counters.RESTART) and len(counters.RESTART) == 9


def test_every_counter_has_a_docstring() -> None:
    tree = ast.parse((DATA_PLANE / "wire" / "counters.py").read_text())
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        body = cls.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.Assign):
                name = stmt.targets[0].id  # type: ignore[attr-defined]
                nxt = body[i + 1] if i + 1 < len(body) else None
                assert isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant), \
                    f"{cls.name}.{name} has no docstring"
    assert len(StoreCounter) + len(SidecarCounter) + len(EventsCounter) >= 90


NAMES = {c.value for c in (*StoreCounter, *SidecarCounter, *EventsCounter)}


def _literal_counter_uses(tree: ast.AST) -> list[str]:
    """``x.counters["name"]`` / ``counters[f"..."]`` and ``x.count("name")`` / ``x._count("name")``
    with a name of the schema: a counter spelled as a string instead of through
    kvpool.wire.counters."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, (ast.Constant, ast.JoinedStr)):
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name.endswith("counters") and not (isinstance(node.slice, ast.Constant)
                                                   and not isinstance(node.slice.value, str)):
                found.append(ast.unparse(node))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("count", "_count")
              and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value in NAMES):
            found.append(ast.unparse(node))
    return found


def test_no_counter_name_is_a_string_literal_in_the_data_plane() -> None:
    found = {str(p.relative_to(DATA_PLANE)): uses for p in DATA_PLANE.rglob("*.py")
             if (uses := _literal_counter_uses(ast.parse(p.read_text())))}
    assert not found, f"counters spelled as strings (use kvpool.wire.counters): {found}"


def test_the_literal_check_finds_what_it_looks_for() -> None:
    tree = ast.parse('n.counters["stored"] += 1\nself.counters[f"pool_write_{c}"] += 1\nnode.count("demoted")\n'
                     'self._count("expired", t)\nxs.count("a")\n'
                     'n.counters[StoreCounter.STORED] += 1\nn.counters[name] += 1\n')
    assert _literal_counter_uses(tree) == ["n.counters['stored']", "self.counters[f'pool_write_{c}']",
                                           "node.count('demoted')", "self._count('expired', t)"]
