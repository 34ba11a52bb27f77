"""RDMA transport (placeholder until the pyverbs implementation lands)."""

from __future__ import annotations


def rdma_status() -> tuple[list[str], str]:
    return [], "pyverbs not implemented yet"


def rdma_devices() -> list[str]:
    return rdma_status()[0]
