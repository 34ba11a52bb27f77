"""pytest fixtures giving tests a real control plane (``e2e.cluster.Cluster``) for the session.

``cluster`` starts etcd, kube-apiserver, kube-controller-manager and the node agent once per
session and stops them (and every pod process) at the end. When a test that used it fails, the
tails of every component log and container log are attached to the failure report.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

# The repo uses --import-mode=importlib, which does not put the rootdir on sys.path; the
# harness modules are imported as the package `e2e` (also what `python -m e2e.cluster` uses).
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from e2e.cluster import Cluster  # noqa: E402

_running: Cluster | None = None


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """A running cluster shared by the whole session."""
    global _running
    if os.geteuid() != 0:
        pytest.skip("the node agent needs root (mount namespaces for pod volumes)")
    # A third octet per session, so that a developer's `python -m e2e.cluster up` (127.0.10.x)
    # and a test session can run side by side without sharing pod IPs.
    prefix = f"127.0.{20 + os.getpid() % 200}."
    c = Cluster(pod_ip_prefix=prefix)
    c.start()
    _running = c
    try:
        yield c
    finally:
        _running = None
        c.stop()


@pytest.fixture(scope="session")
def api(cluster: Cluster) -> Iterator[Any]:
    """An admin ``kubernetes.client.ApiClient``."""
    client = cluster.api_client()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def namespace(api: Any) -> Iterator[str]:
    """A fresh namespace per test, deleted afterwards (its pods are then stopped by the agent)."""
    from kubernetes import client

    name = f"e2e-{uuid.uuid4().hex[:8]}"
    core: Any = client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": name, "labels": {"kvpool-e2e/test": name}}})
    # Pods are refused until the serviceaccount controller has made `default` here.
    from e2e.testutil import wait_for

    wait_for(lambda: _has_default_sa(core, name), 30, "default service account")
    try:
        yield name
    finally:
        core.delete_namespace(name)


def _has_default_sa(core: Any, ns: str) -> bool:
    from kubernetes.client.exceptions import ApiException

    try:
        core.read_namespaced_service_account("default", ns)
        return True
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[
        None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed and _running is not None and "cluster" in getattr(item, "fixturenames", ()):
        report.sections.append(("kvpool cluster logs", _running.logs()))
    return report
