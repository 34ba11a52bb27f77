"""RDMA transport over pyverbs: registered memory regions, one-sided READ/WRITE, CQ polling.

Split in two halves, like the rest of the engine:

* pure parts, unit-tested everywhere: the key/endpoint records carried over the control plane
  (:class:`RdmaSegmentKey`, :class:`RdmaEndpoint`, with a fixed binary encoding) and the
  planning of work requests (:func:`plan_work_requests`: bounds checks, slicing to the device's
  message limit, waves bounded by the send-queue depth);
* device parts, which need ``pyverbs`` and an RDMA device: :class:`RdmaContext` (device, PD, CQ,
  memory-region registration), :class:`RdmaQueuePair` (an RC queue pair connected to one peer)
  and :class:`RdmaPeer` (executes a batch's requests and reports per-request statuses).

Connection set-up is a control-plane exchange: the client creates a queue pair and sends its
:class:`RdmaEndpoint`; the store creates its own, connects it to the client's, and answers with
its endpoint plus the :class:`RdmaSegmentKey` of each segment; the client connects and calls
:meth:`TransferEngine.attach_rdma`. Bytes then move without the store's CPU: which also means
the store's :class:`~kvpool.transfer.Guard` cannot run per access (as for shared memory, the reader
verifies checksums; the lease is taken over the control plane).

``pyverbs`` is imported lazily: on hosts without it, or whose kernel lacks RDMA support
(``get_device_list()`` raises ``PyverbsRDMAError``, ENOSYS), :func:`rdma_devices` returns ``[]``
and :func:`rdma_status` says why; the engine then uses TCP.
"""

from __future__ import annotations

import os
import queue
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kvpool.transfer.batch import BatchHandle
from kvpool.transfer.plan import TransferRequest
from kvpool.transfer.protocol import U64_MAX, check_bounds
from kvpool.transfer.segment import MAX_SEGMENT_NAME_BYTES, validate_segment_name
from kvpool.transfer.status import STATUS_OK, TransferCode, TransferStatus

# -- device discovery ----------------------------------------------------------------------

_status_lock = threading.Lock()
_status: tuple[list[str], str] | None = None


#: A directory holding a ``pyverbs`` package built for this interpreter's ABI (e.g. Debian's
#: ``python3-pyverbs`` in /usr/lib/python3/dist-packages); appended to ``sys.path`` — last, so it
#: never shadows installed packages — before pyverbs is imported.
PYVERBS_PATH_ENV = "KVPOOL_PYVERBS_PATH"


def _probe() -> tuple[list[str], str]:
    extra = os.environ.get(PYVERBS_PATH_ENV)
    if extra and extra not in sys.path:
        sys.path.append(extra)
    try:
        import pyverbs.device as device  # optional dependency, imported lazily
    except ImportError as exc:
        return [], f"pyverbs is not importable ({exc})"
    try:
        found = device.get_device_list()
    except Exception as exc:  # PyverbsRDMAError: ENOSYS on kernels without RDMA support
        return [], f"pyverbs.device.get_device_list() raised {type(exc).__name__}: {exc}"
    names = []
    for dev in found:
        name = dev.name
        names.append(name.decode() if isinstance(name, bytes) else str(name))
    if not names:
        return [], "pyverbs.device.get_device_list() found no devices"
    return names, ""


def rdma_status(refresh: bool = False) -> tuple[list[str], str]:
    """``(device names, reason)``; the reason says why the list is empty (cached after first call)."""
    global _status
    with _status_lock:
        if _status is None or refresh:
            _status = _probe()
        devices, reason = _status
    return list(devices), reason


def rdma_devices() -> list[str]:
    """Names of the RDMA devices of this host, ``[]`` when there are none (or no pyverbs)."""
    return rdma_status()[0]


RDMA_ENV = "KVPOOL_RDMA"
"""Which RDMA device a process uses (the sidecar reads it; a store node's ``--rdma`` defaults to
it): ``auto`` (the default: the first device pyverbs finds, none without one), ``off``,
``device:<name>``, or ``sim:<directory>`` — the simulated fabric of
:mod:`kvpool.transfer.rdma_sim`, shared by the processes that name the same directory."""


