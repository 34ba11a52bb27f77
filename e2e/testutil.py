"""Small helpers shared by the harness tests: waiting, reading pods as dicts, pod programs."""

from __future__ import annotations

import json
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kubernetes import client
from kubernetes.client.exceptions import ApiException

T = TypeVar("T")

PYTHON = sys.executable  # containers run host programs; this interpreter is sure to exist


def wait_for(check: Callable[[], T | None], timeout: float, what: str,
             interval: float = 0.1) -> T:
    """Poll until ``check`` returns a truthy value and return it."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def get_pod(api: client.ApiClient, ns: str, name: str) -> dict[str, Any] | None:
    """The pod as the API's JSON (camelCase) dict, or None once it is gone."""
    try:
        resp = core_api(api).read_namespaced_pod(name, ns, _preload_content=False)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return dict(json.loads(resp.data))


def list_pods(api: client.ApiClient, ns: str, selector: str = "") -> list[dict[str, Any]]:
    resp = core_api(api).list_namespaced_pod(ns, label_selector=selector,
                                                     _preload_content=False)
    return list(json.loads(resp.data)["items"])


def condition(pod: dict[str, Any], ctype: str) -> bool:
    conds = pod.get("status", {}).get("conditions") or []
    return any(c["type"] == ctype and c["status"] == "True" for c in conds)


def is_ready(pod: dict[str, Any] | None) -> bool:
    return pod is not None and condition(pod, "Ready")


def python_cmd(source: str) -> list[str]:
    """A container command running ``source`` with this machine's interpreter."""
    return [PYTHON, "-u", "-c", textwrap.dedent(source)]


def core_api(api: client.ApiClient) -> Any:
    """CoreV1Api typed as Any: tests pass plain dict manifests, which the client accepts but
    its annotations (model classes only) do not describe."""
    return client.CoreV1Api(api)


def apps(api: client.ApiClient) -> Any:
    return client.AppsV1Api(api)


def wait_pod(api: client.ApiClient, ns: str, name: str, pred: Callable[[dict[str, Any]], bool],
             timeout: float, what: str) -> dict[str, Any]:
    """Wait until the pod exists and ``pred`` holds for it; return the pod."""

    def check() -> dict[str, Any] | None:
        pod = get_pod(api, ns, name)
        return pod if pod is not None and pred(pod) else None

    return wait_for(check, timeout, what)


def finished(pod: dict[str, Any]) -> bool:
    return pod.get("status", {}).get("phase") in ("Succeeded", "Failed")


def pool_client_tls(kube: Any, namespace: str, pool: str, directory: str, timeout: float = 60,
                    secret: str | None = None) -> Any:
    """A client TLS configuration (:class:`kvpool.wire.tls.TlsConfig`) of a pool whose operator
    runs with TLS: by default the operator's certificate of it (``<pool>-operator-tls``: admin and
    data calls alike; ``secret`` names another, a tenant's say), written under ``directory`` as a
    mounted Secret looks, checking the store nodes by their shared name. Read again after a
    rotation to get the new files (the written ones are replaced)."""
    import base64

    from kvpool.core import pki
    from kvpool.wire import tls

    name = secret or f"{pool}-operator-tls"
    sec = wait_for(lambda: kube.get("v1", "Secret", name, namespace), timeout, f"Secret {name}")
    data = {k: base64.b64decode(v) for k, v in (sec.get("data") or {}).items()}
    tls.write_dir(directory, pki.KeyPair(data[tls.CERT_NAME], data[tls.KEY_NAME]), data[tls.CA_NAME])
    return tls.TlsConfig.from_dir(directory, f"{pool}-store.{namespace}.svc")
