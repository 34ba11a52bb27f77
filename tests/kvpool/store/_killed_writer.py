"""A writer that starts a data-session PUT and then waits to be SIGKILLed in the middle of it.

Run by test_data_session.py as a real process:  python _killed_writer.py ADDRESS session KEYHEX SIZE TIMEOUT_MS
The PUT is answered PUT_READY, then half of its payload goes out.
It prints "WROTE 0 0" when it is where the test wants to kill it.
"""

from __future__ import annotations

import socket
import sys
import time

import grpc
import numpy as np

from kvpool.wire import store_frames as dp
from kvpool.wire.proto import store_pb2 as pb
from kvpool.wire.proto import store_pb2_grpc as pbg


def main() -> None:
    address, mode, key_hex, size_s, timeout_s = sys.argv[1:6]
    if mode != "session":
        raise SystemExit(f"unknown mode {mode!r} (only 'session')")
    stub = pbg.StoreDataStub(grpc.insecure_channel(address))  # type: ignore[no-untyped-call]
    session_writer(stub, bytes.fromhex(key_hex), int(size_s), int(timeout_s))


def session_writer(stub: pbg.StoreDataStub, key: bytes, size: int, timeout_ms: int) -> None:
    host, _, port = stub.Health(pb.Empty(), timeout=10).transfer_address.rpartition(":")
    sock = socket.create_connection((host, int(port)))
    sizes = np.array([size], np.uint64)
    sock.sendall(b"".join(dp.encode_request(dp.OP_PUT, 1, b"", key, lease_ms=timeout_ms, sizes=sizes)))
    head = sock.recv(dp.RESPONSE_SIZE + 1, socket.MSG_WAITALL)
    resp = dp.decode_response(head[:dp.RESPONSE_SIZE])
    assert resp.op == dp.OP_PUT_READY and resp.status == 0 and head[dp.RESPONSE_SIZE:] == bytes([pb.OK]), head
    sock.sendall(bytes([0xAB]) * (size // 2))
    print("WROTE 0 0", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
