"""A writer that reserves, moves bytes, and then waits to be SIGKILLed before it commits.

Run by test_lifecycle.py as a real process:  python _killed_writer.py ADDRESS MODE KEYHEX SIZE TIMEOUT_MS
MODE "full": the payload is written completely through the transfer engine;
MODE "partial": a raw transfer header and half of the payload go out on a socket, then nothing;
MODE "session": a data-session PUT is answered PUT_READY, then half of its payload goes out.
It prints "WROTE <offset> <token>" when it is where the test wants to kill it.
"""

from __future__ import annotations

import socket
import sys
import time

import grpc
import numpy as np

from kvpool.transfer import TransferEngine, TransferRequest
from kvpool.transfer.protocol import OP_WRITE, encode_request
from kvpool.wire import store_frames as dp
from kvpool.wire.proto import store_pb2 as pb
from kvpool.wire.proto import store_pb2_grpc as pbg


def main() -> None:
    address, mode, key_hex, size_s, timeout_s = sys.argv[1:6]
    key, size = bytes.fromhex(key_hex), int(size_s)
    stub = pbg.StoreDataStub(grpc.insecure_channel(address))  # type: ignore[no-untyped-call]
    if mode == "session":
        session_writer(stub, key, size, int(timeout_s))
        return
    start = stub.PutStart(pb.PutStartRequest(keys=key, sizes=[size], traffic_class="chatbot",
                                             timeout_ms=int(timeout_s)), timeout=10)
    assert list(start.codes) == [pb.OK], list(start.codes)
    payload = bytes([0xAB]) * size
    off, token = start.offsets[0], start.tokens[0]
    if mode == "full":
        engine = TransferEngine()
        st = engine.transfer(start.location.transfer_address,
                             [TransferRequest("write", memoryview(payload), start.location.segment, off, size,
                                              token)])
        assert st[0].ok, st
    else:
        host, _, port = start.location.transfer_address.rpartition(":")
        sock = socket.create_connection((host, int(port)))
        sock.sendall(encode_request(OP_WRITE, 1, start.location.segment.encode(), off, size, token))
        sock.sendall(payload[: size // 2])
    print(f"WROTE {off} {token}", flush=True)
    while True:
        time.sleep(60)


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
