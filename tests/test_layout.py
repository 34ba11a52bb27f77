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


@pytest.mark.parametrize("targets", [("-p", "kvpool", "-p", "kvpool_operator"), ("e2e", "bench")],
                         ids=["packages", "e2e-and-bench"])
def test_the_code_type_checks_clean_under_mypy_strict(targets: tuple[str, ...]) -> None:
    """`mypy -p kvpool -p kvpool_operator`, and `mypy e2e bench` (the code outside the packages
    that CI runs or that the closing notes quote), strict per [tool.mypy] of pyproject.toml,
    report no error; a failure shows mypy's report.  The cache is the checkout's .mypy_cache
    (git-ignored): a rerun checks only what changed, seconds instead of the half minute of a
    cold run."""
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed here (it comes with the dev extra: pip install -e '.[dev]')")
    r = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(ROOT / ".mypy_cache"), *targets],
                       capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
