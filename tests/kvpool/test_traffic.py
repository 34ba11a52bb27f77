"""The default traffic class is spelled once: in kvpool.core.traffic."""

from __future__ import annotations

from pathlib import Path

from kvpool.core.traffic import DEFAULT_TRAFFIC_CLASS, DEFAULT_TTL, DEFAULT_TTL_SECONDS, traffic_class_or_default

ROOT = Path(__file__).resolve().parents[2]


def test_the_default_class_is_a_literal_only_in_core_traffic() -> None:
    literal = f'"{DEFAULT_TRAFFIC_CLASS}"'
    found = {str(p.relative_to(ROOT)) for top in ("sidecar", "operator") for p in (ROOT / top).rglob("*.py")
             if literal in p.read_text()}
    assert found == {"sidecar/kvpool/core/traffic.py"}


def test_defaults() -> None:
    assert traffic_class_or_default("") == DEFAULT_TRAFFIC_CLASS
    assert traffic_class_or_default("agent") == "agent"
    assert DEFAULT_TTL.keys() == DEFAULT_TTL_SECONDS.keys() and DEFAULT_TRAFFIC_CLASS in DEFAULT_TTL
