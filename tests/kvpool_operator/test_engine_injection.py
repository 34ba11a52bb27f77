"""kvpool.io/engine at injection: client copy, PYTHONPATH, vLLM's --kv-transfer-config, every skip recorded."""

import json
from typing import Any

import pytest

from kvpool_operator.engines import (
    CLIENT_DIR,
    COPY_CONTAINER,
    ENGINE_NOTE_ANNOTATION,
    plan_engine,
    vllm_kv_transfer_config,
)
from kvpool_operator.injection import SIDECAR_NAME, PoolView, plan_injection
from kvpool_operator.settings import Settings
from kvpool_operator.testing import apply_merge_patch

# Plaintext: engine wiring does not depend on TLS (test_injection covers what TLS adds).
S = Settings(tls=False)
POOLS = {("pools", "shared"): PoolView("pools", "shared", local_bytes=64 << 20, drain_seconds=20,
                                       default_tenant="public", seeds=("svc:7400",))}
ADDR = "unix:///run/kvpool/kvpool.sock"


def _pod(annotations: dict[str, str], engine: dict[str, Any] | None = None) -> dict[str, Any]:
    main = {"name": "engine", "image": "vllm/vllm-openai", "args": ["--model", "m"], **(engine or {})}
    return {"metadata": {"name": "e-1", "labels": {"kvpool.io/pool": "pools.shared"}, "annotations": annotations},
            "spec": {"containers": [main, {"name": "proxy", "image": "p"}]}}


def _apply(pod: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    r = plan_injection(pod, "app", POOLS, [], S)
    return r, apply_merge_patch(pod, r.patch)


def test_vllm_gets_the_connector_the_client_copy_and_pythonpath() -> None:
    r, pod = _apply(_pod({"kvpool.io/engine": "vllm"}))
    assert r.injected
    spec = pod["spec"]
    assert [c["name"] for c in spec["initContainers"]] == [SIDECAR_NAME, COPY_CONTAINER]
    copy = spec["initContainers"][1]
    assert copy["image"] == S.image and "restartPolicy" not in copy  # a plain init container: runs to completion
    assert copy["command"] == ["python3", "-m", "kvpool._deps", "install", CLIENT_DIR]
    assert {"name": "kvpool-client", "emptyDir": {}} in spec["volumes"]
    engine, proxy = spec["containers"]
    assert engine["args"][:2] == ["--model", "m"]
    assert engine["args"][2] == "--kv-transfer-config"
    cfg = json.loads(engine["args"][3])
    assert cfg == {"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool.integrations.vllm",
                   "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                   "kv_connector_extra_config": {"address": ADDR}}
    assert {"name": "PYTHONPATH", "value": CLIENT_DIR} in engine["env"]
    assert {"name": "kvpool-client", "mountPath": CLIENT_DIR, "readOnly": True} in engine["volumeMounts"]
    # Only the engine container: the other one gets the sidecar's address and socket as before, nothing more.
    assert "args" not in proxy and all(e["name"] != "PYTHONPATH" for e in proxy["env"])
    note = pod["metadata"]["annotations"][ENGINE_NOTE_ANNOTATION]
    assert "vllm in container engine" in note and "--kv-transfer-config added" in note


@pytest.mark.parametrize("engine", ["sglang", "lmcache"])
def test_sglang_and_lmcache_get_the_client_but_no_args(engine: str) -> None:
    _, pod = _apply(_pod({"kvpool.io/engine": engine}))
    c = pod["spec"]["containers"][0]
    assert c["args"] == ["--model", "m"]
    assert {"name": "PYTHONPATH", "value": CLIENT_DIR} in c["env"]
    assert [i["name"] for i in pod["spec"]["initContainers"]] == [SIDECAR_NAME, COPY_CONTAINER]


def test_the_users_kv_transfer_config_is_kept_and_the_skip_recorded() -> None:
    for args in (["--kv-transfer-config", "{\"kv_connector\": \"Mine\"}"], ["--kv-transfer-config={}"]):
        _, pod = _apply(_pod({"kvpool.io/engine": "vllm"}, {"args": list(args)}))
        assert pod["spec"]["containers"][0]["args"] == args
        assert "kept as the pod sets it (skipped)" in pod["metadata"]["annotations"][ENGINE_NOTE_ANNOTATION]


def test_a_shell_command_line_is_not_extended() -> None:
    _, pod = _apply(_pod({"kvpool.io/engine": "vllm"}, {"command": ["sh", "-c", "vllm serve m"], "args": []}))
    assert pod["spec"]["containers"][0]["args"] == []
    note = pod["metadata"]["annotations"][ENGINE_NOTE_ANNOTATION]
    assert "shell command line (skipped" in note and vllm_kv_transfer_config(ADDR) in note


def test_the_users_pythonpath_is_kept_and_the_skip_recorded() -> None:
    _, pod = _apply(_pod({"kvpool.io/engine": "sglang"}, {"env": [{"name": "PYTHONPATH", "value": "/app"}]}))
    env = pod["spec"]["containers"][0]["env"]
    assert [e for e in env if e["name"] == "PYTHONPATH"] == [{"name": "PYTHONPATH", "value": "/app"}]
    assert f"add {CLIENT_DIR} to it" in pod["metadata"]["annotations"][ENGINE_NOTE_ANNOTATION]


def test_image_with_kvpool_needs_no_copy_and_a_named_container() -> None:
    ann = {"kvpool.io/engine": "vllm", "kvpool.io/engine-client": "image", "kvpool.io/engine-container": "proxy"}
    _, pod = _apply(_pod(ann))
    spec = pod["spec"]
    assert [i["name"] for i in spec["initContainers"]] == [SIDECAR_NAME]
    assert all(v["name"] != "kvpool-client" for v in spec["volumes"])
    engine, proxy = spec["containers"]
    assert engine["args"] == ["--model", "m"]
    assert proxy["args"][0] == "--kv-transfer-config" and all(e["name"] != "PYTHONPATH" for e in proxy["env"])


@pytest.mark.parametrize(("annotations", "needle"), [
    ({"kvpool.io/engine": "trtllm"}, "must be one of vllm, sglang, lmcache"),
    ({"kvpool.io/engine": "vllm", "kvpool.io/engine-client": "pip"}, "must be copy or image"),
    ({"kvpool.io/engine": "vllm", "kvpool.io/engine-container": "nope"}, "no such container"),
])
def test_a_bad_engine_annotation_skips_with_the_reason(annotations: dict[str, str], needle: str) -> None:
    r = plan_injection(_pod(annotations), "app", POOLS, [], S)
    assert not r.injected and r.reason == "InvalidEngineAnnotation"
    assert needle in r.patch["metadata"]["annotations"]["kvpool.io/skip-reason"]


def test_no_annotation_no_engine_wiring() -> None:
    assert plan_engine({}, [{"name": "x"}], ADDR) is None
    _, pod = _apply(_pod({}))
    assert [i["name"] for i in pod["spec"]["initContainers"]] == [SIDECAR_NAME]
    assert ENGINE_NOTE_ANNOTATION not in pod["metadata"]["annotations"]
    assert pod["spec"]["containers"][0]["args"] == ["--model", "m"]


def test_engine_injection_is_idempotent() -> None:
    _, once = _apply(_pod({"kvpool.io/engine": "vllm"}))
    r = plan_injection(once, "app", POOLS, [], S)
    assert r.reason == "AlreadyInjected"
    assert apply_merge_patch(once, r.patch)["spec"] == once["spec"]
