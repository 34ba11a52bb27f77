"""Engine tests run inside their engine's venv (tools/engines.sh); elsewhere they are not collected.

tests/integrations/test_engine_venvs.py, which runs in the main environment, runs each of them in
its venv and fails when they fail.
"""

import importlib.util

collect_ignore = [f"test_{engine}.py" for engine in ("vllm", "lmcache", "sglang")
                  if importlib.util.find_spec(engine) is None]
