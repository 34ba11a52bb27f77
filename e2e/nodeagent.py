"""A small kubelet for tests: runs the pods of a real API server as local processes.

There is no container runtime here, so a pod's containers are the processes named by their
``command`` + ``args`` (images are ignored; the command must exist on this machine). What a
kubelet does and the kvpool operator relies on is reproduced:

* registers a Node and keeps its Lease (kube-node-lease) renewed, so the node lifecycle
  controller sees a healthy node;
* binds pending pods to itself (no scheduler runs in the harness);
* gives each pod its own IP in 127.0.0.0/8 (the whole /8 is routed to ``lo`` on Linux, so a
  process can bind it with no set-up), reported in ``status.podIP``;
* runs each container in its own mount + UTS namespace (``unshare -m -u``, needs root), where
  the pod's volumes (emptyDir incl. medium Memory, Secret, ConfigMap, projected incl. the
  service-account token, downwardAPI, PVC, hostPath) are bind-mounted at the container's mount
  paths, the hostname is the pod's, and ``/etc/hosts`` is the pod's own;
* environment from env/envFrom incl. ConfigMap/Secret keys and downward-API fields, with
  ``$(VAR)`` expansion in env, command and args;
* native sidecars (init containers with ``restartPolicy: Always``) start first, stay up and
  stop last; ordinary init containers run to completion in order;
* startup, readiness and liveness probes (exec, tcpSocket, httpGet), restart policies with a
  short back-off, preStop exec hooks, termination grace (SIGTERM, then SIGKILL);
* reports phase, conditions and container statuses, and deletes the pod object once its
  processes have ended after deletion was requested.

Run it as ``python -m e2e.nodeagent --kubeconfig ... --node-name ...`` (``e2e.cluster`` does).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import datetime as _dt
import http.client
import http.server
import json
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from e2e import procs
from kvpool.core.signals import stop_on_signals

log = logging.getLogger("nodeagent")

TICK = 0.1  # worker loop period: probes and exits are noticed within this
MAX_BACKOFF = 10.0  # a kubelet caps at 5 min; tests cannot wait that long
DEFAULT_GRACE = 30
POD_MARKER_ENV = "KVPOOL_E2E_POD_UID"
VOLUME_REFRESH = 5.0  # a kubelet syncs ConfigMap/Secret volumes about once a minute
# Absolute paths: Popen resolves a bare name with the *container's* PATH, which a pod may set.
UNSHARE = shutil.which("unshare") or "/usr/bin/unshare"
NSENTER = shutil.which("nsenter") or "/usr/bin/nsenter"
MOUNT = shutil.which("mount") or "/usr/bin/mount"
MKDIR = shutil.which("mkdir") or "/usr/bin/mkdir"
HOSTNAME = shutil.which("hostname") or "/usr/bin/hostname"

# Host variables passed to every container: what an image would provide (PATH, HOME, locale)
# and what makes the project's own console scripts and interpreter work.
INHERITED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "VIRTUAL_ENV", "PYTHONPATH",
                 "PYENV_ROOT", "PYENV_VERSION", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
                 "SSL_CERT_FILE", "KVPOOL_E2E_RUN_ID")


def now_rfc3339() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class ConfigError(Exception):
    """A referenced ConfigMap/Secret (key) is missing: the kubelet's CreateContainerConfigError."""


# -- pure helpers (env, expansion, volumes) -----------------------------------------------------