def open_context(spec: str | None = None) -> tuple[Any, str]:
    """The RDMA context ``spec`` (empty: ``$KVPOOL_RDMA``, else ``auto``) selects, and ``""``;
    or ``None`` and the reason there is none (off, no device, the device failed to open)."""
    spec = (spec or os.environ.get(RDMA_ENV, "")).strip() or "auto"
    if spec == "off":
        return None, "RDMA is off"
    if spec.startswith("sim:"):
        from kvpool.transfer.rdma_sim import FabricContext

        return FabricContext(spec[len("sim:"):]), ""
    if spec != "auto" and not spec.startswith("device:"):
        raise ValueError(f"{RDMA_ENV}: expected auto, off, device:<name> or sim:<dir>, got {spec!r}")
    name = spec[len("device:"):] if spec.startswith("device:") else None
    try:
        return RdmaContext(name or None), ""
    except RdmaUnavailable as exc:
        return None, str(exc)
    except Exception as exc:  # a device that lists but does not open (permissions, a dead port)
        return None, f"cannot open the RDMA device: {type(exc).__name__}: {exc}"


# -- records carried over the control plane ---------------------------------------------------

_KEY = struct.Struct(f"<BBHQQI{MAX_SEGMENT_NAME_BYTES}s")
_ENDPOINT = struct.Struct("<BBHIIH16sB")
_RECORD_VERSION = 1


@dataclass(frozen=True, slots=True)
class RdmaSegmentKey:
    """What a peer needs to READ/WRITE a registered segment: its virtual address, size, rkey."""

    segment: str
    addr: int
    length: int
    rkey: int

    def __post_init__(self) -> None:
        validate_segment_name(self.segment)
        if not (0 <= self.addr <= U64_MAX and 0 <= self.length <= U64_MAX and 0 <= self.rkey < 1 << 32):
            raise ValueError("RDMA key field out of range")

    def encode(self) -> bytes:
        name = self.segment.encode("utf-8")
        return _KEY.pack(_RECORD_VERSION, 0, len(name), self.addr, self.length, self.rkey, name)

    @classmethod
    def decode(cls, data: bytes) -> RdmaSegmentKey:
        if len(data) != _KEY.size:
            raise ValueError(f"RDMA segment key must be {_KEY.size} bytes, got {len(data)}")
        version, _, name_len, addr, length, rkey, raw = _KEY.unpack(data)
        if version != _RECORD_VERSION:
            raise ValueError(f"unsupported RDMA key version {version}")
        if not 0 < name_len <= MAX_SEGMENT_NAME_BYTES or any(raw[name_len:]):
            raise ValueError("malformed segment name in RDMA key")
        return cls(raw[:name_len].decode("utf-8"), addr, length, rkey)


@dataclass(frozen=True, slots=True)
class RdmaEndpoint:
    """One side of an RC queue pair: what the other side needs to connect to it."""

    qp_num: int
    psn: int
    lid: int
    gid: bytes
    port: int = 1
    mtu: int = 5  #: ibv_mtu enum (1 = 256 B … 5 = 4096 B); the lower of both sides is used

    def __post_init__(self) -> None:
        if not 0 <= self.qp_num < 1 << 24 or not 0 <= self.psn < 1 << 24:
            raise ValueError("qp_num and psn are 24-bit values")
        if not 0 <= self.lid < 1 << 16 or len(self.gid) != 16:
            raise ValueError("lid must be 16-bit and gid 16 bytes")
        if not 0 < self.port < 256 or not 1 <= self.mtu <= 5:
            raise ValueError("bad port or mtu")

    def encode(self) -> bytes:
        return _ENDPOINT.pack(_RECORD_VERSION, 0, 0, self.qp_num, self.psn, self.lid, self.gid, self.port) + bytes(
            [self.mtu]
        )

    @classmethod
    def decode(cls, data: bytes) -> RdmaEndpoint:
        if len(data) != _ENDPOINT.size + 1:
            raise ValueError(f"RDMA endpoint must be {_ENDPOINT.size + 1} bytes, got {len(data)}")
        version, _, _, qp_num, psn, lid, gid, port = _ENDPOINT.unpack(data[:-1])
        if version != _RECORD_VERSION:
            raise ValueError(f"unsupported RDMA endpoint version {version}")
        return cls(qp_num, psn, lid, bytes(gid), port, data[-1])


# -- work-request planning (pure) ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkRequestPlan:
    """One RDMA READ/WRITE work request: ``length`` bytes between local and remote addresses."""

    wr_id: int
    index: int  #: request index in the batch
    is_read: bool
    local_addr: int
    remote_addr: int
    length: int
    rkey: int


