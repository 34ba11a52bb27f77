"""The one module that talks to the Kubernetes API (STYLE 3).

Plain dicts in and out (the same shapes the builders produce and the API server serves), through
the ``kubernetes`` client's REST layer: server-side apply for children (so drift is repaired by
re-applying, and fields other managers own are left alone), merge patches for status, create-only
for objects that must never be regenerated (Secrets holding tokens). A 409 on create means "it
exists", a 404 on get means None; anything else is a :class:`KubeError` the handlers retry.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode

from .model import API_VERSION
from .units import format_time

FIELD_MANAGER = "kvpool-operator"

# (apiVersion, kind) → (plural, namespaced)
RESOURCES: dict[tuple[str, str], tuple[str, bool]] = {
    ("v1", "ConfigMap"): ("configmaps", True),
    ("v1", "Secret"): ("secrets", True),
    ("v1", "Service"): ("services", True),
    ("v1", "ServiceAccount"): ("serviceaccounts", True),
    ("v1", "Pod"): ("pods", True),
    ("v1", "Event"): ("events", True),
    ("v1", "Namespace"): ("namespaces", False),
    ("apps/v1", "StatefulSet"): ("statefulsets", True),
    ("apps/v1", "Deployment"): ("deployments", True),
    ("policy/v1", "PodDisruptionBudget"): ("poddisruptionbudgets", True),
    ("networking.k8s.io/v1", "NetworkPolicy"): ("networkpolicies", True),
    (API_VERSION, "KVPool"): ("kvpools", True),
    (API_VERSION, "KVTier"): ("kvtiers", False),
    (API_VERSION, "TenantNamespace"): ("tenantnamespaces", False),
    ("kopf.dev/v1", "ClusterKopfPeering"): ("clusterkopfpeerings", False),
    ("kopf.dev/v1", "KopfPeering"): ("kopfpeerings", True),
    ("apiextensions.k8s.io/v1", "CustomResourceDefinition"): ("customresourcedefinitions", False),
}


class KubeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message

    @property
    def conflict(self) -> bool:
        return self.status == 409


def path(api_version: str, kind: str, namespace: str | None = None, name: str | None = None,
         subresource: str | None = None) -> str:
    try:
        plural, namespaced = RESOURCES[(api_version, kind)]
    except KeyError:
        raise ValueError(f"kvpool_operator.kube does not know {api_version} {kind}") from None
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    if namespaced and namespace:
        base += f"/namespaces/{namespace}"
    p = f"{base}/{plural}"
    if name:
        p += f"/{name}"
    if subresource:
        p += f"/{subresource}"
    return p


class Kube:
    """A thin, thread-safe wrapper of one ``kubernetes.client.ApiClient``."""

    def __init__(self, api_client: Any) -> None:
        self.api = api_client

    @staticmethod
    def from_environment() -> Kube:
        from kubernetes import client, config

        try:
            config.load_incluster_config()  # type: ignore[no-untyped-call]
        except config.ConfigException:
            config.load_kube_config()  # type: ignore[no-untyped-call]
        return Kube(client.ApiClient())

    # -- plumbing ---------------------------------------------------------------------------

    def request(self, method: str, url: str, body: Any = None, query: Mapping[str, str] | None = None,
                content_type: str = "application/json", timeout: float = 30.0) -> Any:
        from kubernetes.client.exceptions import ApiException

        if query:
            url = f"{url}?{urlencode(query)}"
        headers = {"Accept": "application/json", "Content-Type": content_type}
        m, full, hdrs, payload, _ = self.api.param_serialize(method, url, header_params=headers, body=body,
                                                             auth_settings=["BearerToken"])
        try:
            resp = self.api.call_api(m, full, header_params=hdrs, body=payload, _request_timeout=timeout)
            data = resp.read()
            status = resp.status
        except ApiException as exc:
            status, data = int(exc.status or 0), exc.body or b""
        text = data.decode() if isinstance(data, bytes) else (data or "")
        if status >= 400:
            try:
                message = json.loads(text).get("message", text)
            except ValueError:
                message = text
            raise KubeError(status, message)
        return json.loads(text) if text else {}

    # -- objects ----------------------------------------------------------------------------

    def get(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        try:
            got: dict[str, Any] = self.request("GET", path(api_version, kind, namespace, name))
            return got
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, api_version: str, kind: str, namespace: str | None = None,
             selector: str | None = None) -> list[dict[str, Any]]:
        q = {"labelSelector": selector} if selector else None
        doc = self.request("GET", path(api_version, kind, namespace), query=q)
        items: list[dict[str, Any]] = doc.get("items") or []
        return items

    def apply(self, obj: Mapping[str, Any], force: bool = True) -> dict[str, Any]:
        """Server-side apply as the operator's field manager."""
        meta = obj["metadata"]
        q = {"fieldManager": FIELD_MANAGER, "force": "true" if force else "false"}
        got: dict[str, Any] = self.request(
            "PATCH", path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"]), body=dict(obj),
            query=q, content_type="application/apply-patch+yaml")
        return got

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any] | None:
        """Create; None when it already exists (left untouched)."""
        meta = obj["metadata"]
        try:
            got: dict[str, Any] = self.request("POST", path(obj["apiVersion"], obj["kind"], meta.get("namespace")),
                                               body=dict(obj))
            return got
        except KubeError as exc:
            if exc.conflict:
                return None
            raise

    def merge_patch(self, api_version: str, kind: str, name: str, namespace: str | None, patch: Mapping[str, Any],
                    subresource: str | None = None) -> dict[str, Any] | None:
        try:
            got: dict[str, Any] = self.request("PATCH", path(api_version, kind, namespace, name, subresource),
                                               body=dict(patch), content_type="application/merge-patch+json")
            return got
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> bool:
        try:
            self.request("DELETE", path(api_version, kind, namespace, name))
            return True
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise

    def event(self, obj: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        """A core/v1 Event about ``obj`` (in its namespace, or ``default`` for cluster objects)."""
        meta = obj.get("metadata") or {}
        ns = meta.get("namespace") or "default"
        now = format_time(int(time.time() * 1000))
        ev = {"apiVersion": "v1", "kind": "Event",
              "metadata": {"generateName": f"{meta.get('name', 'kvpool')}.", "namespace": ns},
              "involvedObject": {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"),
                                 "name": meta.get("name"), "namespace": meta.get("namespace") or "",
                                 "uid": meta.get("uid")},
              "type": type_, "reason": reason, "message": message[:1024], "count": 1,
              "firstTimestamp": now, "lastTimestamp": now, "source": {"component": FIELD_MANAGER},
              "reportingComponent": FIELD_MANAGER, "reportingInstance": FIELD_MANAGER}
        self.request("POST", path("v1", "Event", ns), body=ev)


_default: Kube | None = None
_default_lock = threading.Lock()


def default() -> Kube:
    """The process's Kube (configured from the environment on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Kube.from_environment()
        return _default


def set_default(k: Kube | None) -> None:
    global _default
    with _default_lock:
        _default = k
