"""The sidecar injection patch (DESIGN §8, issue 5 §3). Pure: (pod, pool, tenant binding) → patch.

A pod labelled kvpool.io/pool gets a native sidecar (an init container with restartPolicy
Always running ``kvpool sidecar``, ready when its socket exists), a shared-memory emptyDir at
/run/kvpool in the sidecar and every app container, KVPOOL_ADDRESS, its tenant's credential
Secret, the pool's seed addresses and a termination grace covering the sidecar's drain.

Rules: idempotent (the ``kvpool.io/injected`` annotation, or a sidecar already there, means
"leave it"); every skip says why in ``kvpool.io/skip-reason``; a value the user set (an env var,
a volume or container of the same name, a longer grace) is never overwritten.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.core.sizing import sidecar_shm_bytes

from .certs import default_tenant_namespaces, default_tenant_tls_secret_name, tenant_tls_secret_name
from .children import TLS_DIR, service_address, tls_args
from .engines import (
    CLIENT_VOLUME,
    ENGINE_NOTE_ANNOTATION,
    EngineAnnotationError,
    EnginePlan,
    apply_to_container,
    copy_container,
    plan_engine,
)
from .membership import ring_from_status, seed_addresses
from .model import (
    INJECTED_ANNOTATION,
    POOL_LABEL,
    SKIP_ANNOTATION,
    PoolSpec,
    SidecarDeadlines,
    TenantSpec,
    parse_pool,
    parse_pool_ref,
)
from .podsecurity import container_security_context
from .settings import Settings
from .units import memory_volume_limit

SIDECAR_NAME = "kvpool-sidecar"
SHM_VOLUME = "kvpool-shm"
TENANT_VOLUME = "kvpool-tenant"
TLS_VOLUME = "kvpool-tls"
"""Mounted at children.TLS_DIR: the tenant's certificate of the pool and the pool's CA bundle."""
OPT_OUT_ANNOTATION = "kvpool.io/inject"
DEFAULT_GRACE = 30  # Kubernetes' default terminationGracePeriodSeconds


@dataclass(frozen=True)
class PoolView:
    """What injection needs of a pool (kept in the webhook's index, so any replica can answer)."""

    namespace: str
    name: str
    local_bytes: int
    drain_seconds: int
    block_tokens: int = 128
    image: str | None = None
    resources: Mapping[str, Any] = field(default_factory=dict)
    allowed_namespaces: tuple[str, ...] = ()
    default_tenant: str | None = None
    seeds: tuple[str, ...] = ()
    deadlines: SidecarDeadlines = SidecarDeadlines()

    @property
    def key(self) -> str:
        return f"{self.namespace}.{self.name}"


def pool_view(pool: PoolSpec, status: Mapping[str, Any] | None) -> PoolView:
    seeds = seed_addresses(ring_from_status(status), service_address(pool))
    return PoolView(pool.namespace, pool.name, pool.local_bytes, pool.drain_seconds, pool.block_tokens,
                    pool.sidecar_image, dict(pool.sidecar_resources), pool.allowed_namespaces, pool.default_tenant,
                    tuple(seeds), pool.deadlines)


def pool_view_from_body(body: Mapping[str, Any]) -> PoolView:
    return pool_view(parse_pool(body), body.get("status"))


@dataclass(frozen=True)
class Injection:
    injected: bool
    reason: str
    """CamelCase: Injected, AlreadyInjected, OptedOut, InvalidPoolLabel, NoSuchPool, NamespaceNotAllowed,
    NoTenant, NoCertificate, TenantConflict, TenantNotAdmitted, InvalidEngineAnnotation."""
    message: str
    patch: dict[str, Any]
    """A merge patch of the pod (lists given whole)."""
    tenant: str | None = None


def _skip(reason: str, message: str, annotations: Mapping[str, str]) -> Injection:
    value = f"{reason}: {message}"
    patch: dict[str, Any] = {}
    if annotations.get(SKIP_ANNOTATION) != value:
        patch = {"metadata": {"annotations": {SKIP_ANNOTATION: value}}}
    return Injection(False, reason, message, patch)


def _has_env(container: Mapping[str, Any], name: str) -> bool:
    return any(e.get("name") == name for e in container.get("env") or [])


def plan_injection(pod: Mapping[str, Any], namespace: str, pools: Mapping[tuple[str, str], PoolView],
                   bindings: Sequence[TenantSpec], settings: Settings) -> Injection:
    """Decide and build the patch for one pod being created in ``namespace``.

    ``pools``: known pools by (namespace, name); ``bindings``: the TenantNamespaces that list
    ``namespace`` (more than one tenant is a conflict).
    """
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    annotations: Mapping[str, str] = meta.get("annotations") or {}
    labels: Mapping[str, str] = meta.get("labels") or {}
    inits: list[dict[str, Any]] = list(spec.get("initContainers") or [])
    containers: list[dict[str, Any]] = list(spec.get("containers") or [])

    if INJECTED_ANNOTATION in annotations:
        return _skip("AlreadyInjected", f"annotation {INJECTED_ANNOTATION} is set", annotations)
    if any(c.get("name") == SIDECAR_NAME for c in inits + containers):
        return _skip("AlreadyInjected", f"the pod already has a container named {SIDECAR_NAME}", annotations)
    if str(annotations.get(OPT_OUT_ANNOTATION, "")).lower() in ("false", "no", "off", "0"):
        return _skip("OptedOut", f"annotation {OPT_OUT_ANNOTATION}={annotations[OPT_OUT_ANNOTATION]}", annotations)
    ref = parse_pool_ref(str(labels.get(POOL_LABEL, "")), namespace)
    if ref is None:
        return _skip("InvalidPoolLabel", f"label {POOL_LABEL} must be <name> or <namespace>.<name>, "
                                         f"got {labels.get(POOL_LABEL)!r}", annotations)
    pool = pools.get(ref)
    if pool is None:
        return _skip("NoSuchPool", f"KVPool {ref[1]} not found in namespace {ref[0]}", annotations)
    if pool.allowed_namespaces and namespace not in pool.allowed_namespaces:
        return _skip("NamespaceNotAllowed", f"KVPool {pool.key} admits pods of {', '.join(pool.allowed_namespaces)} "
                                            f"only", annotations)
    tenant_ids = sorted({b.tenant_id for b in bindings})
    tenant: TenantSpec | None = None
    if len(tenant_ids) > 1:
        return _skip("TenantConflict", f"namespace {namespace} is bound to several tenants: {', '.join(tenant_ids)}",
                     annotations)
    if tenant_ids:
        tenant = next((b for b in bindings if b.pool(pool.key) is not None), None)
        if tenant is None:
            return _skip("TenantNotAdmitted", f"tenant {tenant_ids[0]} of namespace {namespace} does not list pool "
                                              f"{pool.key} in its TenantNamespace", annotations)
    elif pool.default_tenant is None:
        return _skip("NoTenant", f"namespace {namespace} is bound to no TenantNamespace and KVPool {pool.key} admits "
                                 "no default tenant (spec.tenancy.defaultTenant)", annotations)
    elif settings.tls and namespace not in default_tenant_namespaces(pool.namespace, pool.allowed_namespaces):
        # A sidecar without the pool's certificate could not reach a store node: none is injected.
        return _skip("NoCertificate", f"KVPool {pool.key} issues its default tenant's certificate only in its own "
                                      f"namespace and those of spec.sidecar.namespaces: list {namespace} there, or "
                                      "bind it with a TenantNamespace", annotations)
    try:
        engine = plan_engine(annotations, containers, settings.client_address)
    except EngineAnnotationError as exc:
        return _skip("InvalidEngineAnnotation", str(exc), annotations)
    return _inject(pod, pool, tenant, inits, containers, settings, engine)


_DEADLINE_FLAGS = (("match_ms", "--match-deadline-ms"), ("read_ms", "--read-deadline-ms"),
                   ("read_bytes_per_second", "--read-bytes-per-second"), ("probe_ms", "--probe-deadline-ms"),
                   ("suspect_backoff_ms", "--suspect-backoff-ms"))


def deadline_args(d: SidecarDeadlines) -> list[str]:
    """The sidecar flags of the pool's deadlines that differ from the sidecar's defaults (a pool
    that sets none injects the same arguments as before the setting existed)."""
    default = SidecarDeadlines()
    out: list[str] = []
    for attr, flag in _DEADLINE_FLAGS:
        if getattr(d, attr) != getattr(default, attr):
            out += [flag, str(getattr(d, attr))]
    return out


def sidecar_container(pool: PoolView, tenant: TenantSpec | None, settings: Settings) -> dict[str, Any]:
    args = ["--socket", settings.socket_path, "--pool", ",".join(pool.seeds), "--local", str(pool.local_bytes),
            "--drain-seconds", str(pool.drain_seconds)]
    mounts: list[dict[str, Any]] = [{"name": SHM_VOLUME, "mountPath": settings.socket_dir}]
    if tenant is not None:
        args += ["--tenant", tenant.tenant_id, "--credentials", f"{settings.credentials_dir}/credentials.json"]
        mounts.append({"name": TENANT_VOLUME, "mountPath": settings.credentials_dir, "readOnly": True})
    if settings.tls:
        args += tls_args(pool.name, pool.namespace)
        mounts.append({"name": TLS_VOLUME, "mountPath": TLS_DIR, "readOnly": True})
    if settings.sidecar_metrics_port:
        # On the pod IP, not 0.0.0.0 (the harness runs pods as processes sharing one host).
        args += ["--metrics-port", str(settings.sidecar_metrics_port), "--metrics-addr", "$(POD_IP)"]
    args += deadline_args(pool.deadlines)
    env = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]
    if settings.sidecar_handoff_port:
        # Prefill → decode handoff: the state object is read point to point from this pod.
        addr = f"$(POD_IP):{settings.sidecar_handoff_port}"
        args += ["--handoff-listen", addr, "--handoff-advertise", addr]
    if settings.sidecar_handoff_port or settings.sidecar_metrics_port:
        env.insert(0, {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    c: dict[str, Any] = {
        "name": SIDECAR_NAME,
        "image": pool.image or settings.image,
        "imagePullPolicy": settings.image_pull_policy,
        # A native sidecar: starts before the app containers, stops after them (so it can drain).
        "restartPolicy": "Always",
        "command": [*settings.command, "sidecar"],
        "args": args,
        "env": env,
        "startupProbe": {"exec": {"command": ["test", "-S", settings.socket_path]},
                         "periodSeconds": 1, "failureThreshold": 120},
        "securityContext": container_security_context(),
        "volumeMounts": mounts,
    }
    ports = []
    if settings.sidecar_metrics_port:
        ports.append({"name": "kvpool-metrics", "containerPort": settings.sidecar_metrics_port})
    if settings.sidecar_handoff_port:
        ports.append({"name": "kvpool-handoff", "containerPort": settings.sidecar_handoff_port})
    if ports:
        c["ports"] = ports
    if pool.resources:
        c["resources"] = dict(pool.resources)
    return c


def _inject(pod: Mapping[str, Any], pool: PoolView, tenant: TenantSpec | None, inits: list[dict[str, Any]],
            containers: list[dict[str, Any]], settings: Settings, engine: EnginePlan | None = None) -> Injection:
    spec = pod.get("spec") or {}
    volumes: list[dict[str, Any]] = list(spec.get("volumes") or [])
    names = {v.get("name") for v in volumes}
    if SHM_VOLUME not in names:
        volumes.append({"name": SHM_VOLUME, "emptyDir": {
            "medium": "Memory", "sizeLimit": memory_volume_limit(
                sidecar_shm_bytes(pool.local_bytes) + settings.shm_slack_bytes)}})
    if tenant is not None and TENANT_VOLUME not in names:
        # 0444: the files are root's (the engine's pod sets no fsGroup for us), and the sidecar
        # runs as the image's user; every container of the pod is the tenant's anyway.
        volumes.append({"name": TENANT_VOLUME, "secret": {"secretName": tenant.secret_name, "defaultMode": 0o444}})
    if settings.tls and TLS_VOLUME not in names:
        # The tenant's certificate of the pool, or the default tenant's (plan_injection checked
        # the pool issues one in this namespace); 0444 as the credentials, mounted in the sidecar only.
        secret = (tenant_tls_secret_name(pool.namespace, pool.name) if tenant is not None
                  else default_tenant_tls_secret_name(pool.namespace, pool.name))
        volumes.append({"name": TLS_VOLUME, "secret": {"secretName": secret, "defaultMode": 0o444}})
    engine_inits: list[dict[str, Any]] = []
    if engine is not None and engine.copy_client:
        if CLIENT_VOLUME not in names:
            volumes.append({"name": CLIENT_VOLUME, "emptyDir": {}})
        engine_inits.append(copy_container(pool.image or settings.image, settings.image_pull_policy))

    new_containers = []
    for c in containers:
        c = dict(c)
        mounts = list(c.get("volumeMounts") or [])
        if not any(m.get("name") == SHM_VOLUME or m.get("mountPath") == settings.socket_dir for m in mounts):
            mounts.append({"name": SHM_VOLUME, "mountPath": settings.socket_dir})
        c["volumeMounts"] = mounts
        env = list(c.get("env") or [])
        for name, value in (("KVPOOL_ADDRESS", settings.client_address),
                            ("KVPOOL_BLOCK_TOKENS", str(pool.block_tokens))):
            if not _has_env(c, name):
                env.append({"name": name, "value": value})
        c["env"] = env
        new_containers.append(apply_to_container(engine, c) if engine is not None else c)

    spec_patch: dict[str, Any] = {
        # First, so that the user's own init containers can already use the pool.
        "initContainers": [sidecar_container(pool, tenant, settings), *engine_inits, *inits],
        "containers": new_containers,
        "volumes": volumes,
    }
    grace = spec.get("terminationGracePeriodSeconds")
    need = pool.drain_seconds + settings.termination_margin_seconds
    if (grace if grace is not None else DEFAULT_GRACE) < need:
        spec_patch["terminationGracePeriodSeconds"] = need
    annotations: dict[str, Any] = {INJECTED_ANNOTATION: pool.key}
    if engine is not None:
        annotations[ENGINE_NOTE_ANNOTATION] = engine.note()
    if SKIP_ANNOTATION in ((pod.get("metadata") or {}).get("annotations") or {}):
        annotations[SKIP_ANNOTATION] = None  # copied from a template that was skipped before
    who = f"tenant {tenant.tenant_id}" if tenant else f"default tenant {pool.default_tenant}"
    return Injection(True, "Injected", f"sidecar of KVPool {pool.key} for {who}",
                     {"metadata": {"annotations": annotations}, "spec": spec_patch},
                     tenant.tenant_id if tenant else pool.default_tenant)
