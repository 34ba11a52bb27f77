"""The sidecar's settings: the command line's defaults are SidecarConfig's (pure, no sockets)."""

from __future__ import annotations

import dataclasses

import pytest

from kvpool.sidecar.config import SidecarConfig
from kvpool.sidecar.main import build_parser, config_from_args


def test_the_command_line_defaults_are_the_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvpool sidecar --socket S`` is ``SidecarConfig(socket=S)``: every default has one
    definition, so a setting the command line leaves out cannot drift from the config's."""
    for var in ("KVPOOL_CREDENTIALS", "KVPOOL_HANDOFF_LISTEN", "KVPOOL_HANDOFF_ADVERTISE", "KVPOOL_HANDOFF_KEY_FILE"):
        monkeypatch.delenv(var, raising=False)
    got = config_from_args(build_parser().parse_args(["--socket", "/s"]))
    want = SidecarConfig(socket="/s")
    diff = {f.name: (getattr(got, f.name), getattr(want, f.name)) for f in dataclasses.fields(SidecarConfig)
            if getattr(got, f.name) != getattr(want, f.name)}
    assert not diff, diff


def test_a_lease_asked_for_is_bounded() -> None:
    cfg = SidecarConfig(socket="/s", lease_ms=10_000, max_lease_ms=60_000)
    assert cfg.lease(0) == 10_000
    assert cfg.lease(5) == 5
    assert cfg.lease(10**9) == 60_000
