"""Operator settings: one dataclass, each field documented; built from the CLI in ``main``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Settings:
    """What the operator needs to know beyond the custom resources."""

    image: str = "ghcr.io/kvpool/kvpool:0.1.0"
    """Image of store nodes and sidecars when a KVPool names none (one image serves all roles)."""
    image_pull_policy: str = "IfNotPresent"
    """Pull policy of the containers the operator creates or injects."""
    command: tuple[str, ...] = ("kvpool",)
    """Entry point of the image; the role (``store``, ``sidecar``) is appended."""
    namespace: str = "kvpool-system"
    """Namespace the operator runs in (its own Secrets, Events about the cluster)."""
    default_dram_bytes: int = 1 << 30
    """DRAM per store node of a pool that lists no tiers (the built-in DRAM tier)."""
    store_memory_overhead_bytes: int = 256 << 20
    """Memory of a store container beyond its DRAM tier: index, gRPC, Python."""
    store_cpu_request: str = "100m"
    """CPU request of a store container whose pool sets none."""
    shm_slack_bytes: int = 16 << 20
    """Added to the sidecar's local tier for the size limit of the pod's /run/kvpool emptyDir."""
    socket_dir: str = "/run/kvpool"
    """Mount path of the shared-memory emptyDir in the sidecar and the app containers."""
    socket_name: str = "kvpool.sock"
    """The sidecar's unix socket inside :attr:`socket_dir`."""
    credentials_dir: str = "/etc/kvpool/tenant"
    """Mount path of the tenant credential Secret in the sidecar."""
    sidecar_metrics_port: int = 7461
    """Prometheus port of injected sidecars; 0 leaves metrics off."""
    sidecar_handoff_port: int = 7460
    """Port on the pod IP where injected sidecars export state objects to decode sidecars (the
    prefill → decode handoff); 0: no export (decode sides then take the state from the pool)."""
    termination_margin_seconds: int = 5
    """Added to the sidecar drain time for a pod's terminationGracePeriodSeconds."""
    reconcile_interval_seconds: float = 10.0
    """Period of the KVPool timer: ring, stats, drain progress, drift repair."""
    tenant_interval_seconds: float = 30.0
    """Period of the TenantNamespace timer: Secrets and usage in status."""
    node_timeout_seconds: float = 5.0
    """Deadline of one admin call to a store node."""
    drain_overrun_seconds: float = 30.0
    """A drain still running this long after its deadline is ended by the operator."""
    member_unready_grace_seconds: float = 15.0
    """A ring member whose pod went not-ready stays a member this long (a readiness flap or a
    container restart does not move its keys twice); a deleted pod leaves at once.  0: at once."""
    autoscale_cooldown_seconds: float = 60.0
    """The autoscaler changes a pool's size at most this often (user changes are not delayed)."""
    network_policy: bool = True
    """Render a NetworkPolicy per pool (kvpool_operator.netpolicy); off: none, and those made before go."""
    tls: bool = True
    """Issue each pool a CA (``<pool>-ca``) and certificates, serve the store nodes and the router
    with TLS, mount each injected sidecar its tenant's certificate and call the nodes' admin API
    with the operator's client certificate (kvpool_operator.pool_tls). Off (``--no-tls``): every
    channel in plaintext, as before issue 23."""
    tls_dir: str = "/var/run/kvpool-operator/tls"
    """Where the operator keeps its client certificate of each pool (``<namespace>/<pool>/``)."""
    tls_ca_propagation_seconds: float = 600.0
    """How long a pool's new CA is only trusted before it signs (kvpool_operator.certs: the
    rotation's first step must reach every mounted copy of the bundle first)."""
    operator_pod_labels: dict[str, str] = field(default_factory=lambda: {
        "app.kubernetes.io/name": "kvpool", "app.kubernetes.io/component": "operator"})
    """Labels of the operator's own pods (in :attr:`namespace`): the pools' policies admit them to
    the store nodes' control port (admin calls)."""
    metrics_from: tuple[dict[str, Any], ...] = (
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},)
    """NetworkPolicy peers that may scrape the store nodes' ``metrics`` port (empty: nobody)."""
    store_labels: dict[str, str] = field(default_factory=dict)
    """Extra labels on every store pod (e.g. for network policies)."""

    @property
    def socket_path(self) -> str:
        return f"{self.socket_dir}/{self.socket_name}"

    @property
    def client_address(self) -> str:
        """What app containers get as KVPOOL_ADDRESS."""
        return f"unix://{self.socket_path}"
