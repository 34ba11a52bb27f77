"""The client's grpcio/protobuf/xxhash for an engine image that lacks them (kvpool/_deps.py): the
injection's copy brings them beside the package, ``import kvpool`` uses them only where the engine has
none, and an engine of another Python gets the reason and the fix, not an ImportError from grpc.

Real interpreters: the "engine" is ``python -S`` (no site-packages) given only numpy, the copied
client and nothing else.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy
import pytest

from kvpool import _deps

PROBE = ("import sys, kvpool, grpc, xxhash; from google.protobuf import descriptor_pb2; "
         "print(grpc.__file__); print(xxhash.__file__); print(sys.path[-1])")


def test_abi_mismatch_names_what_differs() -> None:
    here = {"cache_tag": "cpython-311", "platform": "linux-x86_64"}
    assert _deps.abi_mismatch(here, dict(here)) is None
    assert "cache_tag 'cpython-311' (kvpool image) != 'cpython-312' (engine)" in str(
        _deps.abi_mismatch(here, {**here, "cache_tag": "cpython-312"}))
    assert "platform" in str(_deps.abi_mismatch(here, {**here, "platform": "linux-aarch64"}))


@pytest.fixture(scope="module")
def volume(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the init container leaves in the shared volume."""
    d = tmp_path_factory.mktemp("kvpool-client")
    r = subprocess.run([sys.executable, "-m", "kvpool._deps", "install", str(d)], capture_output=True, text=True,
                       check=False)
    assert r.returncode == 0, r.stderr
    assert "grpc, google.protobuf, xxhash, typing_extensions copied" in r.stdout
    assert (d / "kvpool" / "__init__.py").is_file() and (d / _deps.DEPS_DIR / _deps.ABI_FILE).is_file()
    assert not (d / _deps.DEPS_DIR / "numpy").exists()  # the engine's numpy is the one to load
    return d


def bare_engine(tmp: Path, volume: Path, code: str) -> subprocess.CompletedProcess[str]:
    """An interpreter without site-packages that has numpy (as every engine image) and the volume."""
    np_only = tmp / "numpy-only"
    np_only.mkdir(exist_ok=True)
    site = Path(numpy.__file__).parent.parent
    for name in ("numpy", "numpy.libs"):
        if (site / name).exists() and not (np_only / name).exists():
            os.symlink(site / name, np_only / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONPATH"] = f"{volume}:{np_only}"
    return subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, env=env, check=False)


def test_an_engine_without_the_dependencies_gets_the_copies(tmp_path: Path, volume: Path) -> None:
    r = bare_engine(tmp_path, volume, "import grpc")
    assert r.returncode != 0 and "No module named 'grpc'" in r.stderr  # the engine alone lacks it
    r = bare_engine(tmp_path, volume, PROBE)
    assert r.returncode == 0, r.stderr
    grpc_file, xxhash_file, last = r.stdout.split()
    deps = str(volume / _deps.DEPS_DIR)
    assert grpc_file.startswith(deps) and xxhash_file.startswith(deps)
    assert last == deps  # appended: anything the engine has comes first


def test_an_engine_that_has_them_keeps_its_own(volume: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(volume)
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, check=False)
    assert r.returncode == 0, r.stderr
    grpc_file, _, last = r.stdout.split()
    assert not grpc_file.startswith(str(volume)) and last != str(volume / _deps.DEPS_DIR)


def test_copies_of_another_python_are_refused_with_the_fix(tmp_path: Path, volume: Path) -> None:
    other = tmp_path / "other-python"
    subprocess.run(["cp", "-r", str(volume), str(other)], check=True)
    abi_file = other / _deps.DEPS_DIR / _deps.ABI_FILE
    abi_file.write_text(json.dumps({**_deps.abi(), "cache_tag": "cpython-399"}))
    r = bare_engine(tmp_path, other, "import kvpool")
    assert r.returncode != 0
    assert "needs grpc, google.protobuf, xxhash, typing_extensions, which this engine image lacks" in r.stderr
    assert "cache_tag 'cpython-399' (kvpool image)" in r.stderr
    assert "pip install grpcio protobuf xxhash typing-extensions" in r.stderr
    assert "kvpool.io/engine-client: image" in r.stderr
