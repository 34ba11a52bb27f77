"""The chart's PodMonitors as a Prometheus without prometheus-operator and without Kubernetes
discovery runs them: Debian's Prometheus 2.42 is built without ``kubernetes_sd_configs``
(``e2e.prom``), so pods reach it through ``file_sd_configs`` written by :class:`PodDiscovery`.

Pure translations, each of one upstream function, so the scrape is the one a cluster with
prometheus-operator would run and a wrong selector, port name or relabelling in the chart's
monitors leaves its targets unscraped:

* :func:`pod_monitor_scrape_configs` -- prometheus-operator's ``generatePodMonitorConfig``
  (pkg/prometheus/promcfg.go): a scrape config per ``podMetricsEndpoints`` item with the pods that
  are not Failed/Succeeded, the monitor's label selector as keep/drop rules on the pod's labels,
  the endpoint's port kept by name, labels ``namespace``, ``container``, ``pod``, ``job``
  (``<namespace>/<monitor>``) and ``endpoint`` (the port's name), then the monitor's own
  relabelings. Its ``namespaceSelector`` (``kubernetes_sd_configs.namespaces``, a restriction of
  the watch) becomes a keep rule on the namespace.
* :func:`relabel` -- Prometheus's relabelling of one target by those configs (model/relabel), for
  the pure tests that check which pods a monitor keeps and the labels their series get.
* :func:`pod_target_groups` -- Prometheus's pod role (discovery/kubernetes/pod.go): a target per
  declared container port, init containers included (``__meta_kubernetes_pod_container_init``:
  a native sidecar such as kvpool's declares its metrics port there), with the pod's meta labels;
  a pod without an IP yet has none.

:class:`PodDiscovery` is the I/O edge: it lists pods from the API server through the harness's
client (:class:`kvpool_operator.kube.Kube`, the admin's client certificate) and rewrites the
file_sd file when they change.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from urllib3.exceptions import HTTPError

from kvpool_operator.kube import Kube, KubeError

META = "__meta_kubernetes_"
_SNAKE = {"sourceLabels": "source_labels", "targetLabel": "target_label", "regex": "regex",
          "replacement": "replacement", "separator": "separator", "modulus": "modulus", "action": "action"}
_ENDPOINT_FIELDS = {"port": None, "path": "metrics_path", "interval": "scrape_interval",
                    "scrapeTimeout": "scrape_timeout", "scheme": "scheme", "honorLabels": "honor_labels",
                    "relabelings": None, "metricRelabelings": None}
"""The podMetricsEndpoints fields translated (their scrape-config key; None: handled apart). Any
other field (TLS, auth, params...) is refused, so a chart that starts using one fails here first."""


def sanitize(name: str) -> str:
    """A Kubernetes label or annotation name as a Prometheus label name suffix."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def relabel_configs(relabelings: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A monitor's ``relabelings`` (camelCase, action in any case) as Prometheus relabel configs."""
    out = []
    for r in relabelings:
        unknown = set(r) - set(_SNAKE)
        if unknown:
            raise ValueError(f"relabeling fields not translated: {sorted(unknown)}")
        cfg = {_SNAKE[k]: (v.lower() if k == "action" else v) for k, v in r.items()}
        out.append(cfg)
    return out


