"""The benchmark's transport-security modes (issue 23's cost must-show): every mode of
``--kvpool-tls`` is measured in each round under its own system name, and run.py sets each TLS
mode against plain within the round; a plain-only run keeps its rows' and ratios' names."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # --import-mode=importlib does not put the rootdir on sys.path
    sys.path.insert(0, str(ROOT))

from bench.common import EXISTS_KEYS, TLS_MODES, Context, MiB, Plan, Procs, Row, per_tls_mode  # noqa: E402
from bench.run import MODE_OPS, SIDECAR_RATIOS, STORE_RATIOS, mode_ratios, ratio_values  # noqa: E402

ALL = ("plain", "tls", "tls-plain-data")


def test_each_mode_names_its_rows_and_plain_keeps_the_old_names() -> None:
    assert [TLS_MODES[m].system("kvpool_sidecar") for m in ALL] == [
        "kvpool_sidecar", "kvpool_sidecar_tls", "kvpool_sidecar_tls_plaindata"]
    assert [TLS_MODES[m].system("kvpool_store") for m in ALL] == [
        "kvpool_store", "kvpool_store_tls", "kvpool_store_tls_plaindata"]


def test_each_mode_starts_its_cluster_as_it_says() -> None:
    assert TLS_MODES["plain"].cluster_args() == {"tls": False, "store_args": []}
    assert TLS_MODES["tls"].cluster_args() == {"tls": True, "store_args": []}
    assert TLS_MODES["tls-plain-data"].cluster_args() == {"tls": True, "store_args": ["--plaintext-data-session"]}


def test_one_step_measures_every_mode_in_order(tmp_path: Path) -> None:
    ctx = Context(plan=Plan.make(True), procs=Procs(tmp_path), work_dir=tmp_path, suite="sidecar",
                  kvpool_tls=ALL)
    rows = per_tls_mode(ctx, lambda mode: [Row(TLS_MODES[mode].system("s"), "put", MiB, 16)])
    assert [r.system for r in rows] == ["s", "s_tls", "s_tls_plaindata"]


def test_a_plain_only_run_adds_no_ratio() -> None:
    for suite in MODE_OPS:
        assert mode_ratios(*MODE_OPS[suite], ("plain",)) == {}
    # without plain there is nothing to set a mode against
    assert mode_ratios(*MODE_OPS["sidecar"], ("tls", "tls-plain-data")) == {}


def test_sidecar_mode_ratios_cover_put_remote_get_and_match_per_tls_mode() -> None:
    table = mode_ratios(*MODE_OPS["sidecar"], ALL)
    for tag, system in (("tls", "kvpool_sidecar_tls"), ("tls_plaindata", "kvpool_sidecar_tls_plaindata")):
        for op in ("put", "put_drained", "remote_get"):
            assert table[f"{tag}_{op}_vs_plain"][:3] == ("throughput", (system, op), ("kvpool_sidecar", op))
            assert table[f"{tag}_{op}_cpu_vs_plain"][:3] == ("cpu", (system, op), ("kvpool_sidecar", op))
        assert table[f"{tag}_match8192_vs_plain"][:3] == ("time", (system, "match"), ("kvpool_sidecar", "match"))
    assert len(table) == 2 * 7
    assert not set(table) & set(SIDECAR_RATIOS)  # the peer ratios keep their names and meaning


def test_store_mode_ratios_cover_put_get_and_exists() -> None:
    table = mode_ratios(*MODE_OPS["store"], ("plain", "tls"))
    assert set(table) == {"tls_put_vs_plain", "tls_put_cpu_vs_plain", "tls_get_vs_plain",
                          "tls_get_cpu_vs_plain", "tls_exists8192_vs_plain"}
    assert not set(table) & set(STORE_RATIOS)


def _row(system: str, op: str, gbps: float, cpu: float) -> Row:
    return Row(system, op, MiB, 16, gbps=gbps, p50_ms=16 / gbps, reps=5, cpu_s_per_gb=cpu)


def test_mode_ratios_divide_the_modes_rows_of_one_round() -> None:
    table = mode_ratios(*MODE_OPS["sidecar"], ALL)
    rows = [_row("kvpool_sidecar", "remote_get", 2.0, 0.5), _row("kvpool_sidecar_tls", "remote_get", 0.5, 2.0),
            _row("kvpool_sidecar_tls_plaindata", "remote_get", 2.2, 0.5),
            Row("kvpool_sidecar", "match", None, EXISTS_KEYS, p50_ms=4.0, reps=5),
            Row("kvpool_sidecar_tls", "match", None, EXISTS_KEYS, p50_ms=5.0, reps=5),
            Row("kvpool_sidecar_tls_plaindata", "match", None, EXISTS_KEYS, status="unavailable")]
    values, missing = ratio_values(rows, table)
    assert values["tls_remote_get_vs_plain"] == pytest.approx(0.25)
    assert values["tls_remote_get_cpu_vs_plain"] == pytest.approx(4.0)
    assert values["tls_plaindata_remote_get_vs_plain"] == pytest.approx(1.1)
    assert values["tls_match8192_vs_plain"] == pytest.approx(1.25)
    assert values["tls_plaindata_match8192_vs_plain"] is None
    assert missing["tls_plaindata_match8192_vs_plain"] == "kvpool_sidecar_tls_plaindata/match not measured"
    assert values["tls_put_vs_plain"] is None and "tls_put_vs_plain" in missing