_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: defined names are replaced, ``$$`` escapes a ``$``,
    undefined references stay as written."""

    def repl(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)

    return _VAR_REF.sub(repl, value)


def field_value(pod: dict[str, Any], path: str) -> str:
    """Downward-API ``fieldRef.fieldPath`` on a pod dict."""
    meta = pod.get("metadata", {})
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": pod.get("spec", {}).get("nodeName"),
        "spec.serviceAccountName": pod.get("spec", {}).get("serviceAccountName"),
        "status.podIP": pod.get("status", {}).get("podIP"),
        "status.hostIP": pod.get("status", {}).get("hostIP", "127.0.0.1"),
        "status.podIPs": pod.get("status", {}).get("podIP"),
    }
    if path in ("metadata.labels", "metadata.annotations"):
        items = meta.get(path.split(".")[1]) or {}
        return "\n".join(f'{k}="{v}"' for k, v in sorted(items.items()))
    if path not in simple:
        raise ConfigError(f"unsupported fieldPath {path}")
    return str(simple[path] or "")


def resource_value(container: dict[str, Any], ref: dict[str, Any]) -> str:
    """``resourceFieldRef``: the limit/request as a plain number string (divisor 1)."""
    kind, _, res = ref["resource"].partition(".")
    value = (container.get("resources", {}).get(kind) or {}).get(res)
    if value is None:
        # No limit: a kubelet reports node allocatable; report something large and stable.
        return str(os.cpu_count() or 1) if res == "cpu" else str(24 * 2**30)
    return str(value)


def _ready(pod: dict[str, Any]) -> bool:
    conds = pod.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def _selects(selector: dict[str, str], pod: dict[str, Any]) -> bool:
    labels = pod["metadata"].get("labels") or {}
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def render_hosts(me: dict[str, Any], pods: list[dict[str, Any]],
                 services: list[dict[str, Any]]) -> str:
    """/etc/hosts for pod ``me``: the harness's stand-in for cluster DNS.

    * every pod with a hostname and subdomain (StatefulSet pods) under
      ``<host>.<subdomain>.<ns>.svc.cluster.local`` and the shorter forms a search path allows;
    * every Service with a selector under its names, mapped to the IPs of the ready pods it
      selects (there is no kube-proxy, so a ClusterIP is not routable; the pod IPs are; a client
      must use the target port, which the operator's services keep equal to the port).
    Names relative to ``me``'s namespace are added for its own namespace only, as a
    ``search <ns>.svc.cluster.local svc.cluster.local cluster.local`` line would resolve them.
    """
    my_ns = me["metadata"]["namespace"]
    my_ip = me.get("status", {}).get("podIP", "")
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]

    def names(base: list[str], ns: str) -> list[str]:
        full = [".".join([*base, ns, "svc", "cluster", "local"]), ".".join([*base, ns, "svc"]),
                ".".join([*base, ns])]
        return full + ([".".join(base)] if ns == my_ns else [])

    own_host = me["spec"].get("hostname") or me["metadata"]["name"]
    own_names = [own_host]
    if me["spec"].get("subdomain"):
        own_names = names([own_host, me["spec"]["subdomain"]], my_ns) + own_names
    if my_ip:
        lines.append(f"{my_ip}\t{' '.join(own_names)}")
    for pod in sorted(pods, key=lambda p: (p["metadata"]["namespace"], p["metadata"]["name"])):
        ip = pod.get("status", {}).get("podIP")
        host, sub = pod["spec"].get("hostname"), pod["spec"].get("subdomain")
        if not ip or not host or not sub or pod["metadata"].get("uid") == me["metadata"].get("uid"):
            continue
        lines.append(f"{ip}\t{' '.join(names([host, sub], pod['metadata']['namespace']))}")
    for svc in services:
        meta, spec = svc["metadata"], svc.get("spec", {})
        selector = spec.get("selector") or {}
        not_ready_too = spec.get("publishNotReadyAddresses", False)
        ips = sorted(
            p["status"]["podIP"] for p in pods
            if p["metadata"]["namespace"] == meta["namespace"] and _selects(selector, p)
            and p.get("status", {}).get("podIP") and (not_ready_too or _ready(p))
            and p["metadata"].get("deletionTimestamp") is None
        )
        for ip in ips:
            lines.append(f"{ip}\t{' '.join(names([meta['name']], meta['namespace']))}")
    return "\n".join(lines) + "\n"


@dataclasses.dataclass
class ProbeState:
    """Counters for one probe of one container."""

    spec: dict[str, Any]
    next_at: float
    successes: int = 0
    failures: int = 0
    result: bool | None = None


@dataclasses.dataclass
class Container:
    """One container of a pod and its current process, if any."""

    spec: dict[str, Any]
    kind: str  # "init", "sidecar" or "main"
    proc: subprocess.Popen[bytes] | None = None
    restart_count: int = 0
    started_at: str | None = None
    ever_started: bool = False
    startup_ok: bool = False
    ready: bool = False
    exit_code: int | None = None
    finished_at: str | None = None
    reason: str = ""
    waiting_reason: str = "ContainerCreating"
    waiting_message: str = ""
    last_state: dict[str, Any] = dataclasses.field(default_factory=dict)
    restart_at: float = 0.0
    done: bool = False  # terminated and will not be restarted
    probes: dict[str, ProbeState] = dataclasses.field(default_factory=dict)
    prestop: subprocess.Popen[bytes] | None = None
    term_sent: bool = False
    env: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class IpPool:
    """Hands out ``<prefix>2`` .. ``<prefix>254``; released addresses are reused last."""

    def __init__(self, prefix: str) -> None:
        self._free = [f"{prefix}{i}" for i in range(2, 255)]
        self._lock = threading.Lock()

    def take(self) -> str:
        with self._lock:
            return self._free.pop(0)

    def give(self, ip: str) -> None:
        with self._lock:
            self._free.append(ip)


class PodWorker(threading.Thread):
    """Drives one pod from binding to deletion."""

    def __init__(self, agent: Agent, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.agent = agent
        self.pod = pod
        self.uid: str = meta["uid"]
        self.ns: str = meta["namespace"]
        self.pod_name: str = meta["name"]
        self.dir = agent.state_dir / "pods" / f"{self.ns}_{self.pod_name}_{self.uid[:8]}"
        self.shm_dir = agent.shm_root / self.uid
        self.ip = ""
        self.lock = threading.Lock()
        self.gone = False  # object deleted from the API: kill at once
        self.stopping = False  # agent shutting down: kill, keep the object
        spec = pod["spec"]
        self.policy: str = spec.get("restartPolicy", "Always")
        self.host_network = bool(spec.get("hostNetwork"))
        inits = spec.get("initContainers") or []
        self.init: list[Container] = [
            Container(c, "sidecar" if c.get("restartPolicy") == "Always" else "init") for c in inits
        ]
        self.main: list[Container] = [Container(c, "main") for c in spec.get("containers", [])]
        self.init_index = 0
        self.prepared = False
        self.phase = "Pending"
        self.start_time: str | None = None
        self.cond_times: dict[str, tuple[str, str]] = {}
        self.published: dict[str, Any] | None = None
        self.mounts: dict[str, Path] = {}
        self.term_deadline: float | None = None
        self.term_stage = ""  # "", "main", "sidecars", "done"

    # -- inputs from the agent -----------------------------------------------------------------

    def update(self, pod: dict[str, Any]) -> None:
        with self.lock:
            self.pod = pod

    def mark_gone(self) -> None:
        self.gone = True

    # -- main loop -----------------------------------------------------------------------------

    def run(self) -> None:
        try:
            self._loop()
        except Exception:
            log.exception("pod worker %s/%s crashed", self.ns, self.pod_name)
            self._kill_all()
        finally:
            self._cleanup()
            self.agent.worker_done(self.uid)

    def _loop(self) -> None:
        while True:
            with self.lock:
                pod = self.pod
            if self.gone or self.stopping:
                self._kill_all(grace=0 if self.gone else 2)
                return
            deleting = pod["metadata"].get("deletionTimestamp") is not None
            if deleting and self.term_deadline is None:
                grace = pod["metadata"].get("deletionGracePeriodSeconds")
                if grace is None:
                    grace = pod["spec"].get("terminationGracePeriodSeconds", DEFAULT_GRACE)
                self.term_deadline = time.monotonic() + float(grace)
                self.term_stage = "main"
                log.info("pod %s/%s: terminating, grace %ss", self.ns, self.pod_name, grace)
            if self.term_deadline is not None:
                if self._terminate_step():
                    # A kubelet reports a terminal phase before the object goes away.
                    if self.phase not in ("Succeeded", "Failed"):
                        failed = any(c.exit_code for c in self.main if c.exit_code is not None)
                        self.phase = "Failed" if failed else "Succeeded"
                    self._publish()
                    self._delete_object()
                    return
            elif not self.prepared:
                self._prepare()
            elif self.phase in ("Succeeded", "Failed"):
                self._stop_sidecars_after_completion()
            else:
                self._advance()
            self._probe_all()
            self._publish()
            time.sleep(TICK)

    # -- start-up ------------------------------------------------------------------------------

    def _prepare(self) -> None:
        try:
            if not self.ip:
                # hostNetwork pods share the node's address, as they would on a real node.
                self.ip = "127.0.0.1" if self.host_network else self.agent.ips.take()
                self.start_time = now_rfc3339()
            self.dir.mkdir(parents=True, exist_ok=True)
            self._make_volumes()
            self.prepared = True
        except ConfigError as exc:
            for c in self.init + self.main:
                c.waiting_reason, c.waiting_message = "ContainerCreating", str(exc)
            time.sleep(0.5)

    def _advance(self) -> None:
        """Start what should run next and handle exits (not terminating)."""
        for c in self.init[: self.init_index] + self.main:
            self._handle_exit(c)
        # Sidecars already past the init sequence are restarted whenever they exit.
        for c in self.init[: self.init_index]:
            if c.kind == "sidecar" and c.proc is None and time.monotonic() >= c.restart_at:
                self._start(c)
        # Init sequence: each regular init container runs to success; each sidecar must have
        # started (its startup probe passed) before the next init container starts.
        while self.init_index < len(self.init):
            c = self.init[self.init_index]
            if c.proc is None and not c.done and time.monotonic() >= c.restart_at:
                self._start(c)
            if c.kind == "sidecar":
                if c.proc is not None and c.proc.poll() is not None:
                    # Died before it counted as started: sidecars always restart.
                    self._record_exit(c, c.proc.returncode)
                    self._schedule_restart(c)
                    return
                if not (c.running() and c.startup_ok):
                    return
            else:
                code = c.proc.poll() if c.proc is not None else None
                if c.proc is None or code is None:
                    return
                self._record_exit(c, code)
                if code != 0:
                    if self.policy == "Never":
                        self.phase = "Failed"
                        c.done = True
                    else:
                        self._schedule_restart(c)
                    return
                c.done = True
                c.proc = None
            self.init_index += 1
        for c in self.main:
            if c.proc is None and not c.done and time.monotonic() >= c.restart_at:
                self._start(c)
        if all(c.done for c in self.main):
            failed = any(c.exit_code for c in self.main)
            self.phase = "Failed" if failed else "Succeeded"
        elif any(c.ever_started for c in self.main):
            self.phase = "Running"

    def _handle_exit(self, c: Container) -> None:
        if c.proc is None or c.kind == "init":
            return
        code = c.proc.poll()
        if code is None:
            return
        self._record_exit(c, code)
        restart = (c.kind == "sidecar" or self.policy == "Always"
                   or (self.policy == "OnFailure" and code != 0))
        if restart:
            self._schedule_restart(c)
        else:
            c.done = True

    def _record_exit(self, c: Container, code: int) -> None:
        c.exit_code = code if code >= 0 else 128 - code  # signal N -> 128+N, like a runtime
        c.finished_at = now_rfc3339()
        c.reason = "Completed" if code == 0 else "Error"
        c.ready = False
        log.info("pod %s/%s container %s exited %s", self.ns, self.pod_name, c.name, c.exit_code)

    def _schedule_restart(self, c: Container) -> None:
        c.last_state = {"terminated": self._terminated_state(c)}
        c.proc = None
        c.restart_count += 1
        c.startup_ok = False
        c.probes.clear()
        delay = min(MAX_BACKOFF, 0.5 * 2 ** min(c.restart_count - 1, 6))
        c.restart_at = time.monotonic() + delay
        c.waiting_reason = "CrashLoopBackOff" if c.restart_count > 1 else "ContainerCreating"
        c.waiting_message = f"back-off {delay:.1f}s restarting failed container"

    def _terminated_state(self, c: Container) -> dict[str, Any]:
        return {"exitCode": c.exit_code if c.exit_code is not None else 0, "reason": c.reason,
                "startedAt": c.started_at, "finishedAt": c.finished_at,
                "containerID": f"kvpool://{self.uid[:8]}-{c.name}"}

    def _start(self, c: Container) -> None:
        try:
            c.env = self._container_env(c.spec)
            script = self._namespace_script(c)
        except ConfigError as exc:
            c.waiting_reason, c.waiting_message = "CreateContainerConfigError", str(exc)
            c.restart_at = time.monotonic() + 1.0
            return
        argv = [expand(a, c.env) for a in (c.spec.get("command") or []) + (c.spec.get("args") or [])]
        if not argv:
            c.waiting_reason = "CreateContainerError"
            c.waiting_message = "no command: images are not run here, give command/args"
            c.restart_at = time.monotonic() + 5.0
            return
        logf = (self.dir / f"{c.name}.log").open("ab")
        try:
            logf.write(f"--- {now_rfc3339()} start {shlex.join(argv)}\n".encode())
            logf.flush()
            c.proc = subprocess.Popen(
                [UNSHARE, "--mount", "--uts", "--propagation", "private",
                 "/bin/sh", "-c", script, "kvpool-pod", *argv],
                stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=c.env, cwd=str(self.dir),
                # Own process group: SIGTERM/SIGKILL reach the container's children too.
                start_new_session=True,
            )
        except OSError as exc:
            c.waiting_reason, c.waiting_message = "StartError", str(exc)
            c.restart_at = time.monotonic() + 2.0
            return
        finally:
            logf.close()
        c.started_at = now_rfc3339()
        c.ever_started = True
        c.exit_code = None
        c.term_sent = False
        c.startup_ok = "startupProbe" not in c.spec
        now = time.monotonic()
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            if kind in c.spec:
                p = c.spec[kind]
                c.probes[kind] = ProbeState(p, now + float(p.get("initialDelaySeconds", 0)))
        log.info("pod %s/%s container %s started pid %s: %s", self.ns, self.pod_name, c.name,
                 c.proc.pid, shlex.join(argv))

    def _namespace_script(self, c: Container) -> str:
        """Shell run inside the new namespaces: mounts, hostname, cwd, then exec the command."""
        lines = ["set -e"]
        hostname = self.pod["spec"].get("hostname") or self.pod_name
        lines.append(f"{HOSTNAME} {shlex.quote(hostname[:63])}")
        lines.append(f"{MOUNT} --bind {shlex.quote(str(self.dir / 'hosts'))} /etc/hosts")
        for m in c.spec.get("volumeMounts") or []:
            src = self.mounts.get(m["name"])
            if src is None:
                raise ConfigError(f"volumeMount {m['name']} names no volume")
            if m.get("subPath"):
                src = src / m["subPath"]
                if not src.exists():
                    src.mkdir(parents=True)
            dst = shlex.quote(m["mountPath"])
            if src.is_dir():
                lines.append(f"{MKDIR} -p {dst}")
            else:
                parent = shlex.quote(str(Path(m["mountPath"]).parent))
                lines.append(f"{MKDIR} -p {parent}; [ -e {dst} ] || : > {dst}")
            lines.append(f"{MOUNT} --bind {shlex.quote(str(src))} {dst}")
            if m.get("readOnly"):
                lines.append(f"{MOUNT} -o remount,bind,ro {dst}")
        wd = c.spec.get("workingDir")
        if wd:
            lines.append(f"{MKDIR} -p {shlex.quote(wd)}; cd {shlex.quote(wd)}")
        lines.append('exec "$@"')
        return "\n".join(lines)

    # -- environment ---------------------------------------------------------------------------

    def _container_env(self, spec: dict[str, Any]) -> dict[str, str]:
        pod = self._pod_with_ip()
        env = {k: os.environ[k] for k in INHERITED_ENV if k in os.environ}
        env["HOSTNAME"] = pod["spec"].get("hostname") or self.pod_name
        env[POD_MARKER_ENV] = self.uid  # lets _cleanup find processes that left the group
        # In-cluster clients (kopf, kubernetes.config.load_incluster_config) read these; the
        # service IP is not routable here, so point them at the apiserver directly.
        env["KUBERNETES_SERVICE_HOST"] = "127.0.0.1"
        env["KUBERNETES_SERVICE_PORT"] = str(self.agent.apiserver_port)
        env["KUBERNETES_SERVICE_PORT_HTTPS"] = str(self.agent.apiserver_port)
        declared: dict[str, str] = {}
        for src in spec.get("envFrom") or []:
            prefix = src.get("prefix", "")
            if "configMapRef" in src:
                ref = src["configMapRef"]
                data = self.agent.configmap_data(self.ns, ref["name"], ref.get("optional", False))
            else:
                ref = src["secretRef"]
                data = self.agent.secret_data(self.ns, ref["name"], ref.get("optional", False))
            for k, v in (data or {}).items():
                declared[prefix + k] = v.decode(errors="replace") if isinstance(v, bytes) else v
        for item in spec.get("env") or []:
            name = item["name"]
            if "value" in item:
                declared[name] = expand(item.get("value") or "", {**env, **declared})
                continue
            vf = item.get("valueFrom")
            if not vf:
                declared[name] = ""
                continue
            if "fieldRef" in vf:
                declared[name] = field_value(pod, vf["fieldRef"]["fieldPath"])
            elif "resourceFieldRef" in vf:
                declared[name] = resource_value(spec, vf["resourceFieldRef"])
            elif "configMapKeyRef" in vf:
                declared[name] = self._key(vf["configMapKeyRef"], secret=False)
            elif "secretKeyRef" in vf:
                declared[name] = self._key(vf["secretKeyRef"], secret=True)
        env.update(declared)
        return env

    def _key(self, ref: dict[str, Any], secret: bool) -> str:
        optional = ref.get("optional", False)
        getter = self.agent.secret_data if secret else self.agent.configmap_data
        data = getter(self.ns, ref["name"], optional) or {}
        if ref["key"] not in data:
            if optional:
                return ""
            raise ConfigError(f"key {ref['key']} not found in {ref['name']}")
        value = data[ref["key"]]
        return value.decode(errors="replace") if isinstance(value, bytes) else value

    def _pod_with_ip(self) -> dict[str, Any]:
        with self.lock:
            pod: dict[str, Any] = json.loads(json.dumps(self.pod))
        pod.setdefault("status", {})["podIP"] = self.ip
        pod["status"]["hostIP"] = "127.0.0.1"
        return pod

    # -- volumes -------------------------------------------------------------------------------

    def _make_volumes(self) -> None:
        pod = self._pod_with_ip()
        vols_dir = self.dir / "volumes"
        vols_dir.mkdir(exist_ok=True)
        self.write_hosts(render_hosts(pod, [pod], []))
        for vol in pod["spec"].get("volumes") or []:
            name = vol["name"]
            if "emptyDir" in vol:
                medium = (vol["emptyDir"] or {}).get("medium", "")
                # Memory-backed: /dev/shm is a tmpfs, so no mount (and no unmount) is needed.
                path = (self.shm_dir / name) if medium == "Memory" else (vols_dir / name)
                path.mkdir(parents=True, exist_ok=True)
            elif "persistentVolumeClaim" in vol:
                claim = vol["persistentVolumeClaim"]["claimName"]
                # Outlives the pod, like a PV: a StatefulSet pod recreated finds its data.
                path = self.agent.state_dir / "pvc" / self.ns / claim
                path.mkdir(parents=True, exist_ok=True)
            elif "hostPath" in vol:
                path = Path(vol["hostPath"]["path"])
                if vol["hostPath"].get("type") in ("DirectoryOrCreate", "", None):
                    path.mkdir(parents=True, exist_ok=True)
            else:
                path = vols_dir / name
                files = self._projected_files(vol, pod)
                if files is None:
                    continue
                _write_files(path, files)
            self.mounts[name] = path

    def refresh_volumes(self) -> None:
        """Bring Secret/ConfigMap/downwardAPI/projected volumes up to date, as a kubelet does
        periodically (a missing source keeps the old content rather than failing the pod)."""
        if not self.prepared or self.term_deadline is not None:
            return
        pod = self._pod_with_ip()
        for vol in pod["spec"].get("volumes") or []:
            if not any(k in vol for k in ("secret", "configMap", "downwardAPI", "projected")):
                continue
            path = self.mounts.get(vol["name"])
            if path is None:
                continue
            try:
                files = self._projected_files(vol, pod, refresh=True)
            except ConfigError:
                continue
            if files is not None and _write_files(path, files):
                log.info("pod %s/%s: volume %s updated", self.ns, self.pod_name, vol["name"])

    def write_hosts(self, text: str) -> None:
        """Rewrite the pod's /etc/hosts in place: the containers see it through a bind mount of
        this very inode, so a rename would leave them with the old file."""
        path = self.dir / "hosts"
        if path.exists() and path.read_text() == text:
            return
        with path.open("r+" if path.exists() else "w") as fh:
            fh.write(text)
            fh.truncate()

    def _projected_files(self, vol: dict[str, Any], pod: dict[str, Any],
                         refresh: bool = False) -> dict[str, tuple[bytes, int]] | None:
        """Files of a Secret/ConfigMap/downwardAPI/projected volume: rel path -> (data, mode)."""
        files: dict[str, tuple[bytes, int]] = {}
        if "secret" in vol:
            s = vol["secret"]
            self._add_source(files, s, secret=True, name=s.get("secretName", ""),
                             mode=s.get("defaultMode", 0o644))
        elif "configMap" in vol:
            s = vol["configMap"]
            self._add_source(files, s, secret=False, name=s["name"],
                             mode=s.get("defaultMode", 0o644))
        elif "downwardAPI" in vol:
            for item in vol["downwardAPI"].get("items") or []:
                files[item["path"]] = (field_value(pod, item["fieldRef"]["fieldPath"]).encode(),
                                       item.get("mode", 0o644))
        elif "projected" in vol:
            p = vol["projected"]
            mode = p.get("defaultMode", 0o644)
            for src in p.get("sources") or []:
                if "secret" in src:
                    self._add_source(files, src["secret"], True, src["secret"]["name"], mode)
                elif "configMap" in src:
                    self._add_source(files, src["configMap"], False, src["configMap"]["name"], mode)
                elif "downwardAPI" in src:
                    for item in src["downwardAPI"].get("items") or []:
                        files[item["path"]] = (
                            field_value(pod, item["fieldRef"]["fieldPath"]).encode(),
                            item.get("mode", mode))
                elif "serviceAccountToken" in src:
                    tok = src["serviceAccountToken"]
                    existing = self.dir / "volumes" / vol["name"] / tok["path"]
                    # A token is valid for an hour and harness sessions are shorter: on a
                    # refresh keep the one already issued instead of asking the API again.
                    token = (existing.read_bytes() if refresh and existing.is_file()
                             else self.agent.sa_token(pod, tok).encode())
                    files[tok["path"]] = (token, mode)
        else:
            log.warning("pod %s/%s: unsupported volume %s", self.ns, self.pod_name, vol["name"])
            return None
        return files

    def _add_source(self, files: dict[str, tuple[bytes, int]], src: dict[str, Any], secret: bool,
                    name: str, mode: int) -> None:
        optional = src.get("optional", False)
        getter = self.agent.secret_data if secret else self.agent.configmap_data
        data = getter(self.ns, name, optional)
        if data is None:
            return
        items = src.get("items")
        if items:
            for item in items:
                if item["key"] not in data:
                    if optional:
                        continue
                    raise ConfigError(f"key {item['key']} not in {name}")
                v = data[item["key"]]
                files[item["path"]] = (v if isinstance(v, bytes) else v.encode(),
                                       item.get("mode", mode))
        else:
            for k, v in data.items():
                files[k] = (v if isinstance(v, bytes) else v.encode(), mode)

    # -- probes --------------------------------------------------------------------------------

    def _probe_all(self) -> None:
        if self.term_deadline is not None:
            return
        now = time.monotonic()
        for c in self.init + self.main:
            if not c.running():
                continue
            for kind, st in list(c.probes.items()):
                if now < st.next_at:
                    continue
                if kind != "startupProbe" and not c.startup_ok:
                    continue
                spec = st.spec
                ok = self._probe_once(c, spec)
                st.next_at = time.monotonic() + float(spec.get("periodSeconds", 10))
                if ok:
                    st.successes, st.failures = st.successes + 1, 0
                    if st.successes >= int(spec.get("successThreshold", 1)):
                        st.result = True
                else:
                    st.failures, st.successes = st.failures + 1, 0
                    if st.failures >= int(spec.get("failureThreshold", 3)):
                        st.result = False
                if kind == "startupProbe" and st.result:
                    c.startup_ok = True
                    del c.probes[kind]
                elif kind in ("startupProbe", "livenessProbe") and st.result is False:
                    log.info("pod %s/%s container %s: %s failed, restarting", self.ns,
                             self.pod_name, c.name, kind)
                    self._kill_container(c, float(self.pod["spec"].get(
                        "terminationGracePeriodSeconds", DEFAULT_GRACE)))
                    break
            rp = c.probes.get("readinessProbe")
            if rp is None:
                c.ready = c.running() and c.startup_ok
            else:
                c.ready = bool(rp.result) and c.startup_ok

    def _probe_once(self, c: Container, spec: dict[str, Any]) -> bool:
        timeout = float(spec.get("timeoutSeconds", 1))
        try:
            if "exec" in spec:
                return self._exec_in(c, spec["exec"]["command"], timeout) == 0
            if "tcpSocket" in spec:
                t = spec["tcpSocket"]
                host = t.get("host") or self.ip
                with socket.create_connection((host, self._port(c, t["port"])), timeout=timeout):
                    return True
            if "httpGet" in spec:
                h = spec["httpGet"]
                host = h.get("host") or self.ip
                port = self._port(c, h["port"])
                conn_cls = (http.client.HTTPSConnection if h.get("scheme") == "HTTPS"
                            else http.client.HTTPConnection)
                kwargs: dict[str, Any] = {"timeout": timeout}
                if conn_cls is http.client.HTTPSConnection:
                    kwargs["context"] = ssl._create_unverified_context()  # kubelet skips verify
                conn = conn_cls(host, port, **kwargs)
                try:
                    headers = {x["name"]: x["value"] for x in h.get("httpHeaders") or []}
                    conn.request("GET", h.get("path", "/"), headers=headers)
                    status = conn.getresponse().status
                finally:
                    conn.close()
                return 200 <= status < 400
            if "grpc" in spec:
                log.warning("grpc probes are not supported; treating as failed")
        except (OSError, subprocess.SubprocessError, http.client.HTTPException):
            return False
        return False

    def _port(self, c: Container, port: int | str) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for p in c.spec.get("ports") or []:
            if p.get("name") == port:
                return int(p["containerPort"])
        raise OSError(f"named port {port} not found")

    def _exec_in(self, c: Container, command: list[str], timeout: float) -> int:
        """Run a command in the container's mount namespace, cwd and environment."""
        assert c.proc is not None
        wd = c.spec.get("workingDir") or "/"
        argv = [NSENTER, "-t", str(c.proc.pid), "-m", "-u", "--", "/bin/sh", "-c",
                'cd "$0" && exec "$@"', wd, *command]
        return subprocess.run(argv, env=c.env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=timeout).returncode

    # -- termination ---------------------------------------------------------------------------

    def _kill_container(self, c: Container, grace: float) -> None:
        """Liveness/startup failure: SIGTERM, SIGKILL after grace (blocking this pod's loop)."""
        if c.proc is None:
            return
        _signal_group(c.proc, signal.SIGTERM)
        try:
            c.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            _signal_group(c.proc, signal.SIGKILL)
            c.proc.wait()

    def _stop_gracefully(self, containers: list[Container]) -> bool:
        """One step of stopping ``containers``: preStop, then SIGTERM. True when all ended."""
        all_done = True
        for c in containers:
            if not c.running():
                continue
            all_done = False
            hook = ((c.spec.get("lifecycle") or {}).get("preStop") or {}).get("exec")
            if hook and c.prestop is None and not c.term_sent:
                assert c.proc is not None
                argv = [NSENTER, "-t", str(c.proc.pid), "-m", "-u", "--", *hook["command"]]
                c.prestop = subprocess.Popen(argv, env=c.env, stdout=subprocess.DEVNULL,
                                             stderr=subprocess.DEVNULL, start_new_session=True)
                continue
            if c.prestop is not None and c.prestop.poll() is None:
                continue
            if not c.term_sent:
                assert c.proc is not None
                _signal_group(c.proc, signal.SIGTERM)
                c.term_sent = True
        return all_done

    def _terminate_step(self) -> bool:
        """Advance the deletion: main containers, then sidecars in reverse, then SIGKILL at the
        deadline. True once nothing runs any more."""
        assert self.term_deadline is not None
        for c in self.init + self.main:
            c.ready = False
            if c.proc is not None and c.proc.poll() is not None and c.exit_code is None:
                self._record_exit(c, c.proc.returncode)
        if time.monotonic() >= self.term_deadline:
            self._kill_all(grace=0)
            return True
        if self.term_stage == "main":
            # Regular init containers still running count as "main" here: they stop first.
            first = self.main + [c for c in self.init if c.kind == "init"]
            if self._stop_gracefully(first):
                self.term_stage = "sidecars"
        if self.term_stage == "sidecars":
            sidecars = [c for c in self.init if c.kind == "sidecar"]
            # Reverse start order; each one only after the ones started later have ended.
            for c in reversed(sidecars):
                if not self._stop_gracefully([c]):
                    return False
            self.term_stage = "done"
        return self.term_stage == "done" and not any(c.running() for c in self.init + self.main)

    def _stop_sidecars_after_completion(self) -> None:
        sidecars = [c for c in self.init if c.kind == "sidecar"]
        for c in reversed(sidecars):
            if not self._stop_gracefully([c]):
                break
        for c in sidecars:
            if c.proc is not None and c.proc.poll() is not None and c.exit_code is None:
                self._record_exit(c, c.proc.returncode)
                c.done = True

    def _kill_all(self, grace: float = 0) -> None:
        procs = [c.proc for c in self.init + self.main if c.proc is not None and c.running()]
        for p in procs:
            _signal_group(p, signal.SIGTERM if grace else signal.SIGKILL)
        deadline = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(p, signal.SIGKILL)
            p.wait()
        for c in self.init + self.main:
            if c.proc is not None and c.exit_code is None:
                self._record_exit(c, c.proc.returncode if c.proc.returncode is not None else -9)
            if c.prestop is not None and c.prestop.poll() is None:
                _signal_group(c.prestop, signal.SIGKILL)
                c.prestop.wait()

    def _delete_object(self) -> None:
        body = client.V1DeleteOptions(grace_period_seconds=0,
                                      preconditions=client.V1Preconditions(uid=self.uid))
        try:
            self.agent.core.delete_namespaced_pod(self.pod_name, self.ns, body=body,
                                                  grace_period_seconds=0)
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise

    def _cleanup(self) -> None:
        if not self.stopping:
            procs.kill_marked(POD_MARKER_ENV, self.uid)
        if self.ip and not self.host_network:
            self.agent.ips.give(self.ip)
        self.ip = ""
        shutil.rmtree(self.shm_dir, ignore_errors=True)
        # Keep the per-pod dir (its logs are printed when a test fails); drop volume contents.
        shutil.rmtree(self.dir / "volumes", ignore_errors=True)

    # -- status --------------------------------------------------------------------------------

    def _container_status(self, c: Container) -> dict[str, Any]:
        state: dict[str, Any]
        if c.running():
            state = {"running": {"startedAt": c.started_at}}
        elif c.exit_code is not None and (c.done or c.proc is not None or self.term_deadline):
            state = {"terminated": self._terminated_state(c)}
        else:
            state = {"waiting": {"reason": c.waiting_reason,
                                 **({"message": c.waiting_message} if c.waiting_message else {})}}
        status: dict[str, Any] = {
            "name": c.name,
            "image": c.spec.get("image", ""),
            "imageID": "",
            "ready": bool(c.ready and c.running()),
            "restartCount": c.restart_count,
            "started": bool(c.running() and c.startup_ok),
            "state": state,
            "lastState": c.last_state,
        }
        if c.ever_started:
            status["containerID"] = f"kvpool://{self.uid[:8]}-{c.name}"
        return status

    def _condition(self, ctype: str, ok: bool) -> dict[str, Any]:
        status = "True" if ok else "False"
        prev = self.cond_times.get(ctype)
        if prev is None or prev[0] != status:
            self.cond_times[ctype] = (status, now_rfc3339())
        return {"type": ctype, "status": status,
                "lastTransitionTime": self.cond_times[ctype][1], "lastProbeTime": None}

    def _status(self) -> dict[str, Any]:
        inits_ok = self.init_index >= len(self.init)
        sidecars_ready = all(c.ready for c in self.init if c.kind == "sidecar")
        mains_ready = bool(self.main) and all(c.ready for c in self.main)
        ready = inits_ok and sidecars_ready and mains_ready and self.term_deadline is None
        conds = [
            self._condition("PodReadyToStartContainers", self.prepared),
            self._condition("Initialized", inits_ok),
            self._condition("ContainersReady", ready),
            self._condition("Ready", ready),
            self._condition("PodScheduled", True),
        ]
        status: dict[str, Any] = {
            "phase": self.phase,
            "conditions": conds,
            "hostIP": "127.0.0.1",
            "hostIPs": [{"ip": "127.0.0.1"}],
            "initContainerStatuses": [self._container_status(c) for c in self.init],
            "containerStatuses": [self._container_status(c) for c in self.main],
        }
        if self.ip:
            status["podIP"] = self.ip
            status["podIPs"] = [{"ip": self.ip}]
        if self.start_time:
            status["startTime"] = self.start_time
        return status

    def _publish(self) -> None:
        status = self._status()
        if status == self.published:
            return
        try:
            self.agent.core.patch_namespaced_pod_status(self.pod_name, self.ns, {"status": status})
            self.published = status
        except ApiException as exc:
            if exc.status == 404:
                self.gone = True
            else:
                log.warning("status of %s/%s: %s", self.ns, self.pod_name, exc.reason)


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _write_files(root: Path, files: dict[str, tuple[bytes, int]]) -> bool:
    """Make ``root`` hold exactly ``files``; True if anything changed.

    Updates happen inside the existing directory (write to a temp name, then rename), never by
    replacing the directory: the containers see it through a bind mount of this very inode.
    """
    root.mkdir(parents=True, exist_ok=True)
    changed = False
    for rel, (data, mode) in files.items():
        target = root / rel
        if target.is_file() and target.read_bytes() == data:
            if target.stat().st_mode & 0o7777 != mode:
                target.chmod(mode)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_bytes(data)
        tmp.chmod(mode)
        tmp.rename(target)
        changed = True
    wanted = {root / rel for rel in files}
    for path in sorted(root.rglob("*"), reverse=True):
        if path.is_file() and path not in wanted:
            path.unlink()
            changed = True
    return changed


class Agent:
    """Registers the node, heartbeats it, and runs one PodWorker per pod bound to it."""

    def __init__(self, api: client.ApiClient, node_name: str, state_dir: Path, ip_prefix: str,
                 apiserver_port: int, ca_file: Path, run_id: str) -> None:
        self.api = api
        # Any: the agent passes plain dict manifests, which the client's annotations omit.
        self.core: Any = client.CoreV1Api(api)
        self.coord: Any = client.CoordinationV1Api(api)
        self.node_name = node_name
        self.state_dir = state_dir
        self.shm_root = Path("/dev/shm") / f"kvpool-e2e-{run_id}"
        self.ips = IpPool(ip_prefix)
        self.apiserver_port = apiserver_port
        self.ca_file = ca_file
        self.workers: dict[str, PodWorker] = {}
        self.finished: set[str] = set()
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.kubelet_port = 0  # set by serve_kubelet_api; 0: no kubelet API

    # -- node ----------------------------------------------------------------------------------

    def register(self) -> None:
        node = {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": self.node_name, "labels": {
                "kubernetes.io/hostname": self.node_name, "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64", "kvpool.io/e2e-node": "true"}},
        }
        try:
            self.core.create_node(node)
        except ApiException as exc:
            if exc.status != 409:
                raise
        self._node_status()
        uid = self.core.read_node(self.node_name).metadata.uid
        lease = {
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": self.node_name, "namespace": "kube-node-lease",
                         "ownerReferences": [{"apiVersion": "v1", "kind": "Node",
                                              "name": self.node_name, "uid": uid}]},
            "spec": {"holderIdentity": self.node_name, "leaseDurationSeconds": 40,
                     "renewTime": now_micro()},
        }
        try:
            self.coord.create_namespaced_lease("kube-node-lease", lease)
        except ApiException as exc:
            if exc.status != 409:
                raise

    def _node_status(self) -> None:
        now = now_rfc3339()
        cap = {"cpu": str(os.cpu_count() or 2), "memory": "24Gi", "pods": "250",
               "ephemeral-storage": "100Gi"}
        conds = [{"type": t, "status": "False", "reason": f"KubeletHas{r}",
                  "lastHeartbeatTime": now, "lastTransitionTime": now}
                 for t, r in [("MemoryPressure", "SufficientMemory"),
                              ("DiskPressure", "NoDiskPressure"),
                              ("PIDPressure", "SufficientPID")]]
        conds.append({"type": "Ready", "status": "True", "reason": "KubeletReady",
                      "message": "kvpool e2e node agent is posting ready status",
                      "lastHeartbeatTime": now, "lastTransitionTime": now})
        status = {
            "capacity": cap, "allocatable": cap, "conditions": conds,
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                          {"type": "Hostname", "address": self.node_name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.kubelet_port}},
            "nodeInfo": {"kubeletVersion": "v0.0.0-kvpool-e2e", "kubeProxyVersion": "",
                         "operatingSystem": "linux", "architecture": "amd64",
                         "containerRuntimeVersion": "kvpool-e2e://local",
                         "kernelVersion": os.uname().release, "osImage": "local processes",
                         "machineID": "", "systemUUID": "", "bootID": ""},
        }
        self.core.patch_node_status(self.node_name, {"status": status})

    def heartbeat(self) -> None:
        """Renew the Lease every 10 s and the node status every 30 s, as a kubelet does."""
        last_status = time.monotonic()
        while not self.stop_event.wait(10):
            try:
                self.coord.patch_namespaced_lease(self.node_name, "kube-node-lease",
                                                  {"spec": {"renewTime": now_micro()}})
                if time.monotonic() - last_status > 30:
                    self._node_status()
                    last_status = time.monotonic()
            except Exception as exc:  # the apiserver may be going away; retry next period
                log.warning("heartbeat: %s", exc)

    # -- lookups used by workers ------------------------------------------------------------

    def configmap_data(self, ns: str, name: str, optional: bool) -> dict[str, str | bytes] | None:
        try:
            cm = self.core.read_namespaced_config_map(name, ns)
        except ApiException as exc:
            if exc.status == 404 and optional:
                return None
            if exc.status == 404:
                raise ConfigError(f'configmap "{name}" not found') from exc
            raise
        data: dict[str, str | bytes] = dict(cm.data or {})
        for k, v in (cm.binary_data or {}).items():
            data[k] = base64.b64decode(v)
        return data

    def secret_data(self, ns: str, name: str, optional: bool) -> dict[str, str | bytes] | None:
        try:
            sec = self.core.read_namespaced_secret(name, ns)
        except ApiException as exc:
            if exc.status == 404 and optional:
                return None
            if exc.status == 404:
                raise ConfigError(f'secret "{name}" not found') from exc
            raise
        return {k: base64.b64decode(v) for k, v in (sec.data or {}).items()}

    def sa_token(self, pod: dict[str, Any], src: dict[str, Any]) -> str:
        """A bound service-account token for the pod (TokenRequest API), as a kubelet gets."""
        sa = pod["spec"].get("serviceAccountName") or "default"
        meta = pod["metadata"]
        body = {"spec": {
            "audiences": [src["audience"]] if src.get("audience") else None,
            "expirationSeconds": int(src.get("expirationSeconds", 3607)),
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                               "uid": meta["uid"]}}}
        try:
            resp = self.core.create_namespaced_service_account_token(sa, meta["namespace"], body)
        except ApiException as exc:
            raise ConfigError(f"token for serviceaccount {sa}: {exc.reason}") from exc
        return str(resp.status.token)

    # -- pods ----------------------------------------------------------------------------------

    def dispatch(self, pod: dict[str, Any], deleted: bool = False) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        uid = meta["uid"]
        with self.lock:
            worker = self.workers.get(uid)
        if deleted:
            if worker is not None:
                worker.mark_gone()
            return
        node = spec.get("nodeName")
        if not node:
            if meta.get("deletionTimestamp") is None:
                self._bind(pod)
            return
        if node != self.node_name:
            return
        if worker is not None:
            worker.update(pod)
            return
        if uid in self.finished or (pod.get("status", {}).get("phase") in ("Succeeded", "Failed")
                                    and meta.get("deletionTimestamp") is None):
            return
        if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
            # Finished before (or under a previous agent) and now deleted: nothing to stop.
            with contextlib.suppress(ApiException):
                self.core.delete_namespaced_pod(meta["name"], meta["namespace"],
                                                grace_period_seconds=0)
            return
        worker = PodWorker(self, pod)
        with self.lock:
            self.workers[uid] = worker
        worker.start()

    def worker_done(self, uid: str) -> None:
        with self.lock:
            self.workers.pop(uid, None)
            self.finished.add(uid)

    def _bind(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        body = {"apiVersion": "v1", "kind": "Binding",
                "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
                "target": {"apiVersion": "v1", "kind": "Node", "name": self.node_name}}
        try:
            # _preload_content=False: the generated client cannot deserialize a Binding reply.
            self.core.create_namespaced_binding(meta["namespace"], body, _preload_content=False)
            log.info("bound %s/%s", meta["namespace"], meta["name"])
        except ApiException as exc:
            if exc.status not in (404, 409):
                log.warning("binding %s/%s: %s", meta["namespace"], meta["name"], exc.reason)

    def watch_pods(self) -> None:
        """List then watch all pods; re-list after a watch expires or errors."""
        while not self.stop_event.is_set():
            try:
                resp = self.core.list_pod_for_all_namespaces(_preload_content=False)
                listing = json.loads(resp.data)
                for pod in listing["items"]:
                    self.dispatch(pod)
                rv = listing["metadata"]["resourceVersion"]
                w: Any = watch.Watch()  # type: ignore[no-untyped-call]
                for event in w.stream(self.core.list_pod_for_all_namespaces, resource_version=rv,
                                      timeout_seconds=120, allow_watch_bookmarks=False):
                    if self.stop_event.is_set():
                        w.stop()
                        break
                    obj = event["raw_object"]
                    if event["type"] == "ERROR":
                        break
                    self.dispatch(obj, deleted=event["type"] == "DELETED")
            except Exception as exc:
                if self.stop_event.is_set():
                    return
                log.warning("pod watch: %s; re-listing", exc)
                time.sleep(0.5)

    def housekeeping(self) -> None:
        """Every second: refresh each pod's /etc/hosts, provision PVs for pending claims; every
        few seconds: refresh Secret/ConfigMap volumes."""
        next_volume_refresh = 0.0
        while not self.stop_event.wait(1.0):
            try:
                pods = json.loads(self.core.list_pod_for_all_namespaces(
                    _preload_content=False).data)["items"]
                services = json.loads(self.core.list_service_for_all_namespaces(
                    _preload_content=False).data)["items"]
                with self.lock:
                    workers = list(self.workers.values())
                by_uid = {p["metadata"]["uid"]: p for p in pods}
                for w in workers:
                    me = by_uid.get(w.uid)
                    if me is not None and w.ip and w.prepared:
                        me = json.loads(json.dumps(me))
                        me.setdefault("status", {})["podIP"] = w.ip
                        w.write_hosts(render_hosts(me, pods, services))
                self._provision_volumes()
                if time.monotonic() >= next_volume_refresh:
                    for w in workers:
                        w.refresh_volumes()
                    next_volume_refresh = time.monotonic() + VOLUME_REFRESH
            except Exception as exc:  # the apiserver may be going away; retry next period
                if not self.stop_event.is_set():
                    log.warning("housekeeping: %s", exc)

    def _provision_volumes(self) -> None:
        """A hostPath PV, pre-bound, for every pending claim; Released ones are removed.

        No provisioner runs in the harness, and a StatefulSet's claims would stay Pending; the
        PV controller (kube-controller-manager) does the actual binding. The data lives in the
        same directory the pods' PVC mounts use (``<state>/pvc/<ns>/<claim>``).
        """
        claims = json.loads(self.core.list_persistent_volume_claim_for_all_namespaces(
            _preload_content=False).data)["items"]
        for pvc in claims:
            meta, spec = pvc["metadata"], pvc["spec"]
            if pvc.get("status", {}).get("phase") != "Pending" or spec.get("volumeName"):
                continue
            path = self.state_dir / "pvc" / meta["namespace"] / meta["name"]
            path.mkdir(parents=True, exist_ok=True)
            size = ((spec.get("resources") or {}).get("requests") or {}).get("storage", "1Gi")
            pv: dict[str, Any] = {"apiVersion": "v1", "kind": "PersistentVolume",
                  "metadata": {"name": f"pv-{meta['uid']}",
                               "labels": {"kvpool.io/e2e-provisioned": "true"}},
                  "spec": {"capacity": {"storage": size},
                           "accessModes": spec.get("accessModes") or ["ReadWriteOnce"],
                           "persistentVolumeReclaimPolicy": "Retain",
                           "storageClassName": spec.get("storageClassName") or "",
                           "volumeMode": spec.get("volumeMode") or "Filesystem",
                           "hostPath": {"path": str(path), "type": "DirectoryOrCreate"},
                           "claimRef": {"namespace": meta["namespace"], "name": meta["name"],
                                        "uid": meta["uid"]}}}
            try:
                self.core.create_persistent_volume(pv)
                log.info("provisioned %s for %s/%s", pv["metadata"]["name"], meta["namespace"],
                         meta["name"])
            except ApiException as exc:
                if exc.status != 409:
                    raise
        pvs = json.loads(self.core.list_persistent_volume(
            label_selector="kvpool.io/e2e-provisioned=true", _preload_content=False).data)["items"]
        for pv in pvs:
            if pv.get("status", {}).get("phase") == "Released":
                with contextlib.suppress(ApiException):
                    self.core.delete_persistent_volume(pv["metadata"]["name"])
                shutil.rmtree(pv["spec"]["hostPath"]["path"], ignore_errors=True)

    def shutdown(self) -> None:
        self.stop_event.set()
        with self.lock:
            workers = list(self.workers.values())
        for w in workers:
            w.stopping = True
        for w in workers:
            w.join(timeout=10)
        shutil.rmtree(self.shm_root, ignore_errors=True)


class _KubeletApi(http.server.BaseHTTPRequestHandler):
    """The one kubelet endpoint worth having here: ``/containerLogs/<ns>/<pod>/<container>``,
    which the apiserver calls for ``kubectl logs`` (with ``tailLines`` and ``follow``)."""

    state_dir: Path
    stop_event: threading.Event

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        url = urllib.parse.urlsplit(self.path)
        parts = url.path.strip("/").split("/")
        query = urllib.parse.parse_qs(url.query)
        if len(parts) != 4 or parts[0] != "containerLogs":
            self.send_error(404, "only /containerLogs/<ns>/<pod>/<container> is served")
            return
        ns, pod, container = parts[1:]
        logs = sorted((self.state_dir / "pods").glob(f"{ns}_{pod}_*/{container}.log"),
                      key=lambda p: p.stat().st_mtime)
        if not logs:
            self.send_error(404, f"no log for container {container} of pod {ns}/{pod}")
            return
        path = logs[-1]
        data = path.read_bytes()
        tail = query.get("tailLines", [""])[0]
        if tail.isdigit():
            data = b"".join(data.splitlines(keepends=True)[-int(tail):]) if int(tail) else b""
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(data)
        if query.get("follow", ["false"])[0] != "true":
            return
        offset = path.stat().st_size
        try:
            while not self.stop_event.is_set() and path.exists():
                with path.open("rb") as fh:
                    fh.seek(offset)
                    chunk = fh.read()
                if chunk:
                    offset += len(chunk)
                    self.wfile.write(chunk)
                    self.wfile.flush()
                time.sleep(0.2)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("kubelet api: " + fmt, *args)


def serve_kubelet_api(agent: Agent, port: int, cert: str, key: str, ca: str) -> None:
    """Serve ``_KubeletApi`` with TLS on 127.0.0.1:port; only CA-signed clients get in."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    ctx.load_verify_locations(ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
    handler = type("KubeletApi", (_KubeletApi,), {"state_dir": agent.state_dir,
                                                  "stop_event": agent.stop_event})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    server.daemon_threads = True
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    agent.kubelet_port = port
    threading.Thread(target=server.serve_forever, name="kubelet-api", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--node-name", default="kvpool-e2e")
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--pod-ip-prefix", default="127.0.10.")
    parser.add_argument("--apiserver-port", type=int, required=True)
    parser.add_argument("--ca-file", required=True)
    parser.add_argument("--run-id", default="local")
    parser.add_argument("--kubelet-port", type=int, default=0, help="0: no kubelet API")
    parser.add_argument("--serving-cert", help="TLS cert of the kubelet API")
    parser.add_argument("--serving-key", help="TLS key of the kubelet API")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(threadName)s %(message)s")
    if os.geteuid() != 0:
        log.error("the node agent needs root (mount namespaces for pod volumes)")
        return 2
    api = config.new_client_from_config(config_file=args.kubeconfig)  # type: ignore[no-untyped-call]
    state = Path(args.state_dir)
    state.mkdir(parents=True, exist_ok=True)
    agent = Agent(api, args.node_name, state, args.pod_ip_prefix, args.apiserver_port,
                  Path(args.ca_file), args.run_id)
    if args.kubelet_port:
        serve_kubelet_api(agent, args.kubelet_port, args.serving_cert, args.serving_key,
                          args.ca_file)
    agent.register()
    stop = stop_on_signals()
    threading.Thread(target=agent.heartbeat, name="heartbeat", daemon=True).start()
    threading.Thread(target=agent.watch_pods, name="pod-watch", daemon=True).start()
    threading.Thread(target=agent.housekeeping, name="housekeeping", daemon=True).start()
    log.info("node %s registered; running pods", args.node_name)
    stop.wait()
    log.info("stopping: killing pod processes")
    agent.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
