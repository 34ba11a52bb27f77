"""``kvpool operator``: run the operator (kopf) with its webhook, peering, liveness and metrics.

    kvpool operator [--namespace NS] [--watch-namespace NS ...] [--image IMAGE]
                    [--webhook-port 9443 --webhook-cert F --webhook-key F [--webhook-host H]
                     [--webhook-addr A] [--webhook-ca F] [--webhook-managed NAME]]
                    [--peering NAME | --standalone] [--liveness URL] [--metrics-port N] [--metrics-addr A]

Certificates are given as files (kopf's self-signed generation needs oscrypto, which is not
usable here; the Helm chart or cert-manager provides them).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

from . import metrics
from .kube import Kube, KubeError
from .model import is_peer_list
from .nodes import Nodes
from .runtime import Runtime
from .settings import Settings

log = logging.getLogger("kvpool.operator")
PEERING_CRD = "clusterkopfpeerings.kopf.dev"
NAMESPACED_PEERING_CRD = "kopfpeerings.kopf.dev"
PEERING_LIFETIME_SECONDS = 15
"""How long a replica's peering record counts as alive.  A replica that replaces a killed one
of higher priority pauses until the dead one's record expires: with kopf's 60 s, deleting a
KVTier right after an operator pod was killed waited a minute for its finalizer (seen in CI).
Live replicas refresh their record 5-10 s before it expires."""
PRIORITY_EPOCH_SECONDS = 10**10
"""Far beyond any start time (year 2286): a replica's default priority counts down from it."""


def seniority_priority(started_unix: float, tiebreak: int) -> int:
    """The default peering priority: the longer a replica has run, the higher (kopf's active
    replica is the one of highest priority).  A replica that starts later, a restarted or a
    rolled-out one, stands by instead of taking the work from one that is busy with it (with a
    random priority, every second restart did, mid-drain), and when the active one dies the
    oldest standby takes over.  ``tiebreak`` (0..999) keeps two replicas started in the same
    second apart: kopf freezes every replica when two have the same priority."""
    if not 0 <= tiebreak < 1000:
        raise ValueError(f"tiebreak must be in 0..999, got {tiebreak}")
    return (PRIORITY_EPOCH_SECONDS - int(started_unix)) * 1000 + tiebreak


