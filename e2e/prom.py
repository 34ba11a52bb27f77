"""Debian's Prometheus (2.42) in tests: where it is, running it, and the chart's PromQL as a live
test evaluates it. Shared by ``tests/kvpool_chart/test_monitoring.py`` (a LocalCluster scraped by
static targets) and ``e2e/test_monitoring_scrape.py`` (a pool on the harness, discovered as the
chart's PodMonitors would discover it).

``tools/setup.sh`` unpacks the package into ``${KVPOOL_CACHE:-~/.cache/kvpool}/prometheus``; a
``prometheus`` or ``promtool`` on PATH is used otherwise. Debian builds Prometheus without the
Kubernetes service discovery (NEWS.Debian, 1.5.0: "Kubernetes support has been completely
removed"), so the harness test feeds it ``file_sd_configs`` (``e2e.monitors``).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.cluster import free_port

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "kvpool"
PROM_BIN = Path(os.environ.get("KVPOOL_CACHE", Path.home() / ".cache" / "kvpool")) / "prometheus" / "usr" / "bin"


def _binary(name: str) -> Path:
    return PROM_BIN / name if (PROM_BIN / name).exists() else Path(shutil.which(name) or "/none")


PROMTOOL = _binary("promtool")
PROMETHEUS = _binary("prometheus")
CERT_EXPIRY = "kvpool_certificate_expiry_timestamp_seconds"
"""The operator's gauge of the pool's TLS (issue 23 part 1), labels pool_namespace, pool and kind."""
SHORT_WINDOW = "20s"
"""Every range of the PromQL in the live tests: a few scrapes (1 s apart) of a short workload."""
PENDING: dict[str, str] = {}
"""Families an expression may use that the scraped processes do not export yet, with why. An
expression over one of them must return nothing (so the entry is removed when it lands)."""


# ------------------------------------------------------------------------- the chart's PromQL


def dashboard() -> dict[str, Any]:
    return dict(json.loads((CHART / "files" / "dashboard.json").read_text()))


def rule_groups() -> list[dict[str, Any]]:
    return list(yaml.safe_load((CHART / "files" / "prometheus-rules.yaml").read_text())["groups"])


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]


def rules() -> list[dict[str, Any]]:
    return [r for g in rule_groups() for r in g["rules"]]


def live_form(expr: str, namespace: str = ".*", pool: str = ".*") -> str:
    """An expression as the live tests evaluate it: the dashboard's variables filled in (regexes),
    every range shortened, and each comparison turned into a ``bool`` one, so an alert's expression
    (which returns nothing on a healthy pool) returns its series whether or not it would fire."""
    e = expr.replace("$__rate_interval", SHORT_WINDOW)
    e = e.replace('"$namespace"', json.dumps(namespace)).replace('"$pool"', json.dumps(pool))
    e = re.sub(r"\[\d+[smhd]\]", f"[{SHORT_WINDOW}]", e)
    return re.sub(r"\s(>=|<=|==|!=|>|<)\s(?!\s*bool\b)", r" \1 bool ", e)


def live_expressions(namespace: str = ".*", pool: str = ".*") -> dict[str, str]:
    """Every expression of the dashboard and the rules (but those over :data:`PENDING` families),
    mapped to its :func:`live_form`."""
    return {e: live_form(e, namespace, pool) for e in [*dashboard_exprs(), *(r["expr"] for r in rules())]
            if not any(name in e for name in PENDING)}


# ------------------------------------------------------------------------------- running it


def api_get(base: str, path: str, **params: str) -> Any:
    """``GET base/api/v1/<path>`` and its ``data`` (asserting the call succeeded)."""
    url = f"{base}/api/v1/{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
    with urllib.request.urlopen(url, timeout=10) as resp:
        doc = json.load(resp)
    assert doc["status"] == "success", doc
    return doc["data"]


def query(base: str, expr: str) -> list[dict[str, Any]]:
    return list(api_get(base, "query", query=expr)["result"])


class Prometheus:
    """One ``prometheus`` on 127.0.0.1 with a config written into ``workdir``, the chart's rules
    loaded, scraping every second. ``stop`` ends it (also when start failed half-way)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.base = ""

    def start(self, scrape_configs: list[dict[str, Any]], timeout: float = 60) -> str:
        """Start with these scrape configs; returns the base URL once ``/-/ready`` answers."""
        rules_path = self.workdir / "rules.yaml"
        shutil.copy(CHART / "files" / "prometheus-rules.yaml", rules_path)
        port = free_port()
        cfg = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
               "rule_files": [str(rules_path)], "scrape_configs": scrape_configs}
        config = self.workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump(cfg, sort_keys=False))
        log = self.workdir / "prometheus.log"
        with log.open("wb") as out:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [str(PROMETHEUS), f"--config.file={config}", f"--web.listen-address=127.0.0.1:{port}",
                 f"--storage.tsdb.path={self.workdir / 'data'}", "--storage.tsdb.retention.time=1h"],
                stdout=out, stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.base}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return self.base
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"prometheus did not become ready: {self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, chars: int = 3000) -> str:
        path = self.workdir / "prometheus.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Prometheus]:
    """A Prometheus of its own per test (the chart's and the harness's scrape tests), stopped after."""
    prom = Prometheus(tmp_path)
    try:
        yield prom
    finally:
        prom.stop()


def wait_for_series(base: str, exprs: dict[str, str], timeout: float,
                    failed: Callable[[], bool] = lambda: False) -> dict[str, str]:
    """Evaluate each expression every 2 s until each has returned a series with a number (NaN is
    0/0: no traffic in the window yet), ``failed()`` says to stop, or the deadline; returns the
    expressions still waiting (empty: all returned series)."""
    waiting = dict(exprs)
    deadline = time.monotonic() + timeout
    while waiting and not failed() and time.monotonic() < deadline:
        time.sleep(2)
        waiting = {e: f for e, f in waiting.items()
                   if not any(math.isfinite(float(r["value"][1])) for r in query(base, f))}
    return waiting


def still_pending(base: str) -> list[str]:
    """The :data:`PENDING` families that are exported after all (each should leave PENDING)."""
    return [f"{name} is exported now: remove it from PENDING ({why})" for name, why in PENDING.items()
            if query(base, f"count({name})")]


# ------------------------------------------------------------------------------- a workload


def workload_round(client: Any, rng: Any, nbytes: int, block: int = 64 << 10) -> None:
    """One round of what the dashboard shows, through one sidecar client (``kvpool.client``): write
    ``nbytes`` of new blocks (past the local tier and DRAM: demotions, evictions; past a quota:
    refusals), match them, read half back (hits and restores, from the pool once the local tier
    has let them go) and ask for absent keys (misses). ``rng`` is a numpy Generator."""
    n = nbytes // block
    keys = [rng.bytes(32) for _ in range(n)]
    client.put(keys, [rng.bytes(block) for _ in range(n)])
    client.flush()
    client.match(keys)
    client.get_many(keys[: n // 2]).release()  # a quota-refused key is absent: per key
    client.get_many([rng.bytes(32) for _ in range(8)]).release()  # absent
