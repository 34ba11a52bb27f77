"""kvpool.transfer — moves KV bytes between registered memory segments, batch-first.

Transports: TCP (K parallel connections per peer, sliced and retried), same-host shared memory
(direct copies), RDMA through pyverbs where devices exist. Control messages (which segment,
offset, lease token) come from the control plane; only payload moves here.
"""

from kvpool.transfer.batch import BatchHandle
from kvpool.transfer.engine import EngineSettings, TransferEngine
from kvpool.transfer.plan import TransferRequest
from kvpool.transfer.rdma import rdma_devices, rdma_status
from kvpool.transfer.segment import Guard, Segment, SegmentRegistry
from kvpool.transfer.server import TransferServer
from kvpool.transfer.status import TransferCode, TransferError, TransferStatus

__all__ = [
    "BatchHandle",
    "EngineSettings",
    "Guard",
    "Segment",
    "SegmentRegistry",
    "TransferCode",
    "TransferEngine",
    "TransferError",
    "TransferRequest",
    "TransferServer",
    "TransferStatus",
    "rdma_devices",
    "rdma_status",
]