def plan_work_requests(
    requests: list[tuple[bool, int, int, int]],
    key: RdmaSegmentKey,
    max_message_bytes: int = 1 << 30,
    first_wr_id: int = 1,
) -> tuple[list[WorkRequestPlan], dict[int, TransferStatus]]:
    """Turn ``(is_read, local_addr, remote_offset, length)`` requests on one remote segment
    into work requests, cutting each at the device's ``max_message_bytes``.

    Returns the plans and the per-request errors (out-of-bounds requests get no plan).
    Zero-length requests get neither: they succeed trivially.
    """
    plans: list[WorkRequestPlan] = []
    errors: dict[int, TransferStatus] = {}
    wr_id = first_wr_id
    for index, (is_read, local_addr, offset, length) in enumerate(requests):
        why = check_bounds(offset, length, key.length)
        if why is not None:
            errors[index] = TransferStatus(TransferCode.OUT_OF_BOUNDS, why)
            continue
        done = 0
        while done < length:
            n = min(max_message_bytes, length - done)
            plans.append(
                WorkRequestPlan(wr_id, index, is_read, local_addr + done, key.addr + offset + done, n, key.rkey)
            )
            wr_id += 1
            done += n
    return plans, errors


def waves(plans: list[WorkRequestPlan], depth: int) -> list[list[WorkRequestPlan]]:
    """Groups of at most ``depth`` work requests: what can be outstanding on one send queue."""
    if depth <= 0:
        raise ValueError("queue depth must be positive")
    return [plans[i : i + depth] for i in range(0, len(plans), depth)]


def buffer_address(view: memoryview) -> int:
    """Virtual address of a contiguous buffer (what a memory region or SGE needs)."""
    if view.nbytes == 0:
        return 0
    array = np.frombuffer(view, dtype=np.uint8)
    return int(array.ctypes.data)


# -- pyverbs object builders (need pyverbs, not a device) ----------------------------------------


def gid_bytes(gid: Any) -> bytes:
    """A pyverbs ``GID`` (printed as eight colon-separated hex groups) → 16 raw bytes."""
    return bytes.fromhex(str(gid).replace(":", ""))


def make_gid(raw: bytes) -> Any:
    """16 raw bytes → a pyverbs ``GID``."""
    from pyverbs.addr import GID

    if len(raw) != 16:
        raise ValueError("a GID is 16 bytes")
    return GID(":".join(raw[i : i + 2].hex() for i in range(0, 16, 2)))


def build_send_wr(plan: WorkRequestPlan, lkey: int) -> Any:
    """The signaled one-sided READ/WRITE work request for ``plan``."""
    import pyverbs.enums as e
    from pyverbs.wr import SGE, SendWR

    wr = SendWR(
        wr_id=plan.wr_id,
        opcode=e.IBV_WR_RDMA_READ if plan.is_read else e.IBV_WR_RDMA_WRITE,
        num_sge=1,
        sg=[SGE(plan.local_addr, plan.length, lkey)],
        send_flags=e.IBV_SEND_SIGNALED,
    )
    wr.set_wr_rdma(plan.rkey, plan.remote_addr)
    return wr


# -- device parts (need pyverbs and a device) ---------------------------------------------------


class RdmaUnavailable(RuntimeError):
    """No usable RDMA device on this host (the message says why)."""


class RdmaContext:
    """An opened device with a protection domain and registered regions (each queue pair has
    its completion queue)."""

    def __init__(self, device: str | None = None, port: int = 1, gid_index: int = 0) -> None:
        devices, reason = rdma_status()
        if not devices:
            raise RdmaUnavailable(f"no RDMA devices: {reason}")
        import pyverbs.device as d
        from pyverbs.pd import PD

        self.device = device or devices[0]
        self.port = port
        self.gid_index = gid_index
        self.ctx: Any = d.Context(name=self.device)
        self.pd: Any = PD(self.ctx)
        self._lock = threading.Lock()
        # (start address, end address, MR); few entries (one per segment), scanned linearly
        self._regions: list[tuple[int, int, Any]] = []

    def register(self, name: str, view: memoryview) -> RdmaSegmentKey:
        """Register ``view`` for local and remote READ/WRITE and return its key for peers."""
        import pyverbs.enums as e
        from pyverbs.mr import MR

        addr = buffer_address(view)
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        mr = MR(self.pd, view.nbytes, access, address=addr)
        with self._lock:
            self._regions.append((addr, addr + view.nbytes, mr))
        return RdmaSegmentKey(name, addr, view.nbytes, int(mr.rkey))

    def register_temporary(self, addr: int, length: int) -> tuple[int, Any]:
        """Register ``[addr, addr + length)`` for one batch; returns ``(lkey, region)`` — close the
        region when the batch is done."""
        import pyverbs.enums as e
        from pyverbs.mr import MR

        mr = MR(self.pd, length, e.IBV_ACCESS_LOCAL_WRITE, address=addr)
        return int(mr.lkey), mr

    def lkey_for(self, addr: int, length: int) -> int | None:
        """The lkey of a registered region that contains ``[addr, addr + length)``."""
        with self._lock:
            for start, end, mr in self._regions:
                if start <= addr and addr + length <= end:
                    return int(mr.lkey)
        return None

    def create_queue_pair(self, depth: int = 256) -> RdmaQueuePair:
        """A new queue pair; send its :attr:`~RdmaQueuePair.endpoint` to the peer, then
        :meth:`~RdmaQueuePair.connect` it to the peer's."""
        return RdmaQueuePair(self, depth)

    def accept(self, remote: RdmaEndpoint, depth: int = 256) -> RdmaQueuePair:
        """Serving side of the handshake: a queue pair already connected to ``remote``; answer
        with its ``endpoint`` (and the segment keys) over the control plane."""
        qp = RdmaQueuePair(self, depth)
        try:
            qp.connect(remote)
        except BaseException:
            qp.close()
            raise
        return qp

    def close(self) -> None:
        with self._lock:
            regions, self._regions = self._regions, []
        for _, _, mr in regions:
            mr.close()
        self.pd.close()
        self.ctx.close()


