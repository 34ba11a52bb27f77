"""The pool's certificates at the edge: Secrets created once and owned by the pool, left alone
while current, renewed on a CA rotation; the operator's files and expiry gauge; the store pods
mounting ``<pool>-store-tls`` with ``--tls-dir`` when TLS is on.

The Kubernetes API is an in-memory stand-in with the three calls pool_tls makes (the real API
server runs the same code in the e2e tests of the operator)."""

from __future__ import annotations

import copy
import datetime as dt
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("cryptography", reason="the certificate builders need the dataplane extra")

from kvpool.core import pki  # noqa: E402
from kvpool_operator import certs, children, metrics, pool_tls  # noqa: E402
from kvpool_operator.kube import KubeError  # noqa: E402
from kvpool_operator.model import parse_pool, parse_tenant, resolve_layout  # noqa: E402
from kvpool_operator.settings import Settings  # noqa: E402
from kvpool_operator.testing import pool_body, tenant_body  # noqa: E402


class Secrets:
    """get / create (None on conflict) / apply over a dict, counting writes."""

    def __init__(self, namespaces: tuple[str, ...] = ("ns",)) -> None:
        self.objs: dict[tuple[str, str], dict[str, Any]] = {}
        self.writes: list[str] = []
        self.namespaces = namespaces
        self.events: list[str] = []

    def _exists(self, obj: dict[str, Any]) -> None:
        if obj["metadata"]["namespace"] not in self.namespaces:
            raise KubeError(404, "namespaces not found")

    def get(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        got = self.objs.get((namespace or "", name))
        return copy.deepcopy(got) if got else None

    def create(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        self._exists(obj)
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        if key in self.objs:
            return None
        self.objs[key] = copy.deepcopy(obj)
        self.writes.append(key[1])
        return obj

    def event(self, obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
        self.events.append(reason)

    def list(self, api_version: str, kind: str, namespace: str | None = None,
             selector: str | None = None) -> list[dict[str, Any]]:
        want = dict(kv.split("=", 1) for kv in (selector or "").split(",") if kv)
        return [copy.deepcopy(o) for (ns, _), o in self.objs.items() if namespace in (None, ns)
                and want.items() <= (o["metadata"].get("labels") or {}).items()]

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> bool:
        self.writes.append(f"-{namespace}/{name}")
        return self.objs.pop((namespace or "", name), None) is not None

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        self._exists(obj)
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        self.objs[key] = copy.deepcopy(obj)
        self.writes.append(key[1])
        return obj


POOL = parse_pool(pool_body("p", "ns"))
POLICY = certs.CertPolicy(ca_days=100, ca_margin=dt.timedelta(days=20), leaf_days=30,
                          leaf_margin=dt.timedelta(days=5))


def test_secrets_created_owned_and_then_left_alone(tmp_path: Path) -> None:
    kube = Secrets()
    now = dt.datetime.now(dt.UTC)
    cfg = pool_tls.ensure_pool_tls(kube, POOL, str(tmp_path), POLICY, now)  # type: ignore[arg-type]
    assert sorted(kube.writes) == ["p-ca", "p-ca-bundle", "p-operator-tls", "p-store-tls"]
    for (_, name), obj in kube.objs.items():
        assert obj["metadata"]["ownerReferences"] == [children.owner_reference(POOL)], name
    store = certs.decode(kube.objs[("ns", "p-store-tls")])
    assert kube.objs[("ns", "p-store-tls")]["type"] == "kubernetes.io/tls"
    assert pki.identity_of(store[certs.TLS_CERT_KEY]) == pki.node("p-store")
    # The operator's files: its identity, the pool's bundle, the store nodes' serving name.
    assert pki.identity_of(Path(cfg.cert_file).read_bytes()) == pki.operator()
    assert Path(cfg.ca_file).read_bytes() == store[certs.CA_CERT_KEY]
    assert cfg.server_name == "p-store.ns.svc" and cfg.cert_file.startswith(str(tmp_path / "ns" / "p"))
    got = metrics.REGISTRY.get_sample_value("kvpool_certificate_expiry_timestamp_seconds",
                                            {"pool_namespace": "ns", "pool": "p", "kind": "serving"})
    assert got == pki.not_after(store[certs.TLS_CERT_KEY]).timestamp()
    kube.writes.clear()
    pool_tls.ensure_pool_tls(kube, POOL, str(tmp_path), POLICY, now + dt.timedelta(days=1))  # type: ignore[arg-type]
    assert kube.writes == []


def _issuer(data: certs.Data) -> bytes:
    """The CA certificate of the leaf's bundle that signed its certificate."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature

    leaf = x509.load_pem_x509_certificate(data[certs.TLS_CERT_KEY])
    for ca in pki.split_bundle(data[certs.CA_CERT_KEY]):
        try:
            leaf.verify_directly_issued_by(x509.load_pem_x509_certificate(ca))
            return ca
        except (ValueError, InvalidSignature):
            continue
    raise AssertionError("no CA of the bundle signed the leaf")


def test_ca_rotation_stages_then_reissues_every_leaf_with_the_bundle(tmp_path: Path) -> None:
    kube = Secrets()
    start = dt.datetime.now(dt.UTC) - dt.timedelta(days=85)
    pool_tls.ensure_pool_tls(kube, POOL, str(tmp_path), POLICY, start)  # type: ignore[arg-type]
    old_ca = certs.decode(kube.objs[("ns", "p-ca")])[certs.CA_CERT_KEY]
    kube.writes.clear()
    now = dt.datetime.now(dt.UTC)
    # Step 1: the new CA joins every bundle; no leaf changes.
    pool_tls.ensure_pool_tls(kube, POOL, str(tmp_path), POLICY, now)  # type: ignore[arg-type]
    grown = certs.decode(kube.objs[("ns", "p-ca")])[certs.CA_CERT_KEY]
    assert pki.split_bundle(grown)[0] == old_ca and len(pki.split_bundle(grown)) == 2
    store = certs.decode(kube.objs[("ns", "p-store-tls")])
    assert _issuer(store) == old_ca and store[certs.CA_CERT_KEY] == grown
    # Step 2, ca_propagation later: the new CA signs, every leaf is re-issued from it.
    kube.writes.clear()
    cfg = pool_tls.ensure_pool_tls(kube, POOL, str(tmp_path), POLICY, now + POLICY.ca_propagation)  # type: ignore[arg-type]
    assert sorted(kube.writes) == ["p-ca", "p-ca-bundle", "p-operator-tls", "p-store-tls"]
    bundle = certs.decode(kube.objs[("ns", "p-ca")])[certs.CA_CERT_KEY]
    assert pki.split_bundle(bundle)[1:] == pki.split_bundle(old_ca)
    assert certs.decode(kube.objs[("ns", "p-store-tls")])[certs.CA_CERT_KEY] == bundle
    assert _issuer(certs.decode(kube.objs[("ns", "p-store-tls")])) == pki.split_bundle(bundle)[0]
    assert Path(cfg.ca_file).read_bytes() == bundle
    assert kube.objs[("ns", "p-ca-bundle")]["data"] == {"ca.crt": bundle.decode()}  # the router's callers


def test_store_pods_mount_the_store_secret_when_tls_is_on() -> None:
    pool = POOL
    layout = resolve_layout(pool, {}, 1 << 30, 1 << 28)
    assert Settings().tls  # on by default
    off = children.stateful_set(pool, layout, Settings(tls=False), 1)["spec"]["template"]["spec"]
    assert "--tls-dir" not in off["containers"][0]["args"]
    assert all(v["name"] != "tls" for v in off["volumes"])
    on = children.stateful_set(pool, layout, Settings(tls=True), 1)["spec"]["template"]["spec"]
    args = on["containers"][0]["args"]
    assert args[args.index("--tls-dir") + 1] == children.TLS_DIR
    assert args[args.index("--tls-server-name") + 1] == "p-store.ns.svc"
    assert {"name": "tls", "secret": {"secretName": "p-store-tls", "defaultMode": 0o400}} in on["volumes"]
    assert {"name": "tls", "mountPath": children.TLS_DIR, "readOnly": True} in on["containers"][0]["volumeMounts"]


def test_data_session_opt_out_reaches_the_store_flag() -> None:
    """spec.security.dataSession: Plaintext → ``--plaintext-data-session`` on the store nodes
    (only with TLS: without it every channel is plaintext already); Encrypted is the default, and
    anything else is a spec error."""
    from kvpool.store.main import build_parser
    from kvpool_operator.model import SpecError

    layout = resolve_layout(POOL, {}, 1 << 30, 1 << 28)
    assert not POOL.plaintext_data_session
    enc = children.store_container(POOL, layout, Settings(tls=True))["args"]
    assert "--plaintext-data-session" not in enc
    plain = parse_pool(pool_body("p", "ns", security={"dataSession": "Plaintext"}))
    assert plain.plaintext_data_session
    args = children.store_container(plain, layout, Settings(tls=True))["args"]
    assert "--plaintext-data-session" in args and "--tls-dir" in args
    assert build_parser().parse_args(args).plaintext_data_session  # the store takes what is rendered
    assert "--plaintext-data-session" not in children.store_container(plain, layout, Settings(tls=False))["args"]
    with pytest.raises(SpecError, match="dataSession"):
        parse_pool(pool_body("p", "ns", security={"dataSession": "Off"}))


def test_tenant_certificates_issued_in_each_namespace_from_the_pools_ca(tmp_path: Path) -> None:
    kube = Secrets(("ns", "app1", "app2"))
    tn = parse_tenant(tenant_body("a", "team-a", ["app1", "app2", "gone"], [{"pool": "ns.p"}]))
    # No CA yet: the pool reconcile creates it; the tenant waits.
    assert pool_tls.ensure_tenant_tls(kube, tn, "ns", "p", POLICY) == [] and kube.writes == []  # type: ignore[arg-type]
    pool_tls.ensure_pool_tls(kube, POOL, str(tmp_path), POLICY)  # type: ignore[arg-type]
    kube.writes.clear()
    missing = pool_tls.ensure_tenant_tls(kube, tn, "ns", "p", POLICY)  # type: ignore[arg-type]
    assert missing == ["gone"] and kube.writes == ["kvpool-tls-ns.p", "kvpool-tls-ns.p"]
    bundle = certs.decode(kube.objs[("ns", "p-ca")])[certs.CA_CERT_KEY]
    for ns in ("app1", "app2"):
        sec = kube.objs[(ns, "kvpool-tls-ns.p")]
        data = certs.decode(sec)
        assert pki.identity_of(data[certs.TLS_CERT_KEY]) == pki.tenant("team-a")
        assert data[certs.CA_CERT_KEY] == bundle
        assert sec["metadata"]["ownerReferences"][0]["kind"] == "TenantNamespace"
    kube.writes.clear()
    pool_tls.ensure_tenant_tls(kube, tn, "ns", "p", POLICY)  # type: ignore[arg-type]
    assert kube.writes == []


def test_a_ca_created_concurrently_is_never_overwritten(tmp_path: Path) -> None:
    kube = Secrets()
    pool_tls.ensure_pool_tls(kube, POOL, str(tmp_path), POLICY)  # type: ignore[arg-type]
    theirs = copy.deepcopy(kube.objs[("ns", "p-ca")])
    blind = Secrets()
    blind.objs = kube.objs
    blind.get = lambda *a, **k: None  # type: ignore[method-assign]  # read before the other writer
    with pytest.raises(KubeError) as err:
        pool_tls.ensure_ca(blind, POOL, dt.datetime.now(dt.UTC), POLICY)  # type: ignore[arg-type]
    assert err.value.conflict and kube.objs[("ns", "p-ca")] == theirs


def test_stale_tenant_certificates_deleted_only_when_ours(tmp_path: Path) -> None:
    kube = Secrets(("ns", "app1", "app2"))
    pool_tls.ensure_pool_tls(kube, POOL, str(tmp_path), POLICY)  # type: ignore[arg-type]
    tn = parse_tenant(tenant_body("a", "team-a", ["app1", "app2"], [{"pool": "ns.p"}]))
    pool_tls.ensure_tenant_tls(kube, tn, "ns", "p", POLICY)  # type: ignore[arg-type]
    kube.objs[("app2", "kvpool-tls-ns.p")]["metadata"]["labels"]["kvpool.io/tenant-namespace"] = "someone-else"
    deleted: list[tuple[str, str]] = []
    kube.delete = lambda _v, _k, name, ns: deleted.append((ns, name)) or True  # type: ignore[attr-defined]
    left = parse_tenant(tenant_body("a", "team-a", ["ns"], [{"pool": "ns.p"}]))
    pool_tls.prune_tenant_tls(kube, left, ["app1", "app2"], ["ns.p"])  # type: ignore[arg-type]
    assert deleted == [("app1", "kvpool-tls-ns.p")]


def test_ca_created_staged_and_rotated_are_events(tmp_path: Path) -> None:
    kube = Secrets()
    body = pool_body("p", "ns")
    start = dt.datetime.now(dt.UTC) - dt.timedelta(days=85)
    now = dt.datetime.now(dt.UTC)
    for at in (start, start, now, now, now + POLICY.ca_propagation, now + POLICY.ca_propagation):
        pool_tls.ensure_pool_tls(kube, POOL, str(tmp_path), POLICY, at, body)  # type: ignore[arg-type]
    assert kube.events == ["CertificateAuthorityCreated", "CertificateAuthorityStaged", "CertificateAuthorityRotated"]


def test_default_tenant_certificates_follow_the_pools_namespaces(tmp_path: Path) -> None:
    """With a default tenant the pool issues ``kvpool-default-tls-<pool key>`` (identity
    ``tenant/default``: what a sidecar without --tenant is) in its own namespace, owned by it; with
    spec.sidecar.namespaces in those instead (not owned: an ownerReference cannot cross
    namespaces), and it deletes the ones it no longer wants; none without a default tenant."""
    kube = Secrets(("ns", "app1", "app2"))
    name = "kvpool-default-tls-ns.p"
    pool = parse_pool(pool_body("p", "ns", tenancy={"defaultTenant": "public"}))
    pool_tls.ensure_pool_tls(kube, pool, str(tmp_path), POLICY)  # type: ignore[arg-type]
    sec = kube.objs[("ns", name)]
    assert sec["metadata"]["ownerReferences"] == [children.owner_reference(pool)]
    data = certs.decode(sec)
    assert pki.identity_of(data[certs.TLS_CERT_KEY]) == pki.tenant("default")
    assert data[certs.CA_CERT_KEY] == certs.decode(kube.objs[("ns", "p-ca")])[certs.CA_CERT_KEY]
    listed = parse_pool(pool_body("p", "ns", tenancy={"defaultTenant": "public"},
                                  sidecar={"namespaces": ["app1", "app2", "gone"]}))
    pool_tls.ensure_pool_tls(kube, listed, str(tmp_path), POLICY)  # type: ignore[arg-type]
    assert {ns for ns, n in kube.objs if n == name} == {"app1", "app2"}
    assert kube.objs[("app1", name)]["metadata"]["ownerReferences"] == []
    kube.writes.clear()
    pool_tls.ensure_pool_tls(kube, listed, str(tmp_path), POLICY)  # type: ignore[arg-type]
    assert kube.writes == []
    pool_tls.ensure_pool_tls(kube, POOL, str(tmp_path), POLICY)  # type: ignore[arg-type]  # no default tenant
    assert not [n for _, n in kube.objs if n == name]
    pool_tls.ensure_pool_tls(kube, listed, str(tmp_path), POLICY)  # type: ignore[arg-type]
    pool_tls.forget_pool(kube, pool_body("p", "ns", tenancy={"defaultTenant": "public"}))  # type: ignore[arg-type]
    assert not [n for _, n in kube.objs if n == name]


def test_router_certificate_serves_its_service_and_is_verified_with_the_published_bundle(tmp_path: Path) -> None:
    """With the router on, ``<pool>-router-tls`` (identity router, the router Service's names)
    from the pool's CA; a caller holding only the ``<pool>-ca-bundle`` ConfigMap verifies it."""
    import socket
    import ssl
    import threading

    kube = Secrets()
    pool = parse_pool(pool_body("p", "ns", router={"enabled": True}))
    pool_tls.ensure_pool_tls(kube, pool, str(tmp_path), POLICY)  # type: ignore[arg-type]
    sec = kube.objs[("ns", "p-router-tls")]
    assert sec["metadata"]["ownerReferences"] == [children.owner_reference(pool)]
    data = certs.decode(sec)
    assert pki.identity_of(data[certs.TLS_CERT_KEY]) == pki.Identity(pki.ROLE_ROUTER)
    (tmp_path / "r.crt").write_bytes(data[certs.TLS_CERT_KEY])
    (tmp_path / "r.key").write_bytes(data[certs.TLS_KEY_KEY])
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(tmp_path / "r.crt", tmp_path / "r.key")
    client = ssl.create_default_context(cadata=kube.objs[("ns", "p-ca-bundle")]["data"]["ca.crt"])
    a, b = socket.socketpair()
    with a, b:
        t = threading.Thread(target=lambda: server.wrap_socket(a, server_side=True).close())
        t.start()
        client.wrap_socket(b, server_hostname="p-router.ns.svc").close()
        t.join(5)
    off = Secrets()
    pool_tls.ensure_pool_tls(off, POOL, str(tmp_path), POLICY)  # type: ignore[arg-type]
    assert ("ns", "p-router-tls") not in off.objs  # no router, no certificate


class Refusing(Secrets):
    """An API server that refuses Secret writes (RBAC, a quota on Secrets, a webhook)."""

    def create(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        raise KubeError(403, "secrets is forbidden")

    apply = create


def test_a_refused_secret_write_is_a_problem_and_the_last_certificate_is_kept(tmp_path: Path) -> None:
    cfg, problem = pool_tls.pool_tls_or_problem(Refusing(), POOL, str(tmp_path), POLICY)
    assert cfg is None and problem is not None and problem[0] == "CertificatesUnavailable"
    assert "403" in problem[1] and certs.store_tls_secret_name("p") in problem[1]
    # With a certificate written by an earlier reconcile, admin calls go on with it.
    written, none = pool_tls.pool_tls_or_problem(Secrets(), POOL, str(tmp_path), POLICY)
    assert none is None and written is not None
    kept, problem = pool_tls.pool_tls_or_problem(Refusing(), POOL, str(tmp_path), POLICY)
    assert problem is not None and kept is not None and kept.cert_file == written.cert_file
