"""Client of one store node's data session (:mod:`kvpool.wire.store_frames`).

One round trip per get, ranged get and exists (two short frames around the payload per put), over a small
pool of persistent connections to the node's transfer port.  A batch of several objects is cut
into ``connections`` parts sent concurrently, one per connection, so the bytes of one batch move
over several streams (the GIL is released in every ``recvmsg_into``/``sendmsg``; checksums of one
part are computed while another part is on the wire).

Thread-safe: each call takes connections from the pool and gives them back when the stream is in
sync again; a connection that failed is closed, never reused.  Whole-call failures raise the
``kvpool.core.errors`` tree (:class:`~kvpool.core.errors.Unavailable` when the node cannot be reached,
:class:`~kvpool.core.errors.DeadlineExceeded` when it did not answer in time); per-item results are
``store_pb2.Code`` values.

Deadlines: every call takes a ``timeout`` (seconds; the session's default when None), armed as
the stall timeout of the connection it uses, so a hung node holds a caller's thread one deadline
at most; a timed-out call is never retried (the node is hung, not restarted).  A read also takes
a bandwidth floor: once the node has said how many bytes it sends, the payload gets
:func:`kvpool.core.deadlines.read_seconds` of them.  A read cut in the middle (the node died or
stopped, the deadline passed) still returns what arrived whole and verified; the items that did
not arrive are LEASE_EXPIRED ("nothing was read"), and ``ReadResult.error`` says why.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from kvpool.core import errors, ranges
from kvpool.core.checksum import checksum
from kvpool.core.deadlines import read_seconds
from kvpool.core.keys import KEY_BYTES
from kvpool.core.traffic import DEFAULT_TRAFFIC_CLASS
from kvpool.pool.streams import StreamPool, split_parts
from kvpool.transfer.stream import STALL_ERRORS, Stream
from kvpool.wire import store_frames as dp
from kvpool.wire.proto import store_pb2 as pb

Dest = Callable[[int, int], memoryview | None]
"""Where object ``i`` of ``size`` bytes lands (caller memory), or None to skip it."""


class ReadResult(NamedTuple):
    codes: list[pb.Code]
    sizes: list[int]
    checksums: list[int]
    epoch: int
    error: errors.KvpoolError | None = None
    """Why some items did not arrive (their code is LEASE_EXPIRED): a read cut in the middle."""


class ExistsReply(NamedTuple):
    prefix: int
    present: npt.NDArray[np.bool_]
    lease_id: int
    epoch: int


class PendingExists:
    """An EXISTS on its way (:meth:`DataSession.exists_begin`): :meth:`flush` sends what the
    kernel did not take at once (a failure is kept for the answer to raise); calling it waits
    for the answer, at most its argument in seconds."""

    __slots__ = ("_finish", "flush")

    def __init__(self, finish: Callable[[float | None], ExistsReply],
                 flush: Callable[[], None] = lambda: None) -> None:
        self._finish = finish
        self.flush = flush

    def __call__(self, left: float | None = None) -> ExistsReply:
        return self._finish(left)


class DataSession(StreamPool):
    """Connections to one node's data session; see the module docstring."""

    # -- frames ----------------------------------------------------------------------------

    @staticmethod
    def _response(stream: Stream, request_id: int, op: int) -> tuple[dp.Response, bytearray]:
        head = bytearray(dp.RESPONSE_SIZE)
        stream.recv_exact(head)
        resp = dp.decode_response(head)
        if resp.request_id != request_id or resp.op != op:
            raise dp.ProtocolError(f"response {resp.op}/{resp.request_id}, expected {op}/{request_id}")
        msg = bytearray(resp.msg_len)
        if msg:
            stream.recv_exact(msg)
        if resp.status != errors.SESSION_OK:
            raise errors.from_session_status(resp.status, msg.decode("utf-8", "replace"))
        body = bytearray(resp.body_bytes())
        if body:
            stream.recv_exact(body)
        return resp, body

    def hello(self, timeout: float | None = None) -> int:
        """Greet the node's data session: its ring epoch (and its life, :attr:`incarnation`);
        :class:`~kvpool.core.errors.Unavailable` when it cannot be reached.  Also the sidecar's
        probe of a suspect node (``timeout``: the probe's deadline)."""
        def run(stream: Stream, rid: int) -> int:
            stream.send(dp.encode_request(dp.OP_HELLO, rid, dp.HELLO_PADDING, b""))
            resp = self._response(stream, rid, dp.OP_HELLO)[0]
            self.incarnation = resp.lease_id  # the node's life (its HELLO reply's lease id)
            return resp.epoch
        return int(self._call(run, timeout))

    def exists(self, keys: bytes, kind: int = pb.BLOCK, prefix_only: bool = True, pin: bool = False,
               lease_ms: int = 0, epoch: int = 0, drop_lease: int = 0, timeout: float | None = None) -> ExistsReply:
        """Prefix and presence of ``keys`` (pinned with ``pin``), after dropping ``drop_lease``."""
        flags = (dp.FLAG_PREFIX_ONLY if prefix_only else 0) | (dp.FLAG_PIN if pin else 0)
        n = len(keys) // KEY_BYTES

        def run(stream: Stream, rid: int) -> ExistsReply:
            stream.send(dp.encode_request(dp.OP_EXISTS, rid, self._token, keys, kind=kind, flags=flags,
                                          lease_ms=lease_ms, epoch=epoch, lease_id=drop_lease))
            resp, body = self._response(stream, rid, dp.OP_EXISTS)
            if resp.items != n:
                raise dp.ProtocolError(f"EXISTS answered {resp.items} keys of {n}")
            return ExistsReply(resp.prefix, dp.decode_bitmap(body, n), resp.lease_id, resp.epoch)
        return self._call(run, timeout)  # type: ignore[no-any-return]

    def exists_begin(self, keys: bytes, kind: int = pb.BLOCK, prefix_only: bool = True, pin: bool = False,
                     lease_ms: int = 0, epoch: int = 0, drop_lease: int = 0,
                     timeout: float | None = None) -> PendingExists:
        """:meth:`exists` in parts: the request is started now (what the kernel takes without
        blocking), :meth:`PendingExists.flush` sends the rest, and calling the result waits for
        the answer (its argument: how long, default ``timeout``).  A caller asking several nodes
        starts all of them, flushes all, then collects, on one thread (no thread handoff per
        node), each with what is left of one deadline: a request over a node's receive window
        (2048 keys are 64 KiB, about the window of a fresh loopback connection) then waits for
        that node to read it without holding back the requests to the others.  A connection
        that fails before the node answered is retried once with the whole call (not after a
        stall)."""
        flags = (dp.FLAG_PREFIX_ONLY if prefix_only else 0) | (dp.FLAG_PIN if pin else 0)
        n = len(keys) // KEY_BYTES

        def again(left: float | None = None) -> ExistsReply:  # a def: strict mypy refuses calls of a lambda
            return self.exists(keys, kind, prefix_only, pin, lease_ms, epoch, drop_lease, left or timeout)

        stream, reused = self._take(timeout)
        rid = next(self._ids) & 0xFFFFFFFF
        mark = stream.received
        try:
            rest = stream.send_nowait(dp.encode_request(dp.OP_EXISTS, rid, self._token, keys, kind=kind, flags=flags,
                                                        lease_ms=lease_ms, epoch=epoch, lease_id=drop_lease))
        except OSError as exc:
            stream.close()
            if reused and not isinstance(exc, STALL_ERRORS):
                return PendingExists(again)
            raise self._failure(exc) from None
        failed: list[OSError] = []

        def flush() -> None:
            if rest and not failed:
                try:
                    stream.send(rest)
                except OSError as exc:
                    failed.append(exc)
                rest.clear()

        def finish(left: float | None = None) -> ExistsReply:
            try:
                flush()
                if failed:
                    raise failed[0]
                if left is not None and left < 0.9 * stream.timeout:
                    stream.set_timeout(left)  # (a syscall pair: skipped while the deadline is fresh)
                resp, body = self._response(stream, rid, dp.OP_EXISTS)
                if resp.items != n:
                    raise dp.ProtocolError(f"EXISTS answered {resp.items} keys of {n}")
                out = ExistsReply(resp.prefix, dp.decode_bitmap(body, n), resp.lease_id, resp.epoch)
            except errors.KvpoolError:
                self._give(stream)
                raise
            except (OSError, dp.ProtocolError) as exc:
                stream.close()
                if (reused and stream.received == mark and isinstance(exc, OSError)
                        and not isinstance(exc, STALL_ERRORS)):
                    return again(left)
                raise self._failure(exc) from None
            except BaseException:
                stream.close()
                raise
            self._give(stream)
            return out
        return PendingExists(finish, flush)

    def read(self, keys: bytes, dest: Dest, kind: int = pb.BLOCK, lease_id: int = 0, verify: bool = True,
             epoch: int = 0, streams: int | None = None, timeout: float | None = None,
             bytes_per_second: float = 0.0) -> ReadResult:
        """Read objects into the memory ``dest`` names for each (verified against their checksums:
        a mismatch is the item's CHECKSUM code, a too-small or missing buffer INVALID).
        ``streams``: connections to cut the batch over (default ``connections``; 1 when the
        caller already reads from several nodes at once).  ``timeout``: the deadline until the
        node says what it sends; ``bytes_per_second`` > 0: the payload then gets
        ``timeout`` + its bytes at that rate in all (:func:`~kvpool.core.deadlines.read_seconds`).

        A part cut in the middle (connection lost, deadline passed) does not fail the read when
        something arrived: the objects received whole are verified and kept, the others are
        LEASE_EXPIRED, and ``error`` is set.  When nothing arrived the error is raised."""
        n = len(keys) // KEY_BYTES
        codes: list[pb.Code] = [pb.NOT_FOUND] * n
        sizes = [0] * n
        sums = [0] * n
        epochs = [0]
        settled = bytearray(n)  # 1: item i's code is final (answered, or landed and verified)
        cut: list[errors.KvpoolError] = []

        def part(r: range) -> None:
            blob = keys[r.start * KEY_BYTES:r.stop * KEY_BYTES]
            # Only the first part drops the match lease: the others would find it gone anyway.
            drop = lease_id if r.start == 0 else 0

            def run(stream: Stream, rid: int) -> None:
                stream.send(dp.encode_request(dp.OP_GET, rid, self._token, blob, kind=kind, lease_id=drop,
                                              epoch=epoch))
                resp, body = self._response(stream, rid, dp.OP_GET)
                if resp.items != len(r):
                    raise dp.ProtocolError(f"GET answered {resp.items} keys of {len(r)}")
                table = dp.decode_get_table(resp, body)
                epochs.append(resp.epoch)
                deadline = None
                if bytes_per_second > 0:
                    # (decode_get_table checked that it is the sum of the OK items' sizes)
                    seconds = read_seconds(resp.payload_len, timeout or self.timeout, bytes_per_second)
                    deadline = time.monotonic() + seconds
                    if seconds > 1.1 * stream.timeout:
                        # A syscall pair, for the payloads that need noticeably more time than
                        # the header had (the deadline above bounds the whole in any case).
                        stream.set_timeout(seconds)
                self._land(stream, r, table, dest, codes, sizes, sums, verify, settled, deadline)
            try:
                self._call(run, timeout)
            except errors.Unavailable as exc:
                cut.append(exc)
                for i in r:
                    if not settled[i]:
                        codes[i] = pb.LEASE_EXPIRED

        self._parallel(split_parts(n, min(streams or self.connections, self.connections)), part)
        if cut and not any(settled):
            raise cut[0]
        return ReadResult(codes, sizes, sums, max(epochs), cut[0] if cut else None)

    @staticmethod
    def _land(stream: Stream, r: range, table: dp.GetTable, dest: Dest, codes: list[pb.Code], sizes: list[int],
              sums: list[int], verify: bool, settled: bytearray, deadline: float | None = None) -> None:
        """Receive a GET payload into the callers' buffers (one scatter receive when every
        object has a buffer), then verify it; ``settled[i]`` = 1 for each item whose code is
        final.  When the stream breaks inside the payload, the objects that arrived whole before
        the break are verified and settled, then the error propagates."""
        part_codes = table.codes.tolist()
        part_sizes = table.sizes.tolist()
        part_sums = table.checksums.tolist()
        codes[r.start:r.stop] = part_codes
        sizes[r.start:r.stop] = part_sizes
        sums[r.start:r.stop] = part_sums
        landing: list[int] = []  # the items with bytes on the wire, in wire order
        bufs: list[memoryview | None] = []
        whole = True  # every one of them has a buffer: one scatter receive
        for j, code in enumerate(part_codes):
            i = r.start + j
            if code != pb.OK:
                settled[i] = 1
                continue
            size = part_sizes[j]
            buf = dest(i, size)
            if buf is None or buf.nbytes < size:
                buf = None
                whole = False
            elif buf.nbytes != size:
                buf = buf[:size]
            landing.append(i)
            bufs.append(buf)

        def check(i: int, buf: memoryview) -> None:
            if verify and checksum(buf) != sums[i]:
                codes[i] = pb.CHECKSUM
            settled[i] = 1

        if whole:
            # One scatter receive, then the hashes.  Verifying each object as soon as it lands
            # (while it is in this core's cache, during the node's next bytes) measured no
            # faster here: 1, 2 and 4 MiB groups all 3.4-3.6 ms per 16 MiB, like the whole; nor
            # cheaper in CPU (1 MiB groups: the client's user time per GB unchanged).
            mark = stream.received
            try:
                stream.recv_buffers(bufs, deadline)  # type: ignore[arg-type]
            except BaseException:
                got, end = stream.received - mark, 0
                for i, buf in zip(landing, bufs, strict=True):  # wholly received before the break
                    assert buf is not None
                    end += buf.nbytes
                    if end > got:
                        break
                    check(i, buf)
                raise
            if verify:
                for i, buf in zip(landing, bufs, strict=True):
                    if checksum(buf) != sums[i]:  # type: ignore[arg-type]
                        codes[i] = pb.CHECKSUM
            for i in landing:
                settled[i] = 1
            return
        for i, buf in zip(landing, bufs, strict=True):
            if buf is None:
                stream.discard(sizes[i])
                codes[i] = pb.INVALID
                settled[i] = 1
            else:
                stream.recv_exact(buf)
                check(i, buf)

    def read_ranges(self, keys: bytes, per_key: Sequence[ranges.Pairs], buffers: Sequence[memoryview | None],
                    kind: int = pb.BLOCK, lease_id: int = 0, verify: bool = True, verify_object: bool = False,
                    epoch: int = 0, timeout: float | None = None) -> ReadResult:
        """Read only the byte ranges ``per_key[i]`` of each object into ``buffers[i]``, back to
        back in the order asked (a sparse read; :mod:`kvpool.core.ranges`; abutting ranges are sent
        as one, :func:`~kvpool.core.ranges.coalesce`).  A key without a buffer
        at least as large as its ranges is INVALID and not asked for; each range is verified
        against the checksum the node computed over the bytes it sent (CHECKSUM on mismatch).
        ``sizes`` of the result are the objects' sizes (0 where absent); ``checksums`` are 0."""
        n = len(keys) // KEY_BYTES
        if len(per_key) != n or len(buffers) != n:
            raise errors.InvalidArgument(f"{n} keys, {len(per_key)} range lists, {len(buffers)} buffers")
        codes: list[pb.Code] = [pb.INVALID] * n
        sizes = [0] * n
        epochs = [0]
        ask = [i for i in range(n) if buffers[i] is not None
               and buffers[i].nbytes >= ranges.total_bytes(per_key[i])]  # type: ignore[union-attr]
        flags = dp.FLAG_VERIFY_OBJECT if verify_object else 0

        def part(r: range) -> None:
            sel = ask[r.start:r.stop]
            blob = b"".join(keys[i * KEY_BYTES:(i + 1) * KEY_BYTES] for i in sel)
            # Abutting ranges travel as one: the same bytes land in the same places.
            mine = [ranges.coalesce(per_key[i])[0] for i in sel]
            counts, packed = ranges.encode(mine)
            flat = np.concatenate(mine) if mine else np.zeros((0, 2), np.uint64)
            drop = lease_id if r.start == 0 else 0

            def run(stream: Stream, rid: int) -> None:
                stream.send(dp.encode_request(dp.OP_GET_RANGES, rid, self._token, blob, kind=kind, flags=flags,
                                              lease_id=drop, epoch=epoch, ranges=(counts, packed)))
                resp, body = self._response(stream, rid, dp.OP_GET_RANGES)
                if resp.items != len(sel):
                    raise dp.ProtocolError(f"GET_RANGES answered {resp.items} keys of {len(sel)}")
                trailer = bytearray(8 * len(flat))
                if trailer:
                    stream.recv_exact(trailer)
                table = dp.decode_range_table(resp, body, trailer, counts, flat)
                part_codes = table.codes.tolist()
                part_sizes = table.sizes.tolist()
                sums = table.checksums.tolist()
                targets: list[memoryview] = []
                for j, i in enumerate(sel):
                    codes[i], sizes[i] = part_codes[j], part_sizes[j]
                    if part_codes[j] == pb.OK:
                        targets.append(buffers[i][:ranges.total_bytes(mine[j])])  # type: ignore[index]
                if targets:
                    stream.recv_buffers(targets)
                epochs.append(resp.epoch)
                if not verify:
                    return
                at = 0
                for j, i in enumerate(sel):
                    pairs = mine[j]
                    if codes[i] == pb.OK:
                        buf = buffers[i]
                        assert buf is not None
                        pos = 0
                        for k, ln in enumerate(pairs[:, 1].tolist()):
                            if checksum(buf[pos:pos + ln]) != sums[at + k]:
                                codes[i] = pb.CHECKSUM
                                break
                            pos += ln
                    at += len(pairs)
            self._call(run, timeout)

        self._parallel(split_parts(len(ask), self.connections), part)
        return ReadResult(codes, sizes, [0] * n, max(epochs))

    def put(self, keys: bytes, views: Sequence[memoryview], checksums: Sequence[int] | None = None,
            traffic_class: str = DEFAULT_TRAFFIC_CLASS, kind: int = pb.BLOCK, timeout_ms: int = 0,
            epoch: int = 0) -> tuple[list[int], int]:
        """Store objects; per-item codes and the node's epoch.  Objects the node refuses up front
        (already stored, over quota, no space) are never sent."""
        n = len(keys) // KEY_BYTES
        if n != len(views):
            raise errors.InvalidArgument(f"{n} keys but {len(views)} values")
        codes: list[int] = [pb.INVALID] * n
        epochs = [0]
        tclass = traffic_class.encode("utf-8")
        # The parts go out at once, each on its own connection, and carry one order ticket: the
        # node reserves them in batch order (data_protocol, PUT), so quota and space go to the
        # earliest items as in one frame, without part k waiting a round trip for part k-1.
        # A key repeated in the batch must meet itself in one reservation: no split then.
        parts = split_parts(n, self.connections if len(set(_chunks(keys))) == n else 1)
        batch = secrets.randbits(48) or 1
        index = {r.start: k for k, r in enumerate(parts)}

        def part(r: range) -> None:
            k = index[r.start]
            frame = dp.encode_request(
                dp.OP_PUT, 0, self._token, keys[r.start * KEY_BYTES:r.stop * KEY_BYTES], kind=kind,
                lease_ms=timeout_ms, epoch=epoch, traffic_class=tclass,
                lease_id=dp.order_ticket(batch, k, len(parts)) if len(parts) > 1 else 0,
                sizes=np.fromiter((views[i].nbytes for i in r), np.uint64, len(r)))
            self._call(lambda stream, rid: run(stream, rid, r, frame))

        def run(stream: Stream, rid: int, r: range, frame: list[bytes]) -> None:
            stream.send([dp.with_request_id(frame[0], rid), *frame[1:]])
            # Hash while PUT_READY is on its way: the checksums trail the payload.
            sums = [checksums[i] if checksums is not None else checksum(views[i]) for i in r]
            resp, body = self._response(stream, rid, dp.OP_PUT_READY)
            ready = dp.decode_codes(resp, body) if len(body) == len(r) else None
            if ready is None:
                raise dp.ProtocolError(f"PUT_READY answered {resp.items} keys of {len(r)}")
            epochs.append(resp.epoch)
            for j, i in enumerate(r):
                codes[i] = ready[j]
            todo = [j for j, c in enumerate(ready) if c == pb.OK]
            if not todo:
                return
            stream.send([*(views[r[j]] for j in todo), dp.encode_checksums(sums)])
            resp, body = self._response(stream, rid, dp.OP_PUT_DONE)
            final = dp.decode_codes(resp, body)
            if len(final) != len(r):
                raise dp.ProtocolError(f"PUT_DONE answered {len(final)} keys of {len(r)}")
            for j in todo:
                codes[r[j]] = final[j]

        self._parallel(parts, part)
        return codes, max(epochs)


def _chunks(keys: bytes) -> list[bytes]:
    return [keys[i:i + KEY_BYTES] for i in range(0, len(keys), KEY_BYTES)]