def selector_rules(selector: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A pod label selector as keep/drop rules on the pod's meta labels (the operator's order:
    matchLabels sorted by key, then matchExpressions as written)."""
    rules: list[dict[str, Any]] = []
    for key, value in sorted((selector.get("matchLabels") or {}).items()):
        k = sanitize(key)
        rules.append({"action": "keep", "source_labels": [f"{META}pod_label_{k}", f"{META}pod_labelpresent_{k}"],
                      "regex": f"({value});true"})
    for exp in selector.get("matchExpressions") or []:
        k, op = sanitize(exp["key"]), exp["operator"]
        if op in ("In", "NotIn"):
            rules.append({"action": "keep" if op == "In" else "drop",
                          "source_labels": [f"{META}pod_label_{k}", f"{META}pod_labelpresent_{k}"],
                          "regex": f"({'|'.join(exp['values'])});true"})
        elif op in ("Exists", "DoesNotExist"):
            rules.append({"action": "keep" if op == "Exists" else "drop",
                          "source_labels": [f"{META}pod_labelpresent_{k}"], "regex": "true"})
        else:
            raise ValueError(f"label selector operator {op!r}")
    return rules


def namespace_rules(namespace_selector: Mapping[str, Any], own_namespace: str) -> list[dict[str, Any]]:
    """The monitor's ``namespaceSelector``: ``any`` (every namespace), ``matchNames``, or by
    default the monitor's own namespace."""
    if namespace_selector.get("any"):
        return []
    names = namespace_selector.get("matchNames") or [own_namespace]
    return [{"action": "keep", "source_labels": [f"{META}namespace"],
             "regex": "|".join(re.escape(n) for n in names)}]


def pod_monitor_scrape_configs(monitor: Mapping[str, Any], sd_file: Path) -> list[dict[str, Any]]:
    """The scrape configs prometheus-operator generates for ``monitor`` (a PodMonitor as the API
    returns it), targets from the file_sd file ``sd_file`` (see the module docstring)."""
    assert monitor["kind"] == "PodMonitor", monitor["kind"]
    meta, spec = monitor["metadata"], monitor["spec"]
    ns, name = meta["namespace"], meta["name"]
    out = []
    for i, ep in enumerate(spec["podMetricsEndpoints"]):
        unknown = set(ep) - set(_ENDPOINT_FIELDS)
        if unknown:
            raise ValueError(f"{name}: podMetricsEndpoints fields not translated: {sorted(unknown)}")
        cfg: dict[str, Any] = {"job_name": f"podMonitor/{ns}/{name}/{i}", "honor_labels": False}
        cfg.update({key: ep[field] for field, key in _ENDPOINT_FIELDS.items() if key and field in ep})
        cfg["file_sd_configs"] = [{"files": [str(sd_file)], "refresh_interval": "1s"}]
        rules: list[dict[str, Any]] = [
            {"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"},
            *namespace_rules(spec.get("namespaceSelector") or {}, ns),
            {"action": "drop", "source_labels": [f"{META}pod_phase"], "regex": "(Failed|Succeeded)"},
            *selector_rules(spec.get("selector") or {}),
        ]
        if "port" in ep:
            rules.append({"action": "keep", "source_labels": [f"{META}pod_container_port_name"],
                          "regex": ep["port"]})
        rules += [{"source_labels": [f"{META}namespace"], "target_label": "namespace"},
                  {"source_labels": [f"{META}pod_container_name"], "target_label": "container"},
                  {"source_labels": [f"{META}pod_name"], "target_label": "pod"},
                  {"target_label": "job", "replacement": f"{ns}/{name}"}]
        if "port" in ep:
            rules.append({"target_label": "endpoint", "replacement": ep["port"]})
        rules += relabel_configs(ep.get("relabelings") or [])
        cfg["relabel_configs"] = rules
        cfg["metric_relabel_configs"] = relabel_configs(ep.get("metricRelabelings") or [])
        out.append(cfg)
    return out


def relabel(labels: Mapping[str, str], configs: list[Mapping[str, Any]]) -> dict[str, str] | None:
    """``labels`` after Prometheus's relabelling by ``configs`` (the ``replace``, ``keep`` and
    ``drop`` actions this module writes; model/relabel's semantics: source values joined by
    ``;``, the regex anchored, ``$1`` expanded, an empty result deletes the target label); None
    when a rule drops the target.  For the pure tests: the live ones run Prometheus itself."""
    out = dict(labels)
    for cfg in configs:
        action = cfg.get("action", "replace")
        value = cfg.get("separator", ";").join(out.get(k, "") for k in cfg.get("source_labels") or [])
        m = re.fullmatch(cfg.get("regex", "(.*)"), value)
        if action in ("keep", "drop"):
            if (m is None) == (action == "keep"):
                return None
            continue
        if action != "replace":
            raise ValueError(f"relabel action {action!r} is not evaluated here")
        if m is None:
            continue
        result = m.expand(re.sub(r"\$\{?(\d+)\}?", r"\\g<\1>", cfg.get("replacement", "$1")))
        if result:
            out[cfg["target_label"]] = result
        else:
            out.pop(cfg["target_label"], None)
    return out


