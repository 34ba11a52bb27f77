"""pytest fixtures giving tests a real control plane (``e2e.cluster.Cluster``) for the session.

``cluster`` starts etcd, kube-apiserver, kube-controller-manager and a node once per session and
stops them (and every pod) at the end. The node is one of two tiers (README.md):

* the node agent (``e2e.nodeagent``, default): pods are local processes;
* a real node (``e2e.realnode``: containerd, the kubelet, kube-proxy, CoreDNS in a private
  namespace), for modules marked ``realnode``, or for every test with ``--node=kubelet``
  (or ``KVPOOL_E2E_NODE=kubelet``).

When a test that used it fails, the tails of every component log and container log are attached
to the failure report.
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

# The running cluster of each tier, for the failure reports.
_running: dict[str, Cluster] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--node", choices=["agent", "kubelet"],
                     default=os.environ.get("KVPOOL_E2E_NODE", "agent"),
                     help="the node every e2e test runs on (modules marked realnode always get "
                          "the real node): the node agent, or a real kubelet with containerd")


def _tier(node: pytest.Item | pytest.Collector) -> str:
    if node.get_closest_marker("realnode") is not None:
        return "kubelet"
    return str(node.config.getoption("--node"))


def _started(tier: str, c: Cluster) -> Iterator[Cluster]:
    """Start ``c``, register it as ``tier``'s running cluster (for the failure reports) for as
    long as the session uses it, then stop it."""
    c.start()
    _running[tier] = c
    try:
        yield c
    finally:
        _running.pop(tier, None)
        c.stop()


@pytest.fixture(scope="session")
def _agent_cluster() -> Iterator[Cluster]:
    if os.geteuid() != 0:
        pytest.skip("the node agent needs root (mount namespaces for pod volumes)")
    # A third octet per session, so that a developer's `python -m e2e.cluster up` (127.0.10.x)
    # and a test session can run side by side without sharing pod IPs.
    prefix = f"127.0.{20 + os.getpid() % 200}."
    yield from _started("agent", Cluster(pod_ip_prefix=prefix))


@pytest.fixture(scope="session")
def _kubelet_cluster() -> Iterator[Cluster]:
    from e2e import realnode

    if os.geteuid() != 0:
        pytest.skip("the real node needs root (namespaces, mounts, cgroups)")
    missing = realnode.missing_packages()
    if missing:
        pytest.skip(f"the real node needs the Debian packages {', '.join(missing)} "
                    "(apt-get install -y " + " ".join(missing) + ")")
    images = realnode.find_images(Path(_ROOT))
    if images is None:
        pytest.skip("no kvpool image: tools/image.sh is missing and KVPOOL_IMAGE_ARCHIVE, "
                    "KVPOOL_IMAGE, KVPOOL_PAUSE_ARCHIVE, KVPOOL_PAUSE_IMAGE are not set")
    yield from _started("kubelet", realnode.RealNodeCluster(images))


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Cluster:
    """The running cluster of this module's tier, shared by the whole session."""
    tier = _tier(request.node)
    running: Cluster = request.getfixturevalue(
        "_kubelet_cluster" if tier == "kubelet" else "_agent_cluster")
    return running


@pytest.fixture(scope="module")
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
    running = _running.get(_tier(item))
    if report.failed and running is not None and "cluster" in getattr(item, "fixturenames", ()):
        report.sections.append(("kvpool cluster logs", running.logs()))
    return report
