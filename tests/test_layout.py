"""Repository layout contracts: source roots are not packages; generated code is current."""

import pathlib
import subprocess
import sys

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
