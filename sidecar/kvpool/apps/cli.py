"""The `kvpool` command: store node, sidecar, operator, local pool and the demo."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from kvpool.core.units import parse_bytes
from kvpool.wire.kv_events import add_event_args


def _store(args: argparse.Namespace) -> int:
    from kvpool.store.config import load_node_config, load_tenants
    from kvpool.store.main import serve_forever

    cfg = load_node_config(args)
    tenants = load_tenants(args.tenants) if args.tenants else []
    admin = args.admin_token or ""
    if args.admin_token_file:
        with open(args.admin_token_file) as f:
            admin = f.read().strip()
    return serve_forever(cfg, args.listen, args.transfer_port, admin, tenants)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvpool", description="Shared, tiered KV-cache pool for LLM inference")
    ap.add_argument("--log-level", default=os.environ.get("KVPOOL_LOG_LEVEL", "WARNING"))
    sub = ap.add_subparsers(dest="command", required=True)

    st = sub.add_parser("store", help="run a store node")
    st.add_argument("--listen", default="127.0.0.1:7400", help="HOST:PORT of the control API (gRPC)")
    st.add_argument("--transfer-port", type=int, default=None,
                    help="port of the transfer server (default: listen port + 1, or ephemeral for port 0)")
    st.add_argument("--dram", type=parse_bytes, default=None, help="DRAM arena payload capacity")
    st.add_argument("--ssd-path", default=None)
    st.add_argument("--ssd", type=parse_bytes, default=None, help="SSD tier capacity")
    st.add_argument("--sharedfs", default=None, help="directory of a shared-filesystem tier")
    st.add_argument("--master-key-file", default=None,
                    help="file holding the master key of encryption at rest (a mounted Secret, >= 32 bytes): "
                         "objects on the SSD and shared-filesystem tiers are encrypted per tenant")
    st.add_argument("--previous-master-keys-file", default=None,
                    help="file of earlier master keys, one per line, still opened but never used to seal "
                         "(key rotation; a missing file holds none); both files are re-read when they change")
    st.add_argument("--node-id", default=None)
    st.add_argument("--config", default=None, help="JSON node configuration (the operator's ConfigMap)")
    st.add_argument("--tenants", default=None, help="JSON file of tenants (id, token, salt, quota, ttl)")
    st.add_argument("--closed", action="store_true", help="refuse calls without a tenant token")
    st.add_argument("--fault-tier-delay-file", default=None,
                    help="test hook: while this file exists, each SSD/shared-fs I/O sleeps the seconds it holds")
    st.add_argument("--admin-token", default=None)
    st.add_argument("--admin-token-file", default=None)
    add_event_args(st)
    st.add_argument("--events-tenant", default="default", help="the tenant whose block events are published")
    st.set_defaults(func=_store)

    for name, mod in (("sidecar", "sidecar.main"), ("up", "apps.cluster"), ("demo", "apps.demo"),
                      ("loadgen", "apps.loadgen"),  # an engine stand-in for load and e2e tests
                      ("router-api", "apps.router_api"),  # the pool's match API for KV-aware routers
                      ("operator", None)):
        p = sub.add_parser(name, add_help=False)
        p.set_defaults(func=None, delegate=(name, mod))
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    # Subcommands with their own parsers (sidecar, demo, up, operator) get the rest verbatim.
    args, rest = ap.parse_known_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.func is not None:
        if rest:
            ap.error(f"unrecognized arguments: {' '.join(rest)}")
        return int(args.func(args))
    name, mod = args.delegate
    if name == "operator":
        from kvpool_operator.main import main as op_main
        return int(op_main(rest))
    import importlib
    module = importlib.import_module(f"kvpool.{mod}")
    return int(module.main(rest))


if __name__ == "__main__":
    sys.exit(main())