def _pod_labels(pod: Mapping[str, Any]) -> dict[str, str]:
    meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
    ready = next((c["status"].lower() for c in status.get("conditions") or [] if c["type"] == "Ready"), "unknown")
    labels = {f"{META}namespace": meta["namespace"], f"{META}pod_name": meta["name"],
              f"{META}pod_ip": status.get("podIP", ""), f"{META}pod_ready": ready,
              f"{META}pod_phase": status.get("phase", ""), f"{META}pod_node_name": spec.get("nodeName", ""),
              f"{META}pod_host_ip": status.get("hostIP", ""), f"{META}pod_uid": meta.get("uid", "")}
    owner = next((r for r in meta.get("ownerReferences") or [] if r.get("controller")), None)
    if owner is not None:
        labels[f"{META}pod_controller_kind"] = owner["kind"]
        labels[f"{META}pod_controller_name"] = owner["name"]
    for prefix, items in (("label", meta.get("labels")), ("annotation", meta.get("annotations"))):
        for k, v in (items or {}).items():
            labels[f"{META}pod_{prefix}_{sanitize(k)}"] = v
            labels[f"{META}pod_{prefix}present_{sanitize(k)}"] = "true"
    return labels


def pod_target_groups(pods: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """file_sd target groups of Prometheus's pod role for ``pods`` (the API's JSON): one group per
    container port (per container without ports: the bare pod IP), pod labels and port labels
    together (file_sd has no per-target labels)."""
    groups = []
    for pod in pods:
        ip = (pod.get("status") or {}).get("podIP")
        if not ip:
            continue
        base = _pod_labels(pod)
        spec = pod.get("spec") or {}
        containers = [(c, False) for c in spec.get("containers") or []]
        containers += [(c, True) for c in spec.get("initContainers") or []]
        for c, init in containers:
            common = {**base, f"{META}pod_container_name": c["name"], f"{META}pod_container_init": str(init).lower()}
            if not c.get("ports"):
                groups.append({"targets": [ip], "labels": common})
                continue
            for port in c["ports"]:
                number = str(port["containerPort"])
                groups.append({"targets": [f"{ip}:{number}"], "labels": {
                    **common, f"{META}pod_container_port_name": port.get("name", ""),
                    f"{META}pod_container_port_number": number,
                    f"{META}pod_container_port_protocol": port.get("protocol", "TCP")}})
    return groups


class PodDiscovery:
    """Lists pods through ``kube`` every ``interval`` seconds (all, or those of ``namespaces``),
    and keeps ``path`` holding their :func:`pod_target_groups` (written to a temporary file and
    renamed, as file_sd expects)."""

    def __init__(self, kube: Kube, path: Path, namespaces: Sequence[str] = (), interval: float = 1.0) -> None:
        self.kube = kube
        self.namespaces: list[str | None] = [*namespaces] or [None]
        self.path, self.interval = path, interval
        self.errors: list[str] = []
        self._last = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pod-discovery", daemon=True)

    def refresh(self) -> None:
        """List the pods once; rewrite the file when their target groups changed."""
        pods = [p for ns in self.namespaces for p in self.kube.list("v1", "Pod", ns)]
        text = json.dumps(pod_target_groups(pods), sort_keys=True)
        if text != self._last:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(text)
            os.replace(tmp, self.path)
            self._last = text

    def start(self) -> PodDiscovery:
        self.refresh()  # the file exists before Prometheus reads its config
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.refresh()
            except (OSError, HTTPError, KubeError) as exc:  # the API server busy: the next round tries again
                self.errors.append(str(exc))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
