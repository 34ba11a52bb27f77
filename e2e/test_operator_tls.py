"""A pool's certificates on the real control plane: an operator started with ``--tls`` creates the
pool's CA and certificates as Secrets owned by the pool, the store pods mount theirs and serve
TLS, and the operator's admin calls (a Ready pool needs their Stats) go through with its client
certificate while a plaintext caller gets nowhere.

A TenantNamespace of the pool gets its tenant's certificate. Work in progress
(docs/wip-operator-tls.md): no CA rotation and no injected sidecar talking TLS here yet.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.cluster import Cluster
from e2e.test_operator_crds import install_crds
from e2e.test_operator_pool import Operator, cond, create, kvpool, wait_status
from e2e.testutil import pool_client_tls, wait_for
from kvpool.core import pki
from kvpool.core.errors import KvpoolError
from kvpool.pool.admin_client import AdminClient
from kvpool.pool.node_client import StoreClient
from kvpool_operator import certs
from kvpool_operator.kube import Kube

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def kube(api: Any) -> Kube:
    return Kube(api)


@pytest.fixture(scope="module")
def tls_operator(cluster: Cluster, kube: Kube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    install_crds(cluster)
    work = tmp_path_factory.mktemp("operator-tls")
    op = Operator(cluster, work)
    op.stop()
    op.argv += ["--tls", "--tls-dir", str(work / "tls")]
    op.start()
    try:
        yield op
    finally:
        op.close()


def test_pool_serves_tls_with_operator_issued_certificates(tls_operator: Operator, kube: Kube,
                                                           namespace: str, tmp_path: Path) -> None:
    pool = create(kube, kvpool("t", storage={"replicas": 1}, tenancy={"defaultTenant": "public"}), namespace)
    def secret(name: str) -> Callable[[], dict[str, Any] | None]:
        return lambda: kube.get("v1", "Secret", name, namespace)

    for name in ("t-ca", "t-store-tls", "t-operator-tls"):
        sec = wait_for(secret(name), 60, f"Secret {name}")
        (owner,) = sec["metadata"]["ownerReferences"]
        assert owner["kind"] == "KVPool" and owner["uid"] == pool["metadata"]["uid"]
    store = certs.decode(kube.get("v1", "Secret", "t-store-tls", namespace))
    ca = certs.decode(kube.get("v1", "Secret", "t-ca", namespace))
    assert store[certs.CA_CERT_KEY] == ca[certs.CA_CERT_KEY]
    assert pki.identity_of(store[certs.TLS_CERT_KEY]) == pki.node("t-store")

    sts = wait_for(lambda: kube.get("apps/v1", "StatefulSet", "t-store", namespace), 60, "the StatefulSet")
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--tls-dir" in args and f"t-store.{namespace}.svc" in args

    # Ready needs the nodes' Stats: the admin API answered the operator's certificate.
    st = wait_status(kube, namespace, "t", lambda s: cond(s, "Ready") == ("True", "NodesReady"), 180,
                     "the pool Ready over TLS")
    address = st["ring"]["members"][0]["address"]
    plain = AdminClient(address, "", timeout=5, tls=False)
    try:
        with pytest.raises(KvpoolError):
            plain.stats()
    finally:
        plain.close()
    assert any(p.is_file() for p in (Path(tls_operator.argv[-1]) / namespace / "t").iterdir())

    # The default tenant's sidecars (namespaces no TenantNamespace binds) get the pool's
    # default-tenant certificate in the pool's namespace.
    default = wait_for(secret(f"kvpool-default-tls-{namespace}.t"), 60, "the default tenant's certificate")
    assert default["metadata"]["ownerReferences"][0]["uid"] == pool["metadata"]["uid"]
    assert pki.identity_of(certs.decode(default)[certs.TLS_CERT_KEY]) == pki.tenant("default")

    # The data-session opt-out: the nodes restart with --plaintext-data-session, tell clients so
    # over the TLS control channel, and a client's data connections open with tickets.
    kube.merge_patch("kvpool.io/v1alpha1", "KVPool", "t", namespace,
                     {"spec": {"security": {"dataSession": "Plaintext"}}})
    wait_for(lambda: "--plaintext-data-session" in (kube.get("apps/v1", "StatefulSet", "t-store", namespace) or {})[
        "spec"]["template"]["spec"]["containers"][0]["args"], 60, "the opt-out in the StatefulSet")
    cfg = pool_client_tls(kube, namespace, "t", str(tmp_path / "client"))

    def plaintext_member() -> str | None:
        st = (kube.get("kvpool.io/v1alpha1", "KVPool", "t", namespace) or {}).get("status") or {}
        for m in (st.get("ring") or {}).get("members") or []:
            try:
                with StoreClient(m["address"], timeout=5, tls=cfg) as c:
                    if c.health(5).data_session_plaintext:
                        return str(m["address"])
            except KvpoolError:
                pass
        return None
    address = wait_for(plaintext_member, 180, "a restarted node with a plaintext data session", interval=1)
    keys, values = [os.urandom(32) for _ in range(3)], [os.urandom(8192) for _ in range(3)]
    with StoreClient(address, timeout=10, tls=cfg) as c:
        assert c.put(keys, values) == [0] * 3
        assert [bytes(v) if v is not None else None for v in c.get(keys)] == values

    # A tenant of the pool gets its certificate of the pool, from the same CA, in its namespace.
    tn_name = f"tn-tls-{namespace}"
    create(kube, {"apiVersion": "kvpool.io/v1alpha1", "kind": "TenantNamespace", "metadata": {"name": tn_name},
                  "spec": {"tenantId": tn_name, "namespaces": [namespace], "pools": [{"pool": f"{namespace}.t"}]}})
    try:
        tenant = wait_for(secret(f"kvpool-tls-{namespace}.t"), 60, "the tenant's certificate")
        (owner,) = tenant["metadata"]["ownerReferences"]
        assert owner["kind"] == "TenantNamespace" and owner["name"] == tn_name
        data = certs.decode(tenant)
        assert pki.identity_of(data[certs.TLS_CERT_KEY]) == pki.tenant(tn_name)
        assert data[certs.CA_CERT_KEY] == ca[certs.CA_CERT_KEY]
    finally:
        kube.delete("kvpool.io/v1alpha1", "TenantNamespace", tn_name)
