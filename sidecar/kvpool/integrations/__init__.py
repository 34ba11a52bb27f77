"""Engine integrations: kvpool behind the plugin interfaces of vLLM, SGLang and LMCache (issue 7).

Each module is loaded by its engine (``kvpool.integrations.vllm`` through ``kv_connector_module_path``,
``kvpool.integrations.sglang`` through HiCache's ``dynamic`` storage backend,
``kvpool.integrations.lmcache`` through LMCache's remote storage plugins) and imports the engine and
torch itself; ``import kvpool`` and this package import neither.  The shared pieces (the sidecar
address, the self-describing block framing) are in :mod:`kvpool.integrations.common`.
"""
