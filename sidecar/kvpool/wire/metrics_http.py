"""The ``/metrics`` HTTP endpoint of a kvpool process: its port flag and its server.

Store nodes and sidecars serve Prometheus text on their own port (``--metrics-port``): 0 is off,
``auto`` an ephemeral port the process reports on its READY line (``metrics=HOST:PORT``; what
``LocalCluster`` uses, so tests scrape real endpoints).  The families are named in
:mod:`kvpool.wire.metric_names`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.registry import CollectorRegistry

EPHEMERAL = -1
"""``metrics_port`` of a process that lets the OS pick the port (``--metrics-port auto``)."""


def parse_port(value: str) -> int:
    """``--metrics-port``: a port, 0 (off) or ``auto`` (:data:`EPHEMERAL`)."""
    if value.strip().lower() == "auto":
        return EPHEMERAL
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port, 0 (off) or auto, got {value!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is not in 0..65535")
    return port


@dataclass
class MetricsServer:
    """A running ``/metrics`` endpoint; :attr:`address` is ``host:port`` as bound."""

    address: str
    _server: Any

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve(port: int, host: str, registry: CollectorRegistry) -> MetricsServer | None:
    """Serve ``registry`` on ``host:port`` (``port`` :data:`EPHEMERAL`: any free one) in a daemon
    thread; None when ``port`` is 0 (off)."""
    if port == 0:
        return None
    server, _ = start_http_server(0 if port == EPHEMERAL else port, addr=host, registry=registry)
    bound_host, bound_port = server.server_address[:2]
    if isinstance(bound_host, bytes):
        bound_host = bound_host.decode()
    return MetricsServer(f"{bound_host}:{bound_port}", server)
