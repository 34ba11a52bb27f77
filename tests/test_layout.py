"""Repository layout contracts: source roots are not packages; generated code is current; the code type-checks."""

import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_source_roots_are_not_packages() -> None:
    for root in ("operator", "sidecar"):
        assert not (ROOT / root / "__init__.py").exists(), f"{root}/__init__.py would make {root} a package"


def test_no_test_folder_named_operator() -> None:
    assert not (ROOT / "tests" / "operator").exists()


def test_generated_grpc_code_is_up_to_date() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "genproto.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_ci_entry_point_runs_the_suite_under_plain_sh() -> None:
    """`sh .ci/run` (dash here) must reach pytest: a bashism before the hand-over to
    tools/test.sh would end it with exit 2 before any test ran.  Collection of one file only,
    engine venvs skipped, so this stays quick."""
    import os
    import shutil
    sh = shutil.which("dash") or shutil.which("sh")
    assert sh is not None
    r = subprocess.run([sh, str(ROOT / ".ci" / "run"), "--collect-only", "-q", "tests/test_layout.py"],
                       capture_output=True, text=True, cwd=ROOT, timeout=240,
                       env={**os.environ, "KVPOOL_SKIP_ENGINES": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "test_layout.py::test_source_roots_are_not_packages" in r.stdout


def test_packages_type_check_clean_under_mypy_strict() -> None:
    """`mypy -p kvpool -p kvpool_operator` (strict, [tool.mypy] of pyproject.toml) reports no error;
    a failure shows mypy's report.  The cache is the checkout's .mypy_cache (git-ignored): a rerun
    checks only what changed, seconds instead of the half minute of a cold run."""
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed here (it comes with the dev extra: pip install -e '.[dev]')")
    r = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(ROOT / ".mypy_cache"),
                        "-p", "kvpool", "-p", "kvpool_operator"],
                       capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]


def test_benchmarks_and_end_to_end_harness_type_check_clean() -> None:
    """`mypy e2e bench` under the same configuration: the code outside the packages that CI
    runs (the e2e tests) or that the closing notes quote (the benchmarks) stays typed too."""
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed here (it comes with the dev extra: pip install -e '.[dev]')")
    r = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(ROOT / ".mypy_cache"), "e2e", "bench"],
                       capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
