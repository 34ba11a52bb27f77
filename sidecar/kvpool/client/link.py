"""The client's link to one sidecar life: its arena mapping, the gRPC calls, the move to a new life.

The sidecar's HELLO names its life (incarnation) and its arena's generation.  Offsets are turned
into views only with the mapping of the life that gave them: a reply of another life first makes
the client say Hello again, remap the arena if its generation changed (a new life that adopted
the same arena keeps the mapping), and forget what the old life held (``on_moved``).  A gRPC call
names the life it was made for; the sidecar refuses it if that is not its own, and it is made
again, once, for the new life.  gRPC carries the cold calls (Hello, Probe, Stats, Flush, Remove,
ranged reads, handoff); the hot ones go over the fast session (:mod:`kvpool.client.session`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, cast

import grpc

from kvpool.client.arena import ArenaMap
from kvpool.core import errors
from kvpool.wire import grpc_status
from kvpool.wire.proto import sidecar_pb2 as spb
from kvpool.wire.proto import sidecar_pb2_grpc as spbg
from kvpool.wire.proto import store_pb2 as pb

log = logging.getLogger("kvpool.client.link")


class SidecarLink:
    """The sidecar life a client holds; thread-safe.  ``on_moved(hello, mapping)`` runs (under
    the link's lock) when the client moves to a new life."""

    def __init__(self, address: str, timeout: float, on_moved: Callable[[spb.HelloReply, ArenaMap], None]) -> None:
        self.address = address
        self.timeout = timeout
        self._on_moved = on_moved
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20),
                                                               ("grpc.max_send_message_length", 64 << 20)])
        self.stub = spbg.SidecarStub(self.channel)
        try:
            self.hello_reply = self.hello()
            """The HELLO of the life the link holds."""
            self.map = ArenaMap.map(self.hello_reply)
        except BaseException:
            self.channel.close()
            raise
        self._lock = threading.Lock()
        self.restarts_seen = 0
        """Sidecar lives after the first this link moved to (restarts it noticed)."""

    def hello(self) -> spb.HelloReply:
        try:
            return cast(spb.HelloReply, self.stub.Hello(pb.Empty(), timeout=self.timeout))
        except grpc.RpcError as err:
            raise grpc_status.from_rpc_error(err) from None

    def move(self, seen: int = -1) -> int:
        """The sidecar is another life than the one held (``seen``; -1: a call was refused for
        it): say Hello again, remap the arena unless the new life adopted the same one.  Returns
        the incarnation now held."""
        with self._lock:
            old = self.map
            if seen == old.incarnation:
                return seen  # another thread moved to it already
            hello = self.hello()
            if hello.tenant_id != self.hello_reply.tenant_id:
                raise errors.PermissionDenied(f"the sidecar at {self.address} now serves tenant "
                                              f"{hello.tenant_id!r}, not {self.hello_reply.tenant_id!r}")
            if hello.incarnation == old.incarnation:
                return old.incarnation
            new = ArenaMap(hello.incarnation, old.generation, old.path, old.nbytes, old.mmap, old.rw, old.ro) \
                if old.same_arena(hello) else ArenaMap.map(hello)
            self._on_moved(hello, new)
            self.map, self.hello_reply = new, hello
            self.restarts_seen += 1
            log.warning("kvpool: the sidecar at %s was restarted; %s", self.address,
                        "it kept the arena" if new.mmap is old.mmap else "the arena was remapped")
            return new.incarnation

    def life(self, incarnation: int) -> ArenaMap:
        """The mapping for offsets given by sidecar life ``incarnation`` (moving to that life if
        it is newer); SidecarRestarted if the link cannot hold it."""
        m = self.map
        if m.incarnation == incarnation:
            return m
        self.move(incarnation)
        m = self.map
        if m.incarnation != incarnation:
            raise errors.SidecarRestarted(f"the sidecar at {self.address} changed lives during the call")
        return m

    def call(self, method: Any, request: Any, timeout: float | None = None) -> Any:
        # Any: the generated gRPC stubs are untyped; callers returning the reply cast it to its message.
        return self.call_life(method, request, timeout)[0]

    def call_life(self, method: Any, request: Any, timeout: float | None = None) -> tuple[Any, ArenaMap]:
        """One gRPC call (``method``: of :attr:`stub`) made for the life held, and that life's
        mapping; refused because the sidecar is another life, it is made again, once, after
        moving to the new life.  ``timeout``: the call's bound (default: the link's)."""
        for attempt in range(2):
            m = self.map
            try:
                return method(request, timeout=timeout or self.timeout,
                              metadata=((errors.INCARNATION_METADATA, str(m.incarnation)),)), m
            except grpc.RpcError as err:
                exc = grpc_status.from_rpc_error(err)
                if not isinstance(exc, errors.SidecarRestarted) or attempt:
                    raise exc from None
            self.move()
        raise AssertionError("not reached")

    def close(self) -> None:
        self.channel.close()
        self.map.close()
