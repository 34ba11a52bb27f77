"""Fixtures for the transfer engine tests: real servers on 127.0.0.1, a cutting proxy, guards."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import numpy.typing as npt
import pytest

from kvpool.transfer import SegmentRegistry, TransferEngine, TransferServer, rdma
from kvpool.transfer.testing import CuttingProxy, RecordingGuard, Remote, random_bytes

MakeRemote = Callable[..., Remote]


@pytest.fixture
def make_remote(monkeypatch: pytest.MonkeyPatch) -> Iterator[MakeRemote]:
    """``make_remote(kind, **engine_args)``: a started server and an engine reaching it."""
    made: list[Remote] = []

    def make(kind: str = "tcp", **engine_args: object) -> Remote:
        if kind == "rdma":
            devices, reason = rdma.rdma_status()
            if not devices:
                pytest.skip(f"no RDMA devices: {reason}")
        if kind == "rdma-sim":  # the engine only takes RDMA where a device exists
            monkeypatch.setattr(rdma, "rdma_status", lambda refresh=False: (["sim0"], ""))
        registry = SegmentRegistry()
        server = TransferServer(registry).start()
        engine = TransferEngine(**engine_args)  # type: ignore[arg-type]
        remote = Remote(kind, registry, server, engine)
        made.append(remote)
        return remote

    yield make
    for remote in made:
        remote.close()


@pytest.fixture
def proxy() -> Iterator[Callable[[str, Callable[[int], int | None]], CuttingProxy]]:
    made: list[CuttingProxy] = []

    def make(upstream: str, cut: Callable[[int], int | None]) -> CuttingProxy:
        p = CuttingProxy(upstream, cut)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


@pytest.fixture
def rand() -> Callable[[int, int], npt.NDArray[np.uint8]]:
    """``rand(n, seed)``: ``n`` reproducible random bytes as a uint8 array."""
    return random_bytes


@pytest.fixture
def guard_factory() -> type[RecordingGuard]:
    return RecordingGuard
