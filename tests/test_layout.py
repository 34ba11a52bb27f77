"""Repository layout contracts: source roots are not packages; generated code is current; the code type-checks."""

import ast
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


OPTIONAL_STUBS = {
    "mooncake/__init__.pyi": "",
    "mooncake/store.pyi": "class MooncakeDistributedStore:\n    def setup(self, *args: object) -> int: ...\n",
    "yaml/__init__.pyi": ("from typing import Any\ndef safe_load(stream: Any) -> Any: ...\n"
                          "def safe_load_all(stream: Any) -> Any: ...\n"
                          "def safe_dump(data: Any, **kw: Any) -> str: ...\n"),
}
"""Typed stand-ins for the optional packages (the Mooncake peer, PyYAML with its stubs), as a
machine that has them installed would present them."""


def test_the_type_check_does_not_depend_on_optional_packages(tmp_path: pathlib.Path) -> None:
    """The files that import optional packages check clean also where those packages are
    installed with types: a `type: ignore[import-untyped]` (right only where a package is
    missing or untyped) made the verdict depend on the machine (a fresh clone was red where
    Mooncake was never installed, green where it was).  This run is the "installed, typed" side;
    the test above is whatever this machine has."""
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed here (it comes with the dev extra: pip install -e '.[dev]')")
    import os
    stubs = tmp_path / "stubs"
    for rel, text in OPTIONAL_STUBS.items():
        (stubs / rel).parent.mkdir(parents=True, exist_ok=True)
        (stubs / rel).write_text(text)
    files = ["bench/peers/mooncake_peer.py", "tests/kvpool_chart/test_chart.py", "tests/kvpool_operator/test_crds.py",
             "e2e/test_operator_crds.py"]
    r = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(ROOT / ".mypy_cache" / "optional"), *files],
                       capture_output=True, text=True, cwd=ROOT, timeout=240,
                       env={**os.environ, "MYPYPATH": str(stubs)})
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]


MAX_CLASS_LINES = 400
COMPOSITIONS = {"sidecar/kvpool/store/node.py": 600, "sidecar/kvpool/sidecar/server.py": 600}


def test_no_class_over_400_lines_and_the_compositions_stay_small() -> None:
    """Issue 20's bound on the data plane's rooms: no class of kvpool or the operator is over 400
    lines, and the store node and the sidecar, the two compositions, stay at most 600 lines."""
    too_big = []
    for path in sorted([*(ROOT / "sidecar" / "kvpool").rglob("*.py"), *(ROOT / "operator").rglob("*.py")]):
        if "proto" in path.parts:
            continue  # generated code
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    too_big.append(f"{path.relative_to(ROOT)}: class {node.name} has {lines} lines")
    for rel, limit in COMPOSITIONS.items():
        lines = len((ROOT / rel).read_text().splitlines())
        if lines > limit:
            too_big.append(f"{rel}: {lines} lines (a composition of at most {limit})")
    assert not too_big, "\n".join(too_big)