class RdmaQueuePair:
    """A reliable-connected queue pair; :attr:`endpoint` goes to the peer, :meth:`connect` back."""

    def __init__(self, context: RdmaContext, depth: int) -> None:
        import pyverbs.enums as e
        from pyverbs.cq import CQ
        from pyverbs.qp import QP, QPCap, QPInitAttr

        self.context = context
        self.depth = depth
        cap = QPCap(max_send_wr=depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        # A completion queue of its own: queue pairs to several peers are driven from several
        # threads at once, and a shared queue would hand one thread another's completions.
        self.cq: Any = CQ(context.ctx, depth + 1, None, None, 0)
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap)
        self.qp: Any = QP(context.pd, init)
        port_attr = context.ctx.query_port(context.port)
        gid = context.ctx.query_gid(context.port, context.gid_index)
        psn = int.from_bytes(np.random.default_rng().bytes(3), "little")
        self.endpoint = RdmaEndpoint(
            int(self.qp.qp_num), psn, int(port_attr.lid), gid_bytes(gid), context.port, int(port_attr.active_mtu)
        )

    def connect(self, remote: RdmaEndpoint) -> None:
        """Move the queue pair through INIT → RTR → RTS towards ``remote``."""
        import pyverbs.enums as e
        from pyverbs.addr import AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        route = GlobalRoute(dgid=make_gid(remote.gid), sgid_index=self.context.gid_index)
        ah = AHAttr(gr=route, is_global=1, dlid=remote.lid, port_num=self.context.port)
        attr = QPAttr(port_num=self.context.port)
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        attr.path_mtu = min(remote.mtu, self.endpoint.mtu)
        attr.dest_qp_num = remote.qp_num
        attr.rq_psn = remote.psn
        attr.sq_psn = self.endpoint.psn
        attr.max_dest_rd_atomic = 16
        attr.max_rd_atomic = 16
        attr.min_rnr_timer = 12
        attr.timeout = 14
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        attr.ah_attr = ah
        self.qp.to_rts(attr)

    def execute(
        self, plans: list[WorkRequestPlan], lkeys: dict[int, int], stall_timeout: float
    ) -> dict[int, TransferStatus]:
        """Post ``plans`` in waves of the queue depth and poll their completions.

        ``lkeys`` maps work-request id → local key. Returns errors by request index; a request
        absent from the result succeeded.
        """
        import pyverbs.enums as e

        errors: dict[int, TransferStatus] = {}
        by_id = {p.wr_id: p for p in plans}
        for wave in waves(plans, self.depth):
            for p in wave:
                self.qp.post_send(build_send_wr(p, lkeys[p.wr_id]))
            pending = len(wave)
            last_progress = time.monotonic()
            while pending:
                polled, completions = self.cq.poll(num_entries=min(pending, 64))
                if polled <= 0:
                    if time.monotonic() - last_progress > stall_timeout:
                        for p in wave:
                            errors.setdefault(p.index, TransferStatus(TransferCode.TIMEOUT, "RDMA completion stalled"))
                        return errors  # the QP is now in an unknown state; the caller drops it
                    time.sleep(0)  # yield the GIL to other transports while the NIC works
                    continue
                last_progress = time.monotonic()
                pending -= polled
                for wc in completions:
                    if wc.status != e.IBV_WC_SUCCESS:
                        p = by_id[wc.wr_id]
                        errors.setdefault(
                            p.index, TransferStatus(TransferCode.CONNECTION, f"RDMA completion status {wc.status}")
                        )
        return errors

    def close(self) -> None:
        self.qp.close()
        self.cq.close()


