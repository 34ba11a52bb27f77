"""Traffic classes: the default class of a write that names none, and the default TTL per class.

A traffic class tags every object (``put(..., traffic_class=...)``) and picks its time to live
on the store nodes.  The defaults below are a contract with the KVPool CRD (``spec.ttl``'s
default in ``crds/kvpool.yaml``): ``tests/kvpool_operator/test_crds.py`` fails if they differ.
Pure; the operator imports it too.
"""

from __future__ import annotations

DEFAULT_TRAFFIC_CLASS = "chatbot"
"""The class of a write that names none (the client's, the integrations', the nodes' default)."""

AGENT_TRAFFIC_CLASS = "agent"
"""Agentic sessions: shorter-lived prefixes than chat."""

DAY_SECONDS = 86400.0

DEFAULT_TTL: dict[str, str] = {AGENT_TRAFFIC_CLASS: "3d", DEFAULT_TRAFFIC_CLASS: "7d"}
"""Time to live per class, from last access, as the KVPool spec writes it (``spec.ttl``)."""

DEFAULT_TTL_SECONDS: dict[str, float] = {AGENT_TRAFFIC_CLASS: 3 * DAY_SECONDS,
                                         DEFAULT_TRAFFIC_CLASS: 7 * DAY_SECONDS}
"""The same in seconds: what a store node applies when its configuration names no TTL."""


def traffic_class_or_default(traffic_class: str) -> str:
    """``traffic_class``, or the default for the empty string (a proto3 field left unset)."""
    return traffic_class or DEFAULT_TRAFFIC_CLASS
