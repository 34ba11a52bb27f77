"""`kvpool sidecar`: the command line and the process around a :class:`~kvpool.sidecar.server.Sidecar`.

Arguments and mounted files become a :class:`~kvpool.sidecar.config.SidecarConfig` (whose
fields hold every default); the process prints ``READY …`` once it serves, and on SIGTERM or
SIGINT stops accepting, flushes what exists only locally (``FLUSHED …``) and exits 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence

from kvpool.core.signals import stop_on_signals
from kvpool.core.units import parse_bytes
from kvpool.sidecar.config import DEFAULTS as D
from kvpool.sidecar.config import SidecarConfig
from kvpool.sidecar.server import Sidecar
from kvpool.wire import metrics_http
from kvpool.wire.counters import SidecarCounter
from kvpool.wire.kv_events import add_event_args, events_config
from kvpool.wire.tls import TlsConfig, TlsError, add_tls_args
from kvpool.wire.tls import from_args as tls_from_args
from kvpool.wire.tls import install as install_tls

log = logging.getLogger("kvpool.sidecar")


def load_credentials(path: str) -> tuple[str, str]:
    """(tenant id, token) from a mounted credentials file: JSON {tenantId, token[, salt]}."""
    try:
        with open(path) as f:
            doc = json.load(f)
        return str(doc["tenantId"]), str(doc["token"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"kvpool sidecar: cannot read credentials {path}: {exc}") from None


def _load_handoff_key(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            key = f.read().strip()
    except OSError as exc:
        raise SystemExit(f"kvpool sidecar: cannot read handoff key {path}: {exc}") from None
    if not key:
        raise SystemExit(f"kvpool sidecar: handoff key file {path} is empty")
    return key


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvpool sidecar", description="Serve an engine's kvpool client")
    ap.add_argument("--log-level", default=os.environ.get("KVPOOL_LOG_LEVEL", "INFO"),
                    help="logging level (default: $KVPOOL_LOG_LEVEL or INFO)")

    engine = ap.add_argument_group("engine socket and arena")
    engine.add_argument("--socket", required=True, help="unix socket path (the arena is created beside it)")
    engine.add_argument("--arena-dir", default=D.arena_dir,
                        help="directory of the shared-memory arena (default: beside the socket); it must be "
                             "memory-backed (tmpfs), else every write to the arena dirties disk pages")
    engine.add_argument("--max-registered-bytes", type=parse_bytes, default=D.max_registered_bytes,
                        help="client memory (Client.alloc_buffer) mapped at most, over all clients; a "
                             "registration beyond it is refused and that client reads through the arena")

    member = ap.add_argument_group("pool membership")
    member.add_argument("--pool", default="", help="comma-separated store node addresses (empty: local tier only)")
    member.add_argument("--transition-seconds", type=float, default=D.transition_seconds,
                        help="after a ring change, look for missing keys at their previous owners this long")

    cap = ap.add_argument_group("capacity")
    cap.add_argument("--local", type=parse_bytes, default=D.local_bytes, help="local tier payload capacity")
    cap.add_argument("--copy-over-bytes", type=parse_bytes, default=D.copy_over_bytes,
                     help="bound of the queue copying blocks found at a previous owner to the new one "
                          "(default: an eighth of the local tier; 0: off)")

    writes = ap.add_argument_group("writes to the pool")
    writes.add_argument("--write-back", action="store_true",
                        help="blocks reach the pool on local eviction instead of right after the put")
    writes.add_argument("--pool-write-retries", type=int, default=D.pool_write_retries,
                        help="retries of a write-through block or an evicted object's copy whose pool write "
                             "failed for a passing reason (with doubling delays), after which it is counted as "
                             "dropped (a block stays local-only, a copy is lost)")
    writes.add_argument("--pool-write-yield-ms", type=int, default=D.pool_write_yield_ms,
                        help="longest the pool writer holds a write-through batch back while puts are being "
                             "served (they compete for the same cores; 0: never)")
    writes.add_argument("--drain-seconds", type=float, default=D.drain_seconds,
                        help="how long SIGTERM's flush of local-only objects may take")

    dl = ap.add_argument_group("deadlines")
    dl.add_argument("--match-deadline-ms", type=_positive_int, default=D.match_deadline_ms,
                    help="deadline of a match/exists at one store node; a node that misses it is skipped "
                         "(its keys are misses) until a probe lets it back in")
    dl.add_argument("--read-deadline-ms", type=_positive_int, default=D.read_deadline_ms,
                    help="base deadline of a read from one store node (plus its payload at --read-bytes-per-second)")
    dl.add_argument("--read-bytes-per-second", type=parse_bytes, default=D.read_bytes_per_second,
                    help="bandwidth floor a read's payload gets time for (e.g. 100000000, 200MiB; 0: none)")
    dl.add_argument("--probe-deadline-ms", type=_positive_int, default=D.probe_deadline_ms,
                    help="how long a background probe of a suspect store node waits for its answer")
    dl.add_argument("--suspect-backoff-ms", type=_positive_int, default=D.suspect_backoff_ms,
                    help="back-off between probes of a suspect store node (doubling up to 8x)")

    sec = ap.add_argument_group("security")
    sec.add_argument("--tenant", default=None, help="the tenant this sidecar serves (default: from the credentials)")
    sec.add_argument("--credentials", default=os.environ.get("KVPOOL_CREDENTIALS"),
                     help="mounted credentials file, JSON {tenantId, token} (default: $KVPOOL_CREDENTIALS)")
    sec.add_argument("--token", default=None, help=argparse.SUPPRESS)

    add_tls_args(sec)
    hand = ap.add_argument_group("prefill -> decode handoff")
    hand.add_argument("--handoff-listen", default=os.environ.get("KVPOOL_HANDOFF_LISTEN", D.handoff_listen),
                      help="host:port exporting state objects to decode sidecars (prefill -> decode handoff)")
    hand.add_argument("--handoff-advertise", default=os.environ.get("KVPOOL_HANDOFF_ADVERTISE", D.handoff_advertise),
                      help="address decode sidecars reach the handoff port at (default: the bound one)")
    hand.add_argument("--handoff-key-file", default=os.environ.get("KVPOOL_HANDOFF_KEY_FILE"),
                      help="secret that signs handoff records (default: the tenant token)")

    obs = ap.add_argument_group("observability")
    obs.add_argument("--metrics-port", type=metrics_http.parse_port, default=D.metrics_port,
                     help="port of the Prometheus /metrics endpoint (0: none; auto: any free port, printed on "
                          "the READY line); injected sidecars serve it on 7461")
    obs.add_argument("--metrics-addr", default=D.metrics_addr, help="address the /metrics endpoint listens on")
    add_event_args(obs)
    return ap


def config_from_args(args: argparse.Namespace) -> SidecarConfig:
    tenant, token = D.tenant_id, D.token
    if args.credentials:
        tenant, token = load_credentials(args.credentials)
    if args.tenant:
        tenant = args.tenant
    if args.token:
        token = args.token
    key = _load_handoff_key(args.handoff_key_file) if args.handoff_key_file else D.handoff_key
    return SidecarConfig(socket=args.socket, pool=[a.strip() for a in args.pool.split(",") if a.strip()],
                         local_bytes=args.local, tenant_id=tenant, token=token, write_back=args.write_back,
                         drain_seconds=args.drain_seconds, metrics_port=args.metrics_port,
                         metrics_addr=args.metrics_addr,
                         events=events_config(args), handoff_listen=args.handoff_listen,
                         handoff_advertise=args.handoff_advertise, handoff_key=key,
                         transition_seconds=args.transition_seconds, copy_over_bytes=args.copy_over_bytes,
                         arena_dir=args.arena_dir, pool_write_retries=args.pool_write_retries,
                         pool_write_yield_ms=args.pool_write_yield_ms,
                         max_registered_bytes=args.max_registered_bytes, match_deadline_ms=args.match_deadline_ms,
                         read_deadline_ms=args.read_deadline_ms, read_bytes_per_second=args.read_bytes_per_second,
                         probe_deadline_ms=args.probe_deadline_ms, suspect_backoff_ms=args.suspect_backoff_ms,
                         tls=_tls(args))


def _tls(args: argparse.Namespace) -> TlsConfig | None:
    try:
        return tls_from_args(args)
    except TlsError as exc:
        raise SystemExit(f"kvpool sidecar: {exc}") from None


def _ready_line(sidecar: Sidecar) -> str:
    """What the process prints once it serves (LocalCluster and the tests wait for it)."""
    cfg, adopted = sidecar.cfg, sidecar.adopted
    return (f"READY unix://{cfg.socket} arena={sidecar.local.arena.path} tenant={cfg.tenant_id} "
            f"pool={len(sidecar.pool.nodes)} incarnation={sidecar.incarnation} "
            f"adopted={adopted.get(SidecarCounter.RESTART_ADOPTED_OBJECTS, 0)} "
            f"dropped={adopted.get(SidecarCounter.RESTART_DROPPED_OBJECTS, 0)}"
            + (" reset=1" if sidecar.counters[SidecarCounter.RESTART_ARENA_RESET] else "")
            + (f" events={sidecar.events.endpoint} replay={sidecar.events.replay_endpoint}" if sidecar.events else "")
            + (f" handoff={sidecar.handoff.address}" if sidecar.handoff.address else "")
            + (f" metrics={sidecar.metrics.address}" if sidecar.metrics is not None else ""))


def serve(cfg: SidecarConfig) -> int:
    """Run a sidecar until SIGTERM/SIGINT, then flush what is only local and stop: the exit code."""
    if os.path.exists(cfg.socket):
        os.unlink(cfg.socket)  # a stale socket of a previous life
    sidecar = Sidecar(cfg)
    sidecar.start()
    stop = stop_on_signals()
    print(_ready_line(sidecar), flush=True)
    stop.wait()
    sidecar.stop_serving()
    t0 = time.time()
    flushed, nbytes, dropped = sidecar.flush(cfg.drain_seconds)
    log.info("sidecar stopping: flushed %d local-only objects (%d bytes) in %.2fs, dropped %d",
             flushed, nbytes, time.time() - t0, dropped)
    print(f"FLUSHED objects={flushed} bytes={nbytes} dropped={dropped}", flush=True)
    sidecar.close()
    try:
        os.unlink(cfg.socket)
    except FileNotFoundError:
        pass
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = config_from_args(args)
    install_tls(cfg.tls)  # every client of the store nodes uses it
    return serve(cfg)


if __name__ == "__main__":
    sys.exit(main())
