"""The simulated RDMA fabric (``kvpool/transfer/rdma_sim.py``) between two processes, and the
selection of a process's RDMA context (``open_context``, ``$KVPOOL_RDMA``).

The peer process registers memory and then blocks on its stdin: the READs and WRITEs of this
process reach its pages without it running, as one-sided operations do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvpool.transfer import TransferCode, TransferRequest
from kvpool.transfer.rdma import RdmaEndpoint, RdmaPeer, RdmaSegmentKey, open_context, rdma_status
from kvpool.transfer.rdma_sim import SIM_DEVICE, FabricContext

SIZE = 1 << 20

_PEER = textwrap.dedent("""
    import json, sys
    import numpy as np
    from kvpool.arena.dram import DramTier
    from kvpool.transfer.rdma import RdmaEndpoint
    from kvpool.transfer.rdma_sim import FabricContext
    arena = DramTier(%(size)d, "/dev/shm", label="fabric-test")  # unlinked at once, as a store's
    arena.view[:] = np.arange(%(size)d, dtype=np.uint32).view(np.uint8)[:%(size)d]
    ctx = FabricContext(sys.argv[1])
    key = ctx.register("arena", arena.view)
    remote = RdmaEndpoint.decode(bytes.fromhex(sys.stdin.readline().strip()))
    qp = ctx.accept(remote)
    print(json.dumps({"key": key.encode().hex(), "endpoint": qp.endpoint.encode().hex()}), flush=True)
    sys.stdin.readline()  # blocked here while the other process reads and writes our pages
    sys.stdout.write(bytes(arena.view[:8]).hex() + "\\n")
    sys.stdout.flush()
    sys.stdin.readline()
    ctx.close()
""")


def _pattern() -> bytes:
    return np.arange(SIZE, dtype=np.uint32).view(np.uint8)[:SIZE].tobytes()


class Peer:
    def __init__(self, fabric: str, ours: FabricContext) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        self.proc = subprocess.Popen([sys.executable, "-c", _PEER % {"size": SIZE}, fabric], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.qp = ours.create_queue_pair()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(self.qp.endpoint.encode().hex() + "\n")
        self.proc.stdin.flush()
        doc = json.loads(self.proc.stdout.readline())
        self.key = RdmaSegmentKey.decode(bytes.fromhex(doc["key"]))
        self.qp.connect(RdmaEndpoint.decode(bytes.fromhex(doc["endpoint"])))
        self.peer = RdmaPeer(self.qp, [self.key], stall_timeout=5.0)

    def step(self) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        self.peer.close()
        self.proc.kill()
        self.proc.wait(30)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


@pytest.fixture
def peer(tmp_path: Path) -> Iterator[tuple[Peer, FabricContext]]:
    fabric = str(tmp_path)
    ours = FabricContext(fabric)
    p = Peer(fabric, ours)
    try:
        yield p, ours
    finally:
        p.close()
        ours.close()


def test_one_sided_read_and_write_reach_the_peer_process_pages(peer: tuple[Peer, FabricContext]) -> None:
    p, _ = peer
    out = np.zeros(SIZE, np.uint8)
    head = np.zeros(4096, np.uint8)
    src = np.frombuffer(b"kvpool!!", np.uint8).copy()
    statuses = p.peer.run([TransferRequest("read", memoryview(out), "arena", 0, SIZE),
                           TransferRequest("read", memoryview(head), "arena", SIZE - 4096, 4096),
                           TransferRequest("write", memoryview(src), "arena", 0, 8)])
    assert [s.ok for s in statuses] == [True, True, True]
    assert out.tobytes() == _pattern()
    assert head.tobytes() == _pattern()[-4096:]
    assert bytes.fromhex(p.step()) == b"kvpool!!"  # the peer sees our WRITE in its own arena


def test_faults_out_of_bounds_and_a_gone_peer_fail_the_requests(peer: tuple[Peer, FabricContext]) -> None:
    p, ours = peer
    bufs = [np.zeros(4096, np.uint8) for _ in range(4)]
    with open(os.path.join(ours.directory, "fault"), "w") as f:
        f.write("fail-after 1")
    statuses = p.peer.run([TransferRequest("read", memoryview(b), "arena", i * 4096, 4096)
                           for i, b in enumerate(bufs)])
    assert [s.code for s in statuses] == [TransferCode.OK] + [TransferCode.CONNECTION] * 3
    assert bufs[0].tobytes() == _pattern()[:4096]
    assert p.peer.broken  # an RC queue pair in error: the reader drops it
    os.unlink(os.path.join(ours.directory, "fault"))
    fresh = RdmaPeer(p.qp, [p.key])
    try:
        past = fresh.run([TransferRequest("read", memoryview(bufs[1]), "arena", SIZE - 100, 4096)])
        assert past[0].code is TransferCode.OUT_OF_BOUNDS
        p.proc.kill()
        p.proc.wait(30)
        gone = fresh.run([TransferRequest("read", memoryview(bufs[1]), "arena", 0, 4096)])
        assert gone[0].code is TransferCode.CONNECTION
    finally:
        fresh.close()


def test_connect_needs_a_queue_pair_on_the_same_fabric(tmp_path: Path) -> None:
    a, b = FabricContext(os.path.join(str(tmp_path), "a")), FabricContext(os.path.join(str(tmp_path), "b"))
    try:
        theirs = b.create_queue_pair()
        with pytest.raises(ConnectionError):
            a.accept(theirs.endpoint)  # another fabric: no route to it
        theirs.close()
    finally:
        a.close()
        b.close()


def test_open_context_follows_the_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert open_context("off") == (None, "RDMA is off")
    ctx, reason = open_context(f"sim:{tmp_path}")
    assert reason == "" and isinstance(ctx, FabricContext) and ctx.device == SIM_DEVICE
    ctx.close()
    monkeypatch.setenv("KVPOOL_RDMA", f"sim:{tmp_path}")
    ctx, _ = open_context("")
    assert isinstance(ctx, FabricContext)
    ctx.close()
    with pytest.raises(ValueError):
        open_context("infiniband-please")
    devices, why = rdma_status()
    ctx, reason = open_context("auto")
    if devices:
        assert ctx is not None
        ctx.close()
    else:  # this machine: no device, and the reason says why
        assert ctx is None and why in reason