def build_parser() -> argparse.ArgumentParser:
    d = Settings()
    ap = argparse.ArgumentParser(prog="kvpool operator", description="Run the kvpool operator (kopf)")
    ns = ap.add_argument_group("namespaces")
    ns.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE", d.namespace),
                    help="namespace the operator runs in")
    ns.add_argument("--watch-namespace", action="append", default=[],
                    help="watch only this namespace (repeatable; default: the whole cluster)")
    pods = ap.add_argument_group("pool defaults (store and sidecar pods)")
    pods.add_argument("--image", default=os.environ.get("KVPOOL_IMAGE", d.image),
                      help="image of store nodes and sidecars when a pool names none")
    pods.add_argument("--image-pull-policy", default=d.image_pull_policy, help="pull policy of that image")
    pods.add_argument("--command", default=" ".join(d.command),
                      help="entry point of that image (the role is appended), e.g. 'kvpool'")
    pods.add_argument("--default-dram", default=str(d.default_dram_bytes),
                      help="DRAM per node of a pool that lists no KVTier (bytes or e.g. 1Gi)")
    pods.add_argument("--sidecar-metrics-port", type=int, default=d.sidecar_metrics_port,
                      help="Prometheus port of injected sidecars (0 off)")
    pods.add_argument("--sidecar-handoff-port", type=int, default=d.sidecar_handoff_port,
                      help="pod port of injected sidecars' prefill -> decode state exports (0 off)")
    tls = ap.add_argument_group("TLS (a CA and certificates per pool, kvpool_operator.pool_tls)")
    tls.add_argument("--tls", action="store_true", default=d.tls,
                     help="issue each pool a CA and certificates, serve its store nodes and router with TLS, "
                          "mount injected sidecars their tenant's certificate and call the nodes' admin API with "
                          "the operator's certificate (the default)")
    tls.add_argument("--no-tls", dest="tls", action="store_false",
                     help="every channel of the pools in plaintext (a cluster whose network is trusted)")
    tls.add_argument("--tls-dir", default=d.tls_dir,
                     help="where the operator keeps its client certificate of each pool")
    tls.add_argument("--tls-ca-propagation-seconds", type=float, default=d.tls_ca_propagation_seconds,
                     help="how long a pool's new CA is only trusted before it signs (a rotation's first step, "
                          "long enough for the kubelet to refresh every mounted copy of the bundle)")
    net = ap.add_argument_group("network policy (one per pool, kvpool_operator.netpolicy)")
    net.add_argument("--no-network-policy", dest="network_policy", action="store_false",
                     help="create no NetworkPolicy for the pools (and delete those made before)")
    net.add_argument("--operator-pod-labels", default=",".join(f"{k}={v}" for k, v in d.operator_pod_labels.items()),
                     help="labels of the operator's pods, k=v,k=v (admitted to the store nodes' control port)")
    net.add_argument("--metrics-from", default=json.dumps(list(d.metrics_from)),
                     help="JSON list of NetworkPolicy peers that may scrape the store nodes' metrics port")
    timing = ap.add_argument_group("reconcile timing")
    timing.add_argument("--reconcile-interval", type=float, default=d.reconcile_interval_seconds,
                        help="period of the KVPool timer: ring, stats, drain progress, drift repair")
    timing.add_argument("--tenant-interval", type=float, default=d.tenant_interval_seconds,
                        help="period of the TenantNamespace timer: Secrets and usage in status")
    timing.add_argument("--member-unready-grace", type=float, default=d.member_unready_grace_seconds,
                        help="seconds a store pod that went not-ready stays in the ring (0: leaves at once); "
                             "a KVPool's spec.storage.memberUnreadyGraceSeconds overrides it")
    timing.add_argument("--autoscale-cooldown", type=float, default=d.autoscale_cooldown_seconds,
                        help="seconds between two size changes the autoscaler makes to one pool "
                             "(user changes are not delayed)")
    hook = ap.add_argument_group("injection webhook")
    hook.add_argument("--webhook-port", type=int, default=None, help="serve the injection webhook on this port")
    hook.add_argument("--webhook-addr", default="0.0.0.0", help="address the webhook listens on")
    hook.add_argument("--webhook-host", default=None, help="host name or IP the API server reaches the webhook at")
    hook.add_argument("--webhook-cert", default=None, help="PEM certificate of the webhook server")
    hook.add_argument("--webhook-key", default=None, help="PEM private key of the webhook server")
    hook.add_argument("--webhook-ca", default=None, help="CA bundle for a managed webhook configuration")
    hook.add_argument("--webhook-managed", default=None, metavar="NAME",
                      help="let the operator keep the MutatingWebhookConfiguration NAME up to date; NAME is a "
                           "domain of at least two dots' worth, e.g. inject.kvpool.io (webhooks are named "
                           "<handler>.<NAME>)")
    peer = ap.add_argument_group("peering (several replicas)")
    peer.add_argument("--peering", default="kvpool-operator", help="kopf peering name (several replicas)")
    peer.add_argument("--standalone", action="store_true", help="no peering: this replica handles everything")
    peer.add_argument("--priority", type=int, default=None,
                      help="peering priority (default: from the start time, the oldest replica is active and "
                           "the others stand by; kopf freezes replicas of equal priority)")
    peer.add_argument("--peering-lifetime", type=int, default=PEERING_LIFETIME_SECONDS,
                      help="seconds a replica's peering record counts as alive: a replica that replaces a "
                           "killed one of higher priority stands by this long (kopf's default is 60)")
    obs = ap.add_argument_group("observability")
    obs.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="kopf liveness endpoint URL ('' off)")
    obs.add_argument("--metrics-port", type=int, default=9090, help="Prometheus metrics port (0 off)")
    obs.add_argument("--metrics-addr", default="0.0.0.0", help="address the metrics server listens on")
    return ap


def parse_labels(text: str, flag: str) -> dict[str, str]:
    """``k=v,k=v`` → a dict; fails fast on a pair without ``=``."""
    pairs = [p.strip() for p in text.split(",") if p.strip()]
    if not pairs or any("=" not in p for p in pairs):
        raise ValueError(f"{flag} must be k=v[,k=v...], got {text!r}")
    return dict(p.split("=", 1) for p in pairs)


def parse_peers(text: str, flag: str) -> tuple[dict[str, Any], ...]:
    try:
        peers = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} is not JSON: {exc}") from None
    if not is_peer_list(peers):
        raise ValueError(f"{flag} must be a JSON list of NetworkPolicy peers (objects), got {text!r}")
    return tuple(peers)


