"""Typed, validated views of the custom resources (KVPool, KVTier, TenantNamespace).

The API server applies the CRD defaults and CEL rules; this module applies the same defaults
(objects may come from older schemas or from tests) and the checks that span objects (a pool's
tiers must exist and be in order). Every failure is a :class:`SpecError` with a CamelCase reason
and a sentence, which the handlers turn into a Degraded condition instead of a retry loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvpool.core.traffic import DEFAULT_TTL

from .units import parse_bytes, parse_duration

GROUP = "kvpool.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
STORE_DEFAULT_TENANT = "default"
"""The partition a store node keeps tokenless (open-tenancy) callers in."""

POOL_LABEL = "kvpool.io/pool"
"""Opt-in label of pods that want a sidecar: ``name`` (pool in the pod's namespace) or ``namespace.name``."""
INJECTED_ANNOTATION = "kvpool.io/injected"
SKIP_ANNOTATION = "kvpool.io/skip-reason"
FORCE_SCALE_DOWN_ANNOTATION = "kvpool.io/force-scale-down"
STORE_POOL_LABEL = "kvpool.io/store-of"
"""Label of store pods naming their pool (never POOL_LABEL: store pods must not get sidecars)."""

MEDIA = ("dram", "ssd", "sharedfs")


class SpecError(ValueError):
    """A custom resource that cannot be acted on until a person changes it (terminal)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def _get(d: Mapping[str, Any] | None, *path: str, default: Any = None) -> Any:
    cur: Any = d
    for p in path:
        if not isinstance(cur, Mapping) or p not in cur or cur[p] is None:
            return default
        cur = cur[p]
    return cur


T = TypeVar("T")


def _optional(d: Mapping[str, Any] | None, key: str, parse: Callable[[Any], T]) -> T | None:
    """``parse`` of the field ``key`` of ``d``, or None when it is absent (or null)."""
    v = _get(d, key)
    return None if v is None else parse(v)


def _int(v: Any, what: str, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise SpecError("InvalidSpec", f"{what} must be an integer, got {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise SpecError("InvalidSpec", f"{what} must be in [{lo}, {hi}], got {v}")
    return v


def _float(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise SpecError("InvalidSpec", f"{what} must be a number, got {v!r}")
    return float(v)


def _bytes(v: Any, what: str, positive: bool = True) -> int:
    try:
        n = parse_bytes(v, what)
    except ValueError as exc:
        raise SpecError("InvalidSpec", str(exc)) from None
    if positive and n <= 0:
        raise SpecError("InvalidSpec", f"{what} must be positive, got {v!r}")
    return n


def _ttl(doc: Any, what: str) -> dict[str, float]:
    if doc is None:
        return {}
    if not isinstance(doc, Mapping):
        raise SpecError("InvalidSpec", f"{what} must map traffic classes to durations")
    out: dict[str, float] = {}
    for k, v in doc.items():
        try:
            out[str(k)] = parse_duration(v, f"{what}.{k}")
        except ValueError as exc:
            raise SpecError("InvalidSpec", str(exc)) from None
    return out


def pool_key(namespace: str, name: str) -> str:
    """The one spelling of a pool reference: ``namespace.name`` (namespaces contain no dots)."""
    return f"{namespace}.{name}"


def parse_pool_ref(value: str, default_namespace: str | None) -> tuple[str, str] | None:
    """``name`` or ``namespace.name`` → (namespace, name); None when malformed."""
    value = value.strip()
    if not value:
        return None
    if "." in value:
        ns, _, name = value.partition(".")
        return (ns, name) if ns and name else None
    return (default_namespace, value) if default_namespace else None


# ---------------------------------------------------------------------------------------- tiers


@dataclass(frozen=True)
class TierSpec:
    name: str
    medium: str
    capacity_bytes: int | None = None
    memory_fraction: float | None = None
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    write_policy: str = "write-back"
    storage_class: str | None = None
    access_modes: tuple[str, ...] = ("ReadWriteOnce",)
    claim_bytes: int | None = None
    sharedfs_volume: Mapping[str, Any] | None = None
    sharedfs_subpath: str = "kvpool"
    encrypt_at_rest: bool = False
    """Pools using this (ssd or sharedfs) tier encrypt what their nodes write below DRAM."""


def parse_tier(body: Mapping[str, Any]) -> TierSpec:
    name = str(_get(body, "metadata", "name", default=""))
    spec = _get(body, "spec", default={})
    medium = _get(spec, "medium")
    if medium not in MEDIA:
        raise SpecError("InvalidTier", f"KVTier {name}: medium must be one of {', '.join(MEDIA)}, got {medium!r}")
    cap = _get(spec, "capacity", default={})
    has_b, has_f = _get(cap, "bytes") is not None, _get(cap, "memoryFraction") is not None
    if has_b == has_f:
        raise SpecError("InvalidTier", f"KVTier {name}: set exactly one of capacity.bytes and capacity.memoryFraction")
    cap_bytes = _bytes(cap["bytes"], f"KVTier {name} capacity.bytes") if has_b else None
    frac = _float(cap["memoryFraction"], f"KVTier {name} capacity.memoryFraction") if has_f else None
    if frac is not None and (medium != "dram" or not 0 < frac <= 0.95):
        raise SpecError("InvalidTier", f"KVTier {name}: capacity.memoryFraction must be in (0, 0.95] on a dram tier")
    high = _float(_get(spec, "watermarks", "high", default=0.95), f"KVTier {name} watermarks.high")
    low = _float(_get(spec, "watermarks", "low", default=0.85), f"KVTier {name} watermarks.low")
    if not 0 < low < high <= 1:
        raise SpecError("InvalidTier", f"KVTier {name}: watermarks must satisfy 0 < low < high <= 1")
    vc = _get(spec, "volumeClaim")
    shared = _get(spec, "sharedfs")
    if medium == "sharedfs" and not _get(shared, "volume"):
        raise SpecError("InvalidTier", f"KVTier {name}: a sharedfs tier needs spec.sharedfs.volume")
    encrypt = _get(spec, "encryptAtRest", default=False)
    if not isinstance(encrypt, bool):
        raise SpecError("InvalidTier", f"KVTier {name}: encryptAtRest must be true or false, got {encrypt!r}")
    if encrypt and medium == "dram":
        raise SpecError("InvalidTier", f"KVTier {name}: encryptAtRest is for ssd and sharedfs tiers (DRAM is never "
                                       "written to disk)")
    return TierSpec(
        name=name, medium=medium, capacity_bytes=cap_bytes, memory_fraction=frac,
        high_watermark=high, low_watermark=low,
        write_policy=str(_get(spec, "writePolicy", default="write-back")),
        storage_class=_get(vc, "storageClassName"),
        access_modes=tuple(_get(vc, "accessModes", default=["ReadWriteOnce"])),
        claim_bytes=_bytes(vc["size"], f"KVTier {name} volumeClaim.size") if _get(vc, "size") is not None else None,
        sharedfs_volume=_get(shared, "volume"),
        sharedfs_subpath=str(_get(shared, "subPath", default="kvpool")),
        encrypt_at_rest=encrypt,
    )


def builtin_dram_tier(nbytes: int) -> TierSpec:
    return TierSpec(name="(built-in dram)", medium="dram", capacity_bytes=nbytes)


# ---------------------------------------------------------------------------------------- pools


@dataclass(frozen=True)
class SidecarDeadlines:
    """spec.sidecar.deadlines: how long an injected sidecar waits for a store node (its
    ``--match-deadline-ms`` and friends; the defaults are the sidecar's own)."""

    match_ms: int = 100
    read_ms: int = 100
    read_bytes_per_second: int = 100_000_000
    probe_ms: int = 1000
    suspect_backoff_ms: int = 1000


def parse_deadlines(doc: Any) -> SidecarDeadlines:
    if doc is None:
        return SidecarDeadlines()
    if not isinstance(doc, Mapping):
        raise SpecError("InvalidSpec", f"spec.sidecar.deadlines must be an object, got {doc!r}")
    d = SidecarDeadlines()
    w = "spec.sidecar.deadlines"
    return SidecarDeadlines(
        match_ms=_int(_get(doc, "matchMs", default=d.match_ms), f"{w}.matchMs", 1, 60000),
        read_ms=_int(_get(doc, "readMs", default=d.read_ms), f"{w}.readMs", 1, 600000),
        read_bytes_per_second=_int(_get(doc, "readBytesPerSecond", default=d.read_bytes_per_second),
                                   f"{w}.readBytesPerSecond", 0),
        probe_ms=_int(_get(doc, "probeMs", default=d.probe_ms), f"{w}.probeMs", 1, 600000),
        suspect_backoff_ms=_int(_get(doc, "suspectBackoffMs", default=d.suspect_backoff_ms),
                                f"{w}.suspectBackoffMs", 1, 600000))


@dataclass(frozen=True)
class Autoscaling:
    enabled: bool = False
    min_replicas: int = 1
    max_replicas: int = 10
    target_utilization: float = 0.7


@dataclass(frozen=True)
class PoolSpec:
    namespace: str
    name: str
    uid: str = ""
    generation: int = 0
    block_tokens: int = 128
    hash: str = "sha256"
    replicas: int = 1
    tiers: tuple[str, ...] = ()
    replication: int = 1
    port: int = 7400
    metrics_port: int = 7404
    """Port of the store nodes' /metrics (``spec.storage.metricsPort``; 0: off)."""
    image: str | None = None
    resources: Mapping[str, Any] = field(default_factory=dict)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    local_bytes: int = 256 << 20
    sidecar_image: str | None = None
    sidecar_resources: Mapping[str, Any] = field(default_factory=dict)
    drain_seconds: int = 20
    deadlines: SidecarDeadlines = SidecarDeadlines()
    """spec.sidecar.deadlines (passed to the injected sidecars' arguments)."""
    allowed_namespaces: tuple[str, ...] = ()
    ttl_seconds: Mapping[str, float] = field(default_factory=dict)
    window: int = 128
    rollback: int = 6
    autoscaling: Autoscaling = Autoscaling()
    grace_period_seconds: int = 60
    member_unready_grace_seconds: int | None = None
    """spec.storage.memberUnreadyGraceSeconds: how long a not-ready store pod keeps its ring
    place (None: the operator-wide setting)."""
    utilization_limit: float = 0.8
    drain_bytes_per_second: int = 0
    """Bound on each leaving node's push rate during a scale-down drain (0: unbounded)."""
    warm_bytes_per_second: int = 0
    """spec.scaleUp.warmBandwidth: bound on each previous owner's warm-up push rate (0: unbounded)."""
    warm_fraction: float = 1.0
    """spec.scaleUp.warmFraction: share of the moved bytes pushed, hottest first (0: no push)."""
    warm_seconds: int = 300
    """spec.scaleUp.warmDeadlineSeconds: how long the warm-up push may run."""
    default_tenant: str | None = None
    force_scale_down: bool = False
    encryption: bool = False
    """spec.storage.encryption.enabled: encrypt the tiers below DRAM whatever the tiers say."""
    encryption_secret: str | None = None
    """spec.storage.encryption.secretName: the user's master-key Secret (else the operator mints one)."""
    plaintext_data_session: bool = False
    """spec.security.dataSession: Plaintext (the store nodes' ``--plaintext-data-session``)."""
    router_enabled: bool = False
    """spec.router.enabled: run ``kvpool router-api`` for the pool (Deployment + Service)."""
    router_replicas: int = 1
    router_allowed_from: tuple[Mapping[str, Any], ...] | None = None
    """spec.router.allowedFrom: NetworkPolicy peers that may reach the router API and the KV-event
    ports (None: unset, pods of the pool's namespace)."""
    events_tenant: str | None = None
    """spec.router.events: the tenant whose block events the store nodes publish (None: no events).
    The pool's default tenant is the store's ``default`` partition."""

    @property
    def key(self) -> str:
        return pool_key(self.namespace, self.name)

    @property
    def transfer_port(self) -> int:
        return self.port + 1

    @property
    def events_port(self) -> int:
        return self.port + 2

    @property
    def events_replay_port(self) -> int:
        return self.port + 3


def _truthy(v: Any) -> bool:
    return str(v).strip().lower() not in ("", "0", "false", "no", "off")


def parse_pool(body: Mapping[str, Any]) -> PoolSpec:
    meta = _get(body, "metadata", default={})
    ns, name = str(_get(meta, "namespace", default="default")), str(_get(meta, "name", default=""))
    spec = _get(body, "spec", default={})
    st = _get(spec, "storage", default={})
    sc = _get(spec, "sidecar", default={})
    au = _get(spec, "autoscaling", default={})
    sd = _get(spec, "scaleDown", default={})
    su = _get(spec, "scaleUp", default={})
    replicas = _int(_get(st, "replicas", default=1), "spec.storage.replicas", 0, 1000)
    replication = _int(_get(st, "replication", default=1), "spec.storage.replication", 1, 5)
    if replicas and replication > replicas:
        raise SpecError("InvalidSpec", f"spec.storage.replication ({replication}) exceeds spec.storage.replicas "
                                       f"({replicas})")
    auto = Autoscaling(
        enabled=bool(_get(au, "enabled", default=False)),
        min_replicas=_int(_get(au, "minReplicas", default=1), "spec.autoscaling.minReplicas", 1),
        max_replicas=_int(_get(au, "maxReplicas", default=10), "spec.autoscaling.maxReplicas", 1),
        target_utilization=_float(_get(au, "targetUtilization", default=0.7), "spec.autoscaling.targetUtilization"))
    if auto.min_replicas > auto.max_replicas:
        raise SpecError("InvalidSpec", "spec.autoscaling.minReplicas must not exceed spec.autoscaling.maxReplicas")
    if not 0 < auto.target_utilization < 1:
        raise SpecError("InvalidSpec", "spec.autoscaling.targetUtilization must be in (0, 1)")
    limit = _float(_get(sd, "utilizationLimit", default=0.8), "spec.scaleDown.utilizationLimit")
    if not 0 < limit <= 1:
        raise SpecError("InvalidSpec", "spec.scaleDown.utilizationLimit must be in (0, 1]")
    warm_fraction = _float(_get(su, "warmFraction", default=1.0), "spec.scaleUp.warmFraction")
    if not 0 <= warm_fraction <= 1:
        raise SpecError("InvalidSpec", "spec.scaleUp.warmFraction must be in [0, 1]")
    warm_seconds = _int(_get(su, "warmDeadlineSeconds", default=300), "spec.scaleUp.warmDeadlineSeconds", 0, 86400)
    if warm_fraction > 0 and warm_seconds == 0:
        raise SpecError("InvalidSpec", "spec.scaleUp.warmDeadlineSeconds must be above 0 unless warmFraction is 0")
    ttl = dict(DEFAULT_TTL)
    ttl.update(_get(spec, "ttl", default={}) or {})
    tiers = _get(st, "tiers", default=[]) or []
    enc = _get(st, "encryption", default={})
    enc_on = _get(enc, "enabled", default=False)
    if not isinstance(enc_on, bool):
        raise SpecError("InvalidSpec", f"spec.storage.encryption.enabled must be true or false, got {enc_on!r}")
    if len(set(tiers)) != len(tiers):
        raise SpecError("InvalidSpec", "spec.storage.tiers lists a tier twice")
    rt = _get(spec, "router", default={})
    default_tenant = _get(spec, "tenancy", "defaultTenant") or None
    events_tenant = None
    if _get(rt, "events", "enabled", default=False):
        events_tenant = _get(rt, "events", "tenant")
        if not events_tenant:
            raise SpecError("InvalidSpec", "spec.router.events needs a tenant")
        if events_tenant == default_tenant:
            events_tenant = STORE_DEFAULT_TENANT  # tokenless callers are the store's default partition
    return PoolSpec(
        namespace=ns, name=name, uid=str(_get(meta, "uid", default="")),
        generation=int(_get(meta, "generation", default=0)),
        block_tokens=_int(_get(spec, "blockTokens", default=128), "spec.blockTokens", 1, 65536),
        hash=str(_get(spec, "hash", default="sha256")),
        replicas=replicas, tiers=tuple(str(t) for t in tiers), replication=replication,
        port=_int(_get(st, "port", default=7400), "spec.storage.port", 1024, 65534),
        metrics_port=_int(_get(st, "metricsPort", default=7404), "spec.storage.metricsPort", 0, 65535),
        image=_get(st, "image"), resources=_get(st, "resources", default={}),
        node_selector=_get(st, "nodeSelector", default={}), tolerations=tuple(_get(st, "tolerations", default=[])),
        local_bytes=_bytes(_get(sc, "localBytes", default="256Mi"), "spec.sidecar.localBytes"),
        sidecar_image=_get(sc, "image"), sidecar_resources=_get(sc, "resources", default={}),
        drain_seconds=_int(_get(sc, "drainSeconds", default=20), "spec.sidecar.drainSeconds", 0, 3600),
        deadlines=parse_deadlines(_get(sc, "deadlines")),
        allowed_namespaces=tuple(_get(sc, "namespaces", default=[])),
        ttl_seconds=_ttl(ttl, "spec.ttl"),
        window=_int(_get(spec, "stateObjects", "window", default=128), "spec.stateObjects.window", 0),
        rollback=_int(_get(spec, "stateObjects", "rollback", default=6), "spec.stateObjects.rollback", 0),
        autoscaling=auto,
        grace_period_seconds=_int(_get(sd, "gracePeriodSeconds", default=60), "spec.scaleDown.gracePeriodSeconds",
                                  0, 86400),
        member_unready_grace_seconds=_optional(
            st, "memberUnreadyGraceSeconds", lambda v: _int(v, "spec.storage.memberUnreadyGraceSeconds", 0, 3600)),
        utilization_limit=limit,
        drain_bytes_per_second=_optional(
            sd, "drainBandwidth", lambda v: _bytes(v, "spec.scaleDown.drainBandwidth", positive=False)) or 0,
        warm_bytes_per_second=_optional(
            su, "warmBandwidth", lambda v: _bytes(v, "spec.scaleUp.warmBandwidth", positive=False)) or 0,
        warm_fraction=warm_fraction, warm_seconds=warm_seconds,
        default_tenant=default_tenant,
        force_scale_down=_truthy(_get(meta, "annotations", FORCE_SCALE_DOWN_ANNOTATION, default="")),
        encryption=enc_on, encryption_secret=_get(enc, "secretName") or None,
        plaintext_data_session=_data_session(_get(spec, "security", "dataSession", default="Encrypted")),
        router_enabled=bool(_get(rt, "enabled", default=False)),
        router_replicas=_int(_get(rt, "replicas", default=1), "spec.router.replicas", 1, 16),
        router_allowed_from=_peers(_get(rt, "allowedFrom"), "spec.router.allowedFrom"),
        events_tenant=events_tenant,
    )


def _data_session(value: Any) -> bool:
    """spec.security.dataSession → plaintext? (the CRD's enum; a body that bypassed it fails here)."""
    if value not in ("Encrypted", "Plaintext"):
        raise SpecError("InvalidSpec", f"spec.security.dataSession must be Encrypted or Plaintext, got {value!r}")
    return bool(value == "Plaintext")


def is_peer_list(value: Any) -> bool:
    """A list of NetworkPolicy peers: non-empty objects (their inside is the API server's to check)."""
    return isinstance(value, list) and all(isinstance(p, Mapping) and p for p in value)


def _peers(value: Any, where: str) -> tuple[Mapping[str, Any], ...] | None:
    """NetworkPolicy peers as given (the CRD schema checks their shape); None when unset."""
    if value is None:
        return None
    if not is_peer_list(value):
        raise SpecError("InvalidSpec", f"{where} must be a list of NetworkPolicy peers")
    return tuple(value)


def wants_encryption(pool: PoolSpec, tiers: Mapping[str, TierSpec]) -> bool:
    """Encryption at rest is on when the pool asks for it or one of its tiers below DRAM does."""
    return pool.encryption or any(tiers[t].encrypt_at_rest for t in pool.tiers
                                  if t in tiers and tiers[t].medium != "dram")


@dataclass(frozen=True)
class NodeLayout:
    """What each store node of a pool holds, resolved from the pool's KVTiers."""

    dram: TierSpec
    dram_bytes: int
    ssd: TierSpec | None = None
    sharedfs: TierSpec | None = None
    memory_limit_bytes: int | None = None
    """The store container's memory limit (from the pool's resources or sized from the DRAM tier)."""
    encrypt_at_rest: bool = False
    """The nodes get the pool's master key and encrypt what they write to the SSD/shared fs."""

    @property
    def capacity_bytes(self) -> int:
        """Per node, all tiers but the shared filesystem (shared by all nodes, not per-node)."""
        return self.dram_bytes + ((self.ssd.capacity_bytes or 0) if self.ssd else 0)

    @property
    def tier_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in (self.dram, self.ssd, self.sharedfs) if t is not None)


def resolve_layout(pool: PoolSpec, tiers: Mapping[str, TierSpec], default_dram_bytes: int,
                   memory_overhead: int) -> NodeLayout:
    """The node layout of a pool; TierNotFound / InvalidTiers when its tier list cannot work."""
    if not pool.tiers:
        listed = [builtin_dram_tier(default_dram_bytes)]
    else:
        missing = [t for t in pool.tiers if t not in tiers]
        if missing:
            raise SpecError("TierNotFound", f"KVTier {', '.join(missing)} not found")
        listed = [tiers[t] for t in pool.tiers]
    media = [t.medium for t in listed]
    if media[0] != "dram":
        raise SpecError("InvalidTiers", f"the first tier must be a dram tier, {listed[0].name} is {media[0]}")
    order = {m: i for i, m in enumerate(MEDIA)}
    if len(set(media)) != len(media) or [order[m] for m in media] != sorted(order[m] for m in media):
        raise SpecError("InvalidTiers", "spec.storage.tiers must be one dram tier, then at most one ssd tier, then "
                                        f"at most one sharedfs tier; got {', '.join(media)}")
    by = {t.medium: t for t in listed}
    dram = by["dram"]
    user_limit = _get(pool.resources, "limits", "memory")
    limit = _bytes(user_limit, "spec.storage.resources.limits.memory") if user_limit is not None else None
    if dram.memory_fraction is not None:
        if limit is None:
            raise SpecError("InvalidTiers", f"KVTier {dram.name} sizes DRAM as a fraction of the memory limit; "
                                            "set spec.storage.resources.limits.memory")
        dram_bytes = int(limit * dram.memory_fraction)
    else:
        assert dram.capacity_bytes is not None
        dram_bytes = dram.capacity_bytes
        if limit is not None and limit < dram_bytes:
            raise SpecError("InvalidTiers", f"spec.storage.resources.limits.memory is below the DRAM tier "
                                            f"{dram.name} ({dram_bytes} bytes)")
    if limit is None:
        limit = dram_bytes + memory_overhead
    return NodeLayout(dram=dram, dram_bytes=dram_bytes, ssd=by.get("ssd"), sharedfs=by.get("sharedfs"),
                      memory_limit_bytes=limit, encrypt_at_rest=wants_encryption(pool, tiers))


# -------------------------------------------------------------------------------------- tenants


@dataclass(frozen=True)
class TenantPool:
    namespace: str
    name: str
    quota_bytes: int = 0
    ttl_seconds: Mapping[str, float] = field(default_factory=dict)
    evict_own_on_quota: bool = False

    @property
    def key(self) -> str:
        return pool_key(self.namespace, self.name)


@dataclass(frozen=True)
class TenantSpec:
    name: str
    tenant_id: str
    namespaces: tuple[str, ...]
    pools: tuple[TenantPool, ...] = ()
    uid: str = ""
    generation: int = 0

    @property
    def secret_name(self) -> str:
        return secret_name(self.tenant_id)

    def pool(self, key: str) -> TenantPool | None:
        return next((p for p in self.pools if p.key == key), None)


def secret_name(tenant_id: str) -> str:
    return f"kvpool-tenant-{tenant_id}"


def parse_tenant(body: Mapping[str, Any]) -> TenantSpec:
    meta = _get(body, "metadata", default={})
    name = str(_get(meta, "name", default=""))
    spec = _get(body, "spec", default={})
    tid = _get(spec, "tenantId")
    if not isinstance(tid, str) or not tid:
        raise SpecError("InvalidSpec", f"TenantNamespace {name}: spec.tenantId is required")
    nss = _get(spec, "namespaces", default=[])
    if not nss:
        raise SpecError("InvalidSpec", f"TenantNamespace {name}: spec.namespaces must list at least one namespace")
    pools = []
    for i, p in enumerate(_get(spec, "pools", default=[])):
        ref = parse_pool_ref(str(_get(p, "pool", default="")), None)
        if ref is None:
            raise SpecError("InvalidSpec", f"TenantNamespace {name}: spec.pools[{i}].pool must be namespace.name")
        quota = _get(p, "quotaBytes")
        pools.append(TenantPool(
            namespace=ref[0], name=ref[1],
            quota_bytes=_bytes(quota, f"spec.pools[{i}].quotaBytes") if quota is not None else 0,
            ttl_seconds=_ttl(_get(p, "ttl"), f"spec.pools[{i}].ttl"),
            evict_own_on_quota=bool(_get(p, "evictOwnOnQuota", default=False))))
    return TenantSpec(name=name, tenant_id=tid, namespaces=tuple(str(n) for n in nss), pools=tuple(pools),
                      uid=str(_get(meta, "uid", default="")), generation=int(_get(meta, "generation", default=0)))
