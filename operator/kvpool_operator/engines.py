"""Engine wiring at injection (issue 7 §4). Pure: (pod annotations, containers) → what to add.

A pod opts in with ``kvpool.io/engine: vllm|sglang|lmcache`` on top of the pool label.  Then:

- unless ``kvpool.io/engine-client: image`` says the engine's image ships kvpool, an init container
  of the kvpool image copies the client package into an ``emptyDir`` mounted at
  :data:`CLIENT_DIR` in the engine container, whose ``PYTHONPATH`` gets that directory.  The copy
  (``python3 -m kvpool._deps install``) brings the client's grpcio, protobuf and xxhash too, used
  only where the engine image lacks them and its Python is the kvpool image's (they are compiled
  for one CPython; otherwise the import says so and how to fix it); numpy and torch are never
  copied: the engine's own must be the ones loaded;
- for vLLM, the engine container's args get ``--kv-transfer-config`` naming
  :class:`kvpool.integrations.vllm.KVPoolConnector`, only when the user has not set one.

The engine container is the one named by ``kvpool.io/engine-container``, else the first.  Every
step not taken (the user's own ``--kv-transfer-config``, a ``PYTHONPATH`` the user set, a shell
command line kvpool cannot safely extend) is recorded in ``kvpool.io/engine-injection``; nothing the
user set is overwritten.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .podsecurity import container_security_context

ENGINE_ANNOTATION = "kvpool.io/engine"
ENGINE_CONTAINER_ANNOTATION = "kvpool.io/engine-container"
ENGINE_CLIENT_ANNOTATION = "kvpool.io/engine-client"
ENGINE_NOTE_ANNOTATION = "kvpool.io/engine-injection"
ENGINES = ("vllm", "sglang", "lmcache")
CLIENT_VOLUME = "kvpool-client"
CLIENT_DIR = "/opt/kvpool/python"
COPY_CONTAINER = "kvpool-client-copy"
KV_TRANSFER_FLAG = "--kv-transfer-config"
SHELLS = ("sh", "bash", "dash", "/bin/sh", "/bin/bash", "/usr/bin/bash", "/usr/bin/env")
# Copy the installed package (whatever the image's layout) and, beside it in kvpool-deps, the client's
# grpcio/protobuf/xxhash: kvpool appends that directory to sys.path only for what the engine lacks, so
# the engine's own site-packages keep precedence for every module (kvpool/_deps.py).
COPY_COMMAND = ["python3", "-m", "kvpool._deps", "install", CLIENT_DIR]


@dataclass(frozen=True)
class EnginePlan:
    engine: str
    container: str
    """Name of the engine container."""
    copy_client: bool
    """Add the init container that copies the client package, and its volume."""
    set_pythonpath: bool
    args: tuple[str, ...] = ()
    """Appended to the engine container's args."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    """What was done and what was skipped (and why), for ENGINE_NOTE_ANNOTATION."""

    def note(self) -> str:
        return "; ".join(self.notes)


class EngineAnnotationError(ValueError):
    """The engine annotations cannot be honoured (the reason is the message)."""


def vllm_kv_transfer_config(address: str) -> str:
    return json.dumps({"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool.integrations.vllm",
                       "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": {"address": address}}, separators=(",", ":"))


def _sets_flag(words: Sequence[str], flag: str) -> bool:
    return any(w == flag or w.startswith(flag + "=") for w in words)


def plan_engine(annotations: Mapping[str, str], containers: Sequence[Mapping[str, Any]],
                address: str) -> EnginePlan | None:
    """None when the pod does not opt in; raises :class:`EngineAnnotationError` on a bad annotation."""
    raw = annotations.get(ENGINE_ANNOTATION)
    if raw is None:
        return None
    engine = str(raw).strip().lower()
    if engine not in ENGINES:
        raise EngineAnnotationError(f"annotation {ENGINE_ANNOTATION}={raw!r}: must be one of {', '.join(ENGINES)}")
    client = str(annotations.get(ENGINE_CLIENT_ANNOTATION, "copy")).strip().lower()
    if client not in ("copy", "image"):
        raise EngineAnnotationError(f"annotation {ENGINE_CLIENT_ANNOTATION}={client!r}: must be copy or image")
    if not containers:
        raise EngineAnnotationError("the pod has no containers")
    want = annotations.get(ENGINE_CONTAINER_ANNOTATION)
    if want is not None:
        target = next((c for c in containers if c.get("name") == want), None)
        if target is None:
            raise EngineAnnotationError(f"annotation {ENGINE_CONTAINER_ANNOTATION}={want!r}: no such container "
                                        f"(containers: {', '.join(str(c.get('name')) for c in containers)})")
    else:
        target = containers[0]
    name = str(target.get("name"))
    notes = [f"{engine} in container {name}"]
    copy = client == "copy"
    set_path = False
    if copy:
        if any(e.get("name") == "PYTHONPATH" for e in target.get("env") or []):
            notes.append(f"client copied to {CLIENT_DIR}; PYTHONPATH is set by the pod, so add {CLIENT_DIR} to it")
        else:
            set_path = True
            notes.append(f"client copied to {CLIENT_DIR} (PYTHONPATH)")
    else:
        notes.append("client from the image")
    args: tuple[str, ...] = ()
    if engine == "vllm":
        command = [str(w) for w in target.get("command") or []]
        user_args = [str(w) for w in target.get("args") or []]
        if _sets_flag(command + user_args, KV_TRANSFER_FLAG):
            notes.append(f"{KV_TRANSFER_FLAG} kept as the pod sets it (skipped)")
        elif command and command[0] in SHELLS:
            notes.append(f"{KV_TRANSFER_FLAG} not added: the container runs a shell command line (skipped; add "
                         f"{KV_TRANSFER_FLAG} '{vllm_kv_transfer_config(address)}' to it)")
        else:
            args = (KV_TRANSFER_FLAG, vllm_kv_transfer_config(address))
            notes.append(f"{KV_TRANSFER_FLAG} added")
    return EnginePlan(engine, name, copy, set_path, args, tuple(notes))


def copy_container(image: str, pull_policy: str) -> dict[str, Any]:
    return {"name": COPY_CONTAINER, "image": image, "imagePullPolicy": pull_policy,
            "command": list(COPY_COMMAND), "securityContext": container_security_context(),
            "volumeMounts": [{"name": CLIENT_VOLUME, "mountPath": CLIENT_DIR}]}


def apply_to_container(plan: EnginePlan, container: dict[str, Any]) -> dict[str, Any]:
    """The engine container with the plan's mount, PYTHONPATH and args (a new dict)."""
    c = dict(container)
    if c.get("name") != plan.container:
        return c
    if plan.copy_client:
        mounts = list(c.get("volumeMounts") or [])
        if not any(m.get("name") == CLIENT_VOLUME or m.get("mountPath") == CLIENT_DIR for m in mounts):
            mounts.append({"name": CLIENT_VOLUME, "mountPath": CLIENT_DIR, "readOnly": True})
        c["volumeMounts"] = mounts
        if plan.set_pythonpath:
            c["env"] = [*(c.get("env") or []), {"name": "PYTHONPATH", "value": CLIENT_DIR}]
    if plan.args:
        c["args"] = [*(c.get("args") or []), *plan.args]
    return c
