"""A pool's certificates on the real control plane: an operator started with ``--tls`` creates the
pool's CA and certificates as Secrets owned by the pool, the store pods mount theirs and serve
TLS, and the operator's admin calls (a Ready pool needs their Stats) go through with its client
certificate while a plaintext caller gets nowhere.

A TenantNamespace of the pool gets its tenant's certificate, the default tenant gets the pool's,
and the data-session opt-out reaches the nodes. A CA rotation keeps serving with no failed read.
Injected sidecars talking TLS run in the other e2e files (TLS is the operator's default).
"""

from __future__ import annotations

import base64
import datetime as dt
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.cluster import Cluster
from e2e.test_operator_crds import install_crds
from e2e.test_operator_pool import Operator, cond, create, kvpool, wait_events, wait_status
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
    # A rotation's staging step lasts 8 s here (the node agent refreshes Secret volumes every 5 s).
    op.argv += ["--tls", "--tls-ca-propagation-seconds", "8", "--tls-dir", str(work / "tls")]
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
    bundle_map = kube.get("v1", "ConfigMap", "t-ca-bundle", namespace) or {}
    assert bundle_map["data"]["ca.crt"].encode() == ca[certs.CA_CERT_KEY]

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


def _near_its_end(ca: certs.Data, days: int) -> bytes:
    """The pool's CA certificate as if it ended in ``days``: the same subject, key and extensions,
    self-signed again with that end (every leaf it signed still verifies against it), so the
    operator sees a CA within its rotation margin."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    cert = x509.load_pem_x509_certificate(pki.split_bundle(ca[certs.CA_CERT_KEY])[0])
    key = serialization.load_pem_private_key(ca[certs.CA_KEY_KEY], password=None)
    builder = (x509.CertificateBuilder().subject_name(cert.subject).issuer_name(cert.issuer)
               .public_key(cert.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(cert.not_valid_before_utc)
               .not_valid_after(dt.datetime.now(dt.UTC) + dt.timedelta(days=days)))
    for ext in cert.extensions:
        builder = builder.add_extension(ext.value, ext.critical)
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)  # type: ignore[arg-type]


def _issuer_of(leaf_der: bytes, bundle: bytes) -> int:
    """Which CA of ``bundle`` (its index) signed a certificate."""
    from cryptography import x509

    leaf = x509.load_der_x509_certificate(leaf_der)
    for i, ca in enumerate(pki.split_bundle(bundle)):
        try:
            leaf.verify_directly_issued_by(x509.load_pem_x509_certificate(ca))
            return i
        except Exception:  # another CA's signature
            continue
    return -1


def test_ca_rotation_keeps_serving_with_no_failed_read(tls_operator: Operator, kube: Kube, namespace: str,
                                                        tmp_path: Path) -> None:
    """The issue's "a rotation of the CA keeps serving with no failed reads": while a client reads
    continuously, each read on fresh connections (new handshakes), the pool's CA is made to end
    within the rotation margin; the operator stages a new CA (trusted everywhere first), then
    signs with it and re-issues every certificate; the node agent refreshes the mounted Secrets
    as a kubelet does. Every read succeeds byte-exact, and afterwards the store node presents a
    certificate of the new CA and the operator still reaches it (the pool stays Ready)."""
    create(kube, kvpool("rot", storage={"replicas": 1}, tenancy={"defaultTenant": "public"}), namespace)
    st = wait_status(kube, namespace, "rot", lambda s: cond(s, "Ready") == ("True", "NodesReady"), 180,
                     "the pool Ready over TLS")
    address = st["ring"]["members"][0]["address"]
    client_dir = tmp_path / "client"
    cfg = pool_client_tls(kube, namespace, "rot", str(client_dir))
    keys, values = [os.urandom(32) for _ in range(8)], [os.urandom(32 << 10) for _ in range(8)]
    with StoreClient(address, timeout=10, tls=cfg) as c:
        assert c.put(keys, values) == [0] * 8

    stop = threading.Event()
    tally = {"reads": 0, "failed": 0, "wrong": 0}
    errors: list[str] = []

    def refresh() -> None:  # the client's "mounted Secret", refreshed as the node agent does
        while not stop.wait(2):
            pool_client_tls(kube, namespace, "rot", str(client_dir))

    def read() -> None:
        while not stop.is_set():
            tally["reads"] += 1
            try:
                with StoreClient(address, timeout=10, tls=cfg) as c:  # new channel, new data connections
                    got = c.get(keys)
                if [bytes(v) if v is not None else None for v in got] != values:
                    tally["wrong"] += 1
            except Exception as exc:  # counted and shown, never lost in the thread
                tally["failed"] += 1
                errors.append(f"{type(exc).__name__}: {exc}"[:300])
            time.sleep(0.05)

    threads = [threading.Thread(target=f, name=f.__name__) for f in (refresh, read)]
    for t in threads:
        t.start()
    try:
        time.sleep(3)
        before = certs.decode(kube.get("v1", "Secret", "rot-ca", namespace))
        old_signer = pki.split_bundle(before[certs.CA_CERT_KEY])[0]
        ending = _near_its_end(before, 5)
        kube.merge_patch("v1", "Secret", "rot-ca", namespace, {"data": {
            certs.CA_CERT_KEY: base64.b64encode(ending).decode()}})

        def rotated() -> bytes | None:
            data = certs.decode(kube.get("v1", "Secret", "rot-ca", namespace))
            signer = pki.split_bundle(data.get(certs.CA_CERT_KEY, b""))[:1]
            new = bool(signer) and signer[0] not in (old_signer, ending) and certs.NEXT_CERT_KEY not in data
            return data[certs.CA_CERT_KEY] if new else None
        bundle = wait_for(rotated, 90, "the new CA signing", interval=0.5)
        assert len(pki.split_bundle(bundle)) == 2  # the old CA still trusted

        def serving_new() -> bool:
            host, port = address.rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=5) as raw:
                with cfg.client_context().wrap_socket(raw, server_hostname=cfg.server_name) as s:
                    return _issuer_of(s.getpeercert(binary_form=True) or b"", bundle) == 0
        wait_for(serving_new, 60, "the store node serving a certificate of the new CA", interval=1)
        time.sleep(3)  # reads on the new certificates too
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    print(f"reads through the rotation: {tally}")
    assert tally["reads"] > 20 and tally["failed"] == 0 and tally["wrong"] == 0, (tally, errors[:3])
    wait_events(kube, namespace, {"CertificateAuthorityStaged", "CertificateAuthorityRotated"}, "rot")
    # The operator reaches the node with its new certificate: its Stats keep the pool Ready.
    st = wait_status(kube, namespace, "rot", lambda s: cond(s, "Ready") == ("True", "NodesReady"), 60,
                     "the pool Ready after the rotation")
    mine = Path(tls_operator.argv[-1]) / namespace / "rot" / "tls.crt"
    assert _issuer_of(x509_der(mine.read_bytes()), bundle) == 0


def x509_der(pem: bytes) -> bytes:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    return x509.load_pem_x509_certificate(pem).public_bytes(serialization.Encoding.DER)
