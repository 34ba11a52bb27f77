"""The `kvpool` command: one subcommand per process (store node, sidecar, operator) and tool.

Each subcommand owns its parser (``build_parser`` in its module, flags in argument groups) and
its ``main``; this module only names them, with the one line ``kvpool --help`` shows, and hands
the rest of the command line over, so that ``kvpool <command> --help`` is that parser's help.
Modules are imported only when their subcommand runs: ``kvpool store`` never loads kopf.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Subcommand:
    """One `kvpool` subcommand: its help line and where its parser and entry point live."""

    help: str
    """The one line ``kvpool --help`` shows for it."""
    module: str
    """The module holding ``build_parser() -> ArgumentParser`` and ``main(argv) -> int``."""


SUBCOMMANDS: dict[str, Subcommand] = {
    "store": Subcommand("run a store node: a shard of the pool (DRAM, SSD, shared-fs tiers)",
                        "kvpool.store.main"),
    "sidecar": Subcommand("run the sidecar beside an engine: local shared-memory tier in front of the pool",
                          "kvpool.sidecar.main"),
    "up": Subcommand("run a local pool (store nodes + sidecars) in the foreground for trying kvpool out",
                     "kvpool.apps.cluster"),
    "demo": Subcommand("measure hit rates of routing with and without the pool on a simulated chat workload",
                       "kvpool.apps.demo"),
    "loadgen": Subcommand("drive a sidecar like an engine would (load and end-to-end tests)",
                          "kvpool.apps.loadgen"),
    "router-api": Subcommand("serve the pool's match API (gRPC and HTTP/JSON) for KV-aware routers",
                             "kvpool.apps.router_api"),
    "operator": Subcommand("run the Kubernetes operator (KVPool, KVTier, TenantNamespace)",
                           "kvpool_operator.main"),
}


def subcommand_parser(name: str) -> argparse.ArgumentParser:
    """The parser that parses ``kvpool <name> ...`` (imports that subcommand's module)."""
    parser: argparse.ArgumentParser = importlib.import_module(SUBCOMMANDS[name].module).build_parser()
    return parser


def _entry(name: str) -> Callable[[list[str]], int]:
    entry: Callable[[list[str]], int] = importlib.import_module(SUBCOMMANDS[name].module).main
    return entry


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvpool", description="Shared, tiered KV-cache pool for LLM inference",
                                 epilog="`kvpool COMMAND --help` describes the flags of each command.")
    ap.add_argument("--log-level", default=os.environ.get("KVPOOL_LOG_LEVEL", "WARNING"),
                    help="logging level of the process (default: $KVPOOL_LOG_LEVEL or WARNING)")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, cmd in SUBCOMMANDS.items():
        # add_help=False: `--help` after the command reaches the command's own parser.
        sub.add_parser(name, help=cmd.help, description=cmd.help, add_help=False)
    return ap


def exit_on_sigterm() -> None:
    """Until the subcommand installs its own SIGTERM handler (its graceful stop, once it serves),
    SIGTERM ends the process at once with 143, as the default action would elsewhere.

    In a container the process is PID 1, for which the kernel applies no default action: a
    signal without a handler is dropped, and pod deletion waited out the whole grace period while
    a store node started or the operator waited on the API server.  Left alone where a caller
    (a test runner embedding ``main``) has a handler of its own, or off the main thread."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda *_: os._exit(128 + signal.SIGTERM))


def main(argv: Sequence[str] | None = None) -> int:
    exit_on_sigterm()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, rest = build_parser().parse_known_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return int(_entry(args.command)(rest))


if __name__ == "__main__":
    sys.exit(main())