class QueuePairLike(Protocol):
    """What :class:`RdmaPeer` needs of a queue pair (a real :class:`RdmaQueuePair`, or a
    simulation in :mod:`kvpool.transfer.testing`)."""

    @property
    def context(self) -> ContextLike: ...

    def execute(
        self, plans: list[WorkRequestPlan], lkeys: dict[int, int], stall_timeout: float
    ) -> dict[int, TransferStatus]: ...

    def close(self) -> None: ...


class ContextLike(Protocol):
    def lkey_for(self, addr: int, length: int) -> int | None: ...

    def register_temporary(self, addr: int, length: int) -> tuple[int, Any]: ...


class RdmaPeer:
    """RDMA path to one peer: a connected queue pair and the keys of the peer's segments.

    Batches run one at a time on the queue pair, on this peer's own thread. Local buffers outside
    every registered region are registered for the duration of their batch (correct, but a
    registration per request: register long-lived buffers with the context instead). After a
    stall or a failed completion the queue pair is in an unknown (RC: error) state, so the peer
    marks itself broken and the engine sends that peer's later requests over TCP.
    """

    inline = False

    def __init__(self, qp: QueuePairLike, keys: list[RdmaSegmentKey], stall_timeout: float = 10.0) -> None:
        self.qp = qp
        self.keys = {k.segment: k for k in keys}
        self.stall_timeout = stall_timeout
        self.broken = False
        self._queue: queue.SimpleQueue[tuple[BatchHandle, list[tuple[int, TransferRequest]]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._loop, name="kvpool-transfer-rdma", daemon=True)
        self._thread.start()

    def add_keys(self, keys: list[RdmaSegmentKey]) -> None:
        self.keys = {**self.keys, **{k.segment: k for k in keys}}  # swapped whole: readers never lock

    def handles(self, segment: str) -> bool:
        return not self.broken and segment in self.keys

    def submit(self, handle: BatchHandle, items: list[tuple[int, TransferRequest]]) -> None:
        """Queue ``items`` for this peer's worker thread (one piece per request)."""
        for index, _ in items:
            handle._expect(index, 1)
        self._queue.put((handle, items))

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            handle, items = job
            try:
                statuses = self.run([req for _, req in items])
            except Exception as exc:  # a device error fails this batch, never hangs it
                self.broken = True
                statuses = [TransferStatus(TransferCode.CONNECTION, f"RDMA error: {exc}")] * len(items)
            for (index, _), status in zip(items, statuses, strict=True):
                handle._complete(index, status)

    def close(self) -> None:
        """Finish the queued batches (the queue pair still works), then close the queue pair."""
        self._queue.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(5)
        self.qp.close()

    def run(self, requests: list[TransferRequest]) -> list[TransferStatus]:
        """Move ``requests`` (all for this peer) and return their statuses, in order."""
        if self.broken:
            return [TransferStatus(TransferCode.CONNECTION, "RDMA queue pair failed earlier")] * len(requests)
        context = self.qp.context
        statuses: list[TransferStatus] = [STATUS_OK] * len(requests)
        by_segment: dict[str, list[int]] = {}
        for position, req in enumerate(requests):
            by_segment.setdefault(req.remote_segment, []).append(position)
        temporary: list[Any] = []
        try:
            for segment, positions in by_segment.items():
                key = self.keys[segment]
                group = [requests[i] for i in positions]
                triples = [(r.op == "read", buffer_address(r.local), r.remote_offset, r.length) for r in group]
                plans, errors = plan_work_requests(triples, key)
                lkeys: dict[int, int] = {}
                for p in plans:
                    lkey = context.lkey_for(p.local_addr, p.length)
                    if lkey is None:
                        lkey, region = context.register_temporary(p.local_addr, p.length)
                        temporary.append(region)
                    lkeys[p.wr_id] = lkey
                runnable = [p for p in plans if p.index not in errors]
                failed = self.qp.execute(runnable, lkeys, self.stall_timeout)
                if any(st.code in (TransferCode.TIMEOUT, TransferCode.CONNECTION) for st in failed.values()):
                    self.broken = True
                errors.update(failed)
                for local_index, position in enumerate(positions):
                    statuses[position] = errors.get(local_index, STATUS_OK)
        finally:
            for region in temporary:
                region.close()
        return statuses
