"""The security contexts of what the operator builds, and the one uid/gid the image, the chart and
the operator share (kvpool_operator.podsecurity)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from kvpool_operator import children
from kvpool_operator.engines import copy_container
from kvpool_operator.injection import SIDECAR_NAME, PoolView, plan_injection
from kvpool_operator.model import parse_pool, parse_tenant, resolve_layout
from kvpool_operator.podsecurity import IMAGE_GID, IMAGE_UID
from kvpool_operator.settings import Settings
from kvpool_operator.testing import apply_merge_patch, pool_body, tenant_body

ROOT = Path(__file__).resolve().parents[2]
S = Settings()


def _hardened(ctx: dict[str, Any]) -> None:
    assert ctx["runAsUser"] == IMAGE_UID and ctx["runAsGroup"] == IMAGE_GID and ctx["runAsNonRoot"] is True
    assert ctx["readOnlyRootFilesystem"] is True and ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"] == {"drop": ["ALL"]}


def test_the_image_the_chart_and_the_operator_name_one_user_and_group() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f"USER {IMAGE_UID}:{IMAGE_GID}" in dockerfile
    # The group exists with that gid, and is the user's primary group: containerd takes the gid
    # from /etc/passwd (a system group's 999 ran before).
    assert re.search(rf"groupadd [^\n]*--gid {IMAGE_GID}\b", dockerfile)
    assert re.search(rf"useradd [^\n]*--uid {IMAGE_UID} --gid {IMAGE_GID}\b", dockerfile)
    values = yaml.safe_load((ROOT / "charts/kvpool/values.yaml").read_text())
    pod = values["podSecurityContext"]
    assert (pod["runAsUser"], pod["runAsGroup"], pod["fsGroup"]) == (IMAGE_UID, IMAGE_GID, IMAGE_GID)
    assert values["securityContext"]["readOnlyRootFilesystem"] is True


def test_store_pods_run_as_the_image_user_with_a_read_only_root() -> None:
    pool = parse_pool(pool_body(router={"enabled": True}))
    layout = resolve_layout(pool, {}, S.default_dram_bytes, S.store_memory_overhead_bytes)
    for m in children.children(pool, layout, S, 2):
        if m["kind"] not in ("StatefulSet", "Deployment"):
            continue
        spec = m["spec"]["template"]["spec"]
        # fsGroup: the 0400 Secret volumes (admin token, master key) are readable by the group.
        assert spec["securityContext"]["fsGroup"] == IMAGE_GID, m["kind"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        for c in spec["containers"]:
            _hardened(c["securityContext"])


def test_the_injected_sidecar_sets_its_own_user_and_can_read_its_credentials() -> None:
    """The engine's pod context is the user's (it may run as root, or set no fsGroup): the
    sidecar container names its user itself, and the tenant Secret is readable by it."""
    pools = {("pools", "closed"): PoolView("pools", "closed", local_bytes=64 << 20, drain_seconds=20,
                                           seeds=("svc:7400",))}
    tenant = parse_tenant(tenant_body("a", "team-a", ["app"], [{"pool": "pools.closed"}]))
    pod = {"metadata": {"name": "e", "labels": {"kvpool.io/pool": "pools.closed"}},
           "spec": {"securityContext": {"runAsUser": 0}, "containers": [{"name": "engine", "image": "e"}]}}
    r = plan_injection(pod, "app", pools, [tenant], S)
    assert r.injected
    patched = apply_merge_patch(pod, r.patch)
    side = next(c for c in patched["spec"]["initContainers"] if c["name"] == SIDECAR_NAME)
    _hardened(side["securityContext"])
    assert patched["spec"]["securityContext"] == {"runAsUser": 0}  # the user's, untouched
    secret = next(v for v in patched["spec"]["volumes"] if "secret" in v)["secret"]
    assert secret["defaultMode"] & 0o004  # root-owned files without fsGroup: readable by others
    _hardened(copy_container("img", "IfNotPresent")["securityContext"])
