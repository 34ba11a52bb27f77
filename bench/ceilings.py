"""Physical ceilings on this machine: numpy memcpy, raw Python TCP streams (1 and 2
connections) and raw request/response over a unix socket and over TCP.

The server side runs as its own process (`python -m bench.ceilings serve ...`) so client and
server do not share a GIL, as with every real system measured here.

Wire protocol (both transports): the client sends 9 bytes: op ('G' or 'P') + length (u64 LE).
'G': the server answers with `length` bytes (sendall of a memoryview over a preallocated
buffer); 'P': the client then sends `length` bytes, the server reads them with recv_into into a
preallocated buffer and answers one byte. 'Z' (length 0) is a ping: the server answers one byte.
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    Context,
    CpuMeter,
    MiB,
    Row,
    free_port,
    python_env,
    row_from_times,
    timed,
    timed_cpu,
    touched,
    with_cpu,
)

HDR = struct.Struct("<cQ")
SERVER_BUF = 64 * MiB


# --------------------------------------------------------------------------------------------
# server process


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    # MSG_WAITALL: the kernel fills the whole view in one call, without the GIL; the loop only
    # covers the rare short return (a signal).
    got = 0
    n = len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            return False
        got += k
    return True


def _serve_conn(conn: socket.socket, buf: memoryview) -> None:
    hdr = bytearray(HDR.size)
    hview = memoryview(hdr)
    with conn:
        while True:
            if not _recv_exact(conn, hview):
                return
            op, n = HDR.unpack(hdr)
            if op == b"G":
                while n > 0:
                    k = min(n, len(buf))
                    conn.sendall(buf[:k])
                    n -= k
            elif op == b"Z":
                conn.sendall(b"z")
            elif op == b"P":
                while n > 0:
                    k = min(n, len(buf))
                    if not _recv_exact(conn, buf[:k]):
                        return
                    n -= k
                conn.sendall(b"k")
            else:
                return


def serve(tcp_port: int, uds_path: str) -> None:
    buf = touched(SERVER_BUF, 0x33).data
    listeners: list[socket.socket] = []
    t = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    t.bind(("127.0.0.1", tcp_port))
    t.listen(16)
    listeners.append(t)
    with_uds = bool(uds_path)
    if with_uds:
        if os.path.exists(uds_path):
            os.unlink(uds_path)
        u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        u.bind(uds_path)
        u.listen(16)
        listeners.append(u)

    def accept_loop(ls: socket.socket) -> None:
        while True:
            conn, _ = ls.accept()
            if conn.family == socket.AF_INET:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # Each connection has its own buffer view; sharing one is fine for a ceiling
            # (contents do not matter, only the bytes moved).
            threading.Thread(target=_serve_conn, args=(conn, buf), daemon=True).start()

    for ls in listeners[1:]:
        threading.Thread(target=accept_loop, args=(ls,), daemon=True).start()
    print("READY", flush=True)
    accept_loop(listeners[0])


# --------------------------------------------------------------------------------------------
# client side


class _Conn:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.ack = bytearray(1)

    def get(self, dst: memoryview) -> None:
        self.sock.sendall(HDR.pack(b"G", len(dst)))
        if len(dst) and not _recv_exact(self.sock, dst):
            raise ConnectionError("server closed")

    def ping(self) -> None:
        self.sock.sendall(HDR.pack(b"Z", 0))
        if not _recv_exact(self.sock, memoryview(self.ack)):
            raise ConnectionError("server closed")

    def put(self, src: memoryview) -> None:
        self.sock.sendall(HDR.pack(b"P", len(src)))
        self.sock.sendall(src)
        if not _recv_exact(self.sock, memoryview(self.ack)):
            raise ConnectionError("server closed")

    def close(self) -> None:
        self.sock.close()


def _tcp(port: int) -> _Conn:
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return _Conn(s)


def _uds(path: str) -> _Conn:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    return _Conn(s)


def memcpy_rows(ctx: Context) -> list[Row]:
    """numpy copyto: 1 MiB cache-hot, 256 MiB, and each cell's batch into distinct buffers."""
    plan = ctx.plan
    rows: list[Row] = []
    a = touched(MiB, 1)
    b = touched(MiB, 2)
    t = timed(lambda i: np.copyto(b, a), 50 if plan.quick else 400, warmup=20)
    rows.append(row_from_times("memcpy", "copy (cache-hot)", MiB, 1, t))
    big_a = touched(256 * MiB, 1)
    big_b = touched(256 * MiB, 2)
    t = timed(lambda i: np.copyto(big_b, big_a), 5 if plan.quick else 11, warmup=1)
    rows.append(row_from_times("memcpy", "copy", 256 * MiB, 1, t))
    # Cells: batch values copied from a 256 MiB source into a 256 MiB destination, walking
    # through both so a small cell is not served from cache.
    pool = 256 * MiB
    for v, nb in plan.cells():
        span = v * nb
        slots = max(1, pool // span)

        def one(i: int, v: int = v, nb: int = nb, span: int = span, slots: int = slots) -> None:
            base = (i % slots) * span
            for j in range(nb):
                o = base + j * v
                np.copyto(big_b[o:o + v], big_a[o:o + v])
        t = timed(one, plan.reps(v, nb), warmup=plan.warmup)
        rows.append(row_from_times("memcpy", "copy", v, nb, t))
    return rows


def network_rows(ctx: Context) -> list[Row]:
    """Raw TCP streams (1, 2 and 4 connections), request/response over TCP and unix socket."""
    plan = ctx.plan
    port = free_port()
    uds = str(ctx.work_dir / "ceiling.sock")
    rows: list[Row] = []
    with ctx.procs.scope() as procs:
        server = procs.start("ceiling-server",
                    [sys.executable, "-m", "bench.ceilings", "serve", "--tcp-port", str(port),
                     "--uds", uds], env=python_env(), ready_line="READY", timeout=30)
        dst = touched(plan.max_batch_bytes, 0).data
        src = touched(plan.max_batch_bytes, 7).data
        c1 = [_tcp(port)]
        c2 = [_tcp(port), _tcp(port)]
        # 4 streams: whether more connections than cores raise the ceiling (they do not here).
        c4 = [_tcp(port) for _ in range(4)]
        pool = ThreadPoolExecutor(4)
        try:
            def stream(conns: list[_Conn], op: str, total: int) -> Callable[[int], None]:
                k = len(conns)
                bounds = [total * i // k for i in range(k + 1)]

                def go(i: int) -> None:
                    if k == 1:
                        (conns[0].get if op == "get" else conns[0].put)(
                            (dst if op == "get" else src)[:total])
                        return
                    futs = []
                    for j, c in enumerate(conns):
                        view = (dst if op == "get" else src)[bounds[j]:bounds[j + 1]]
                        futs.append(pool.submit(c.get if op == "get" else c.put, view))
                    for f in futs:
                        f.result()
                return go

            for v, nb in plan.cells():
                reps = plan.reps(v, nb)
                for name, conns in (("tcp_stream_1conn", c1), ("tcp_stream_2conn", c2), ("tcp_stream_4conn", c4)):
                    for op in ("get", "put"):
                        meter = CpuMeter({"client": [os.getpid()], "server": [server.pid]})
                        t = timed_cpu(stream(conns, op, v * nb), reps, meter, warmup=plan.warmup)
                        rows.append(with_cpu(row_from_times(name, op, v, nb, t,
                                                            note="one stream per conn, batch split evenly"),
                                             meter, v * nb * reps))

            # Request/response: one request per value, sequential, on one connection.
            def reqresp(conn: _Conn, v: int, nb: int) -> Callable[[int], None]:
                def go(i: int) -> None:
                    for j in range(nb):
                        conn.get(dst[j * v:(j + 1) * v])
                return go

            u = _uds(uds)
            try:
                for name, conn in (("uds_reqresp", u), ("tcp_reqresp", c1[0])):
                    def ping(i: int, conn: _Conn = conn) -> None:
                        conn.ping()
                    t = timed(ping,
                              50 if plan.quick else 2000, warmup=50)
                    rows.append(row_from_times(name, "ping", None, 1, t, with_bytes=False))
                    cells = list(plan.cells())
                    if (4 * MiB, 1) not in cells:
                        cells.append((4 * MiB, 1))
                    for v, nb in cells:
                        t = timed(reqresp(conn, v, nb), plan.reps(v, nb), warmup=plan.warmup)
                        rows.append(row_from_times(name, "get", v, nb, t,
                                                   note="one request per value"))
            finally:
                u.close()
        finally:
            for c in c1 + c2 + c4:
                c.close()
            pool.shutdown()
    return rows


def measure(ctx: Context) -> list[Row]:
    rows = memcpy_rows(ctx)
    rows += network_rows(ctx)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--tcp-port", type=int, required=True)
    s.add_argument("--uds", default="")
    args = ap.parse_args(argv)
    if args.cmd == "serve":
        serve(args.tcp_port, args.uds)


if __name__ == "__main__":
    main()
