"""The security contexts of the pods and containers the operator makes (store nodes, router,
injected sidecar): the image's own user, a read-only root filesystem, no capabilities.

``IMAGE_UID``/``IMAGE_GID`` are the user and group the Dockerfile creates (``USER 65532:65532``,
the group with that fixed gid); the chart's ``podSecurityContext`` names the same pair, and
tests/kvpool_operator/test_podsecurity.py checks that the three agree.  Every path a kvpool process
writes is a volume (the shared-memory emptyDirs, the SSD claim, a shared filesystem), so the root
filesystem can be read-only for every role.
"""

from __future__ import annotations

from typing import Any

IMAGE_UID = 65532
IMAGE_GID = 65532


def pod_security_context() -> dict[str, Any]:
    """For the pods the operator owns.  ``fsGroup``: the kubelet makes the Secret volumes (admin
    token, master key: mode 0400) and the SSD claim readable, or writable, by the image's group;
    without it the store node, not root, could read neither."""
    return {"runAsNonRoot": True, "runAsUser": IMAGE_UID, "runAsGroup": IMAGE_GID, "fsGroup": IMAGE_GID,
            "seccompProfile": {"type": "RuntimeDefault"}}


def container_security_context() -> dict[str, Any]:
    """For every kvpool container, the injected sidecar included: there the pod's own context
    belongs to the engine, so the user and group are set on the container."""
    return {"runAsNonRoot": True, "runAsUser": IMAGE_UID, "runAsGroup": IMAGE_GID,
            "readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]}}