def settings_from(args: argparse.Namespace) -> Settings:
    from .units import parse_bytes

    try:
        dram = parse_bytes(args.default_dram, "--default-dram")
        operator_labels = parse_labels(args.operator_pod_labels, "--operator-pod-labels")
        metrics_from = parse_peers(args.metrics_from, "--metrics-from")
    except ValueError as exc:
        raise SystemExit(f"kvpool operator: {exc}") from None
    return Settings(image=args.image, image_pull_policy=args.image_pull_policy, command=tuple(args.command.split()),
                    namespace=args.namespace, default_dram_bytes=dram,
                    reconcile_interval_seconds=args.reconcile_interval, tenant_interval_seconds=args.tenant_interval,
                    member_unready_grace_seconds=args.member_unready_grace,
                    autoscale_cooldown_seconds=args.autoscale_cooldown,
                    sidecar_metrics_port=args.sidecar_metrics_port, sidecar_handoff_port=args.sidecar_handoff_port,
                    network_policy=args.network_policy, operator_pod_labels=operator_labels,
                    metrics_from=metrics_from, tls=args.tls, tls_dir=args.tls_dir,
                    tls_ca_propagation_seconds=args.tls_ca_propagation_seconds)


def peering_objects(name: str, watch_namespaces: Sequence[str]) -> list[dict[str, Any]]:
    """The kopf peering objects the replicas meet in: kopf uses one ClusterKopfPeering for a
    cluster-wide operator and a KopfPeering in each watched namespace otherwise.  A replica whose
    peering object is missing stays paused for good (kopf waits for its first event)."""
    if not watch_namespaces:
        return [{"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": name}}]
    return [{"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": name, "namespace": ns}}
            for ns in dict.fromkeys(watch_namespaces)]


def _peering(kube: Kube, args: argparse.Namespace) -> tuple[bool, str | None]:
    """(standalone, peering name): peer only where kopf's peering CRD is installed."""
    if args.standalone:
        return True, None
    try:
        crd = NAMESPACED_PEERING_CRD if args.watch_namespace else PEERING_CRD
        if kube.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", crd) is None:
            log.warning("%s is not installed: running standalone (install crds/kopf-peering.yaml for "
                        "several replicas)", crd)
            return True, None
        for obj in peering_objects(args.peering, args.watch_namespace):
            kube.create(obj)  # None when it exists already: another replica made it
    except KubeError as exc:
        log.warning("cannot set up peering (%s): running standalone", exc)
        return True, None
    return False, args.peering


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.webhook_port is not None and not (args.webhook_cert and args.webhook_key):
        raise SystemExit("kvpool operator: --webhook-port needs --webhook-cert and --webhook-key")
    if args.webhook_managed and (args.webhook_managed.count(".") < 1 or args.webhook_port is None
                                 or not args.webhook_ca):
        raise SystemExit("kvpool operator: --webhook-managed needs a dotted name (e.g. inject.kvpool.io), "
                         "--webhook-port and --webhook-ca")
    import kopf

    from .handlers import register_all

    settings = settings_from(args)
    kube = Kube.from_environment()
    rt = Runtime(settings, kube, Nodes(settings.node_timeout_seconds))
    registry = kopf.OperatorRegistry()
    register_all(registry, rt, with_webhook=args.webhook_port is not None)

    @kopf.on.login(registry=registry)
    def login(**kw: Any) -> Any:
        return kopf.login_via_client(**kw)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kvpool.io")
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix="kvpool.io", key="last-handled-configuration")
        settings.persistence.finalizer = "kvpool.io/finalizer"
        settings.peering.lifetime = args.peering_lifetime
        settings.posting.level = logging.WARNING  # Events come from our own transitions, not kopf's logs
        settings.watching.server_timeout = 300
        settings.execution.max_workers = 32
        if args.webhook_port is not None:
            settings.admission.server = kopf.WebhookServer(
                addr=args.webhook_addr, port=args.webhook_port, host=args.webhook_host,
                certfile=args.webhook_cert, pkeyfile=args.webhook_key, cafile=args.webhook_ca)
            if args.webhook_managed:
                settings.admission.managed = args.webhook_managed

    standalone, peering_name = _peering(kube, args)
    metrics.serve(args.metrics_port, args.metrics_addr)
    priority = args.priority if args.priority is not None else seniority_priority(
        time.time(), random.SystemRandom().randrange(1000))
    log.info("peering %s with priority %d", "off (standalone)" if standalone else repr(peering_name), priority)
    kopf.run(registry=registry, standalone=standalone, peering_name=peering_name, priority=priority,
             clusterwide=not args.watch_namespace, namespaces=args.watch_namespace,
             liveness_endpoint=args.liveness or None)
    rt.nodes.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
