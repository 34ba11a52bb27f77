"""A transfer server in another process: TCP and same-host shared memory across processes,
and a peer killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import kvpool
from kvpool.transfer import TransferCode, TransferEngine, TransferRequest

SIZE = 8 << 20

SERVER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from kvpool.transfer import Segment, SegmentRegistry, TransferServer
    seg = Segment.shared("arena", {size}, sys.argv[1])
    np.frombuffer(seg.view, np.uint8)[:] = np.arange({size}, dtype=np.uint64).astype(np.uint8)
    registry = SegmentRegistry()
    registry.register(seg)
    server = TransferServer(registry).start()
    print(server.address, seg.path, flush=True)
    sys.stdin.read()  # until the test closes our stdin
    server.stop()
    seg.close()
    """
).format(size=SIZE)


@pytest.fixture
def server_process(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str, str]]:
    source_root = str(Path(kvpool.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=source_root)
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(tmp_path / "arena.shm")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None and proc.stdin is not None
    address, path = proc.stdout.readline().split()
    yield proc, address, path
    if proc.poll() is None:
        proc.stdin.close()
        proc.wait(10)
    else:
        proc.stdin.close()
    proc.stdout.close()


def _expected(offset: int, length: int) -> bytes:
    return (np.arange(offset, offset + length, dtype=np.uint64).astype(np.uint8)).tobytes()


def test_tcp_and_shm_across_processes(server_process: tuple[subprocess.Popen[str], str, str]) -> None:
    _, address, path = server_process
    with TransferEngine() as tcp, TransferEngine() as shm:
        shm.attach_shared(address, "arena", path)
        for engine in (tcp, shm):
            bufs = [bytearray(1 << 20) for _ in range(8)]
            reqs = [TransferRequest("read", memoryview(b), "arena", i << 20, 1 << 20) for i, b in enumerate(bufs)]
            assert all(s.ok for s in engine.submit(address, reqs).wait(30))
            assert all(bytes(b) == _expected(i << 20, 1 << 20) for i, b in enumerate(bufs))
        # written through shared memory, read back over TCP from the server's mapping
        payload = np.random.default_rng(1).integers(0, 256, 300_001, dtype=np.uint8)
        assert (
            shm.submit(address, [TransferRequest("write", payload.data, "arena", 12345, payload.size)]).wait(10)[0].ok
        )
        back = bytearray(payload.size)
        assert (
            tcp.submit(address, [TransferRequest("read", memoryview(back), "arena", 12345, payload.size)])
            .wait(10)[0]
            .ok
        )
        assert bytes(back) == payload.tobytes()


def test_peer_killed_gives_errors_not_hangs(server_process: tuple[subprocess.Popen[str], str, str]) -> None:
    proc, address, _ = server_process
    with TransferEngine(stall_timeout=5) as engine:
        buf = bytearray(4096)
        assert engine.submit(address, [TransferRequest("read", memoryview(buf), "arena", 0, 4096)]).wait(10)[0].ok
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        bufs = [bytearray(1 << 20) for _ in range(4)]
        reqs = [TransferRequest("read", memoryview(b), "arena", i << 20, 1 << 20) for i, b in enumerate(bufs)]
        statuses = engine.submit(address, reqs).wait(30)
        assert all(s.code is TransferCode.CONNECTION for s in statuses)
