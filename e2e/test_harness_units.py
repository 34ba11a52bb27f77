"""The harness's pure parts, without a cluster: go.mod derivation, $(VAR) expansion, the
downward API, and the hosts-file DNS stand-in."""

from __future__ import annotations

from typing import Any

import pytest

from e2e import build, nodeagent

GOMOD = """
module k8s.io/kubernetes

go 1.26.0

require (
	github.com/x/y v1.2.3
	k8s.io/api v0.0.0
	k8s.io/client-go v0.0.0 // indirect
)

require k8s.io/kubectl v0.0.0

replace (
	k8s.io/api => ./staging/src/k8s.io/api
	k8s.io/client-go => ./staging/src/k8s.io/client-go
	k8s.io/kubectl => ./staging/src/k8s.io/kubectl
	k8s.io/sample-controller => ./staging/src/k8s.io/sample-controller
	github.com/x/y => github.com/x/y v1.2.4
)
"""


def test_staging_replaces_are_derived_from_gomod() -> None:
    lines = build.k8s_staging_replaces(GOMOD, "v1.37.2")
    # Only the required staging modules (not the never-released sample), pinned to v0.37.2;
    # the non-local replace is no staging module and is left alone.
    assert lines == [
        "replace k8s.io/api => k8s.io/api v0.37.2",
        "replace k8s.io/client-go => k8s.io/client-go v0.37.2",
        "replace k8s.io/kubectl => k8s.io/kubectl v0.37.2",
    ]


def test_staging_replaces_refuse_a_gomod_without_staging() -> None:
    with pytest.raises(RuntimeError):
        build.k8s_staging_replaces("module x\n\nrequire k8s.io/api v0.1.0\n", "v1.37.2")


def test_etcd_style_single_line_replaces() -> None:
    text = "replace go.etcd.io/etcd/api/v3 => ../api\nreplace go.etcd.io/etcd/pkg/v3 v3.6.0 => ../pkg\n"
    assert build.local_replacements(text) == {"go.etcd.io/etcd/api/v3": "../api",
                                              "go.etcd.io/etcd/pkg/v3": "../pkg"}


@pytest.mark.parametrize(("value", "expected"), [
    ("$(A)-$(B)", "1-two"),
    ("$$(A)", "$(A)"),            # $$ escapes
    ("$(MISSING)", "$(MISSING)"),  # undefined references stay as written
    ("$A $(A", "$A $(A"),         # not references at all
    ("$$$(A)", "$1"),
])
def test_expand(value: str, expected: str) -> None:
    assert nodeagent.expand(value, {"A": "1", "B": "two"}) == expected


def _pod(name: str, ns: str, ip: str, labels: dict[str, str] | None = None,
         host: str | None = None, sub: str | None = None, ready: bool = True) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if host:
        spec["hostname"] = host
    if sub:
        spec["subdomain"] = sub
    return {"metadata": {"name": name, "namespace": ns, "uid": f"uid-{ns}-{name}",
                         "labels": labels or {}},
            "spec": spec,
            "status": {"podIP": ip,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_field_value() -> None:
    pod = _pod("p", "ns1", "127.0.10.9", labels={"app": "x"})
    assert nodeagent.field_value(pod, "metadata.name") == "p"
    assert nodeagent.field_value(pod, "status.podIP") == "127.0.10.9"
    assert nodeagent.field_value(pod, "metadata.labels['app']") == "x"
    with pytest.raises(nodeagent.ConfigError):
        nodeagent.field_value(pod, "spec.nonsense")


def test_hosts_file_maps_stable_names_and_ready_service_pods() -> None:
    me = _pod("web-1", "a", "127.0.10.3", {"app": "web"}, host="web-1", sub="web")
    web0 = _pod("web-0", "a", "127.0.10.2", {"app": "web"}, host="web-0", sub="web")
    unready = _pod("web-2", "a", "127.0.10.4", {"app": "web"}, host="web-2", sub="web",
                   ready=False)
    other_ns = _pod("db-0", "b", "127.0.10.5", {"app": "db"}, host="db-0", sub="db")
    svc = {"metadata": {"name": "web", "namespace": "a"}, "spec": {"selector": {"app": "web"}}}
    db = {"metadata": {"name": "db", "namespace": "b"}, "spec": {"selector": {"app": "db"}}}
    text = nodeagent.render_hosts(me, [me, web0, unready, other_ns], [svc, db])
    entries: dict[str, list[str]] = {}
    for line in text.splitlines():
        ip, *names = line.split()
        for n in names:
            entries.setdefault(n, []).append(ip)
    assert entries["web-0.web"] == ["127.0.10.2"]
    assert entries["web-0.web.a.svc.cluster.local"] == ["127.0.10.2"]
    assert entries["web-1"] == ["127.0.10.3"]
    # Stable names exist for unready pods too (as a headless service's DNS does for
    # StatefulSet pods); the service name only for the ready ones.
    assert entries["web-2.web"] == ["127.0.10.4"]
    assert sorted(entries["web"]) == ["127.0.10.2", "127.0.10.3"]
    # Another namespace's names only in qualified form.
    assert "db" not in entries and entries["db.b.svc.cluster.local"] == ["127.0.10.5"]
    assert "db-0.db" not in entries and entries["db-0.db.b"] == ["127.0.10.5"]
