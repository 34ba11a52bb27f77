"""What a read or a handoff hands the engine: views held by one sidecar lease until released.

Each result holds the lease that pins its views in the sidecar's arena; :meth:`_Leased.release`
(or the ``with`` block's end) drops it once, or it ends by itself at the lease's expiry.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Self

from kvpool.core import handoff_record as _ho
from kvpool.core.planning import HitPlan
from kvpool.wire.proto import store_pb2 as pb

if TYPE_CHECKING:
    from kvpool.client.client import Client


def leading_ok(codes: Sequence[int]) -> int:
    """How many codes from the start are OK (a prefix ends at the first that is not)."""
    return next((i for i, c in enumerate(codes) if c != pb.OK), len(codes))


class _Leased:
    """What holds one sidecar lease: released once, by :meth:`release`, the ``with`` block's end
    or the lease's expiry."""

    lease_id: int
    _client: Client

    def release(self) -> None:
        if self.lease_id:
            self._client.release(self.lease_id)
            self.lease_id = 0

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Blocks(_Leased, list[memoryview]):
    """Views of objects, pinned by one lease until :meth:`release` or its expiry: into the
    sidecar's arena, or (objects the arena had no room for) into memory of this client's own,
    which lives as long as the views."""

    def __init__(self, views: list[memoryview], client: Client, lease_id: int) -> None:
        super().__init__(views)
        self.lease_id = lease_id
        self._client = client


class HandoffResult(_Leased):
    """What the decode side has after :meth:`Client.accept_handoff`: the plan, the blocks and
    the state (views into the arena, pinned until :meth:`release` or the lease's end), where the
    state came from, and timings (seconds).  Its own lease is the state's."""

    def __init__(self, record: _ho.HandoffRecord, plan: HitPlan, blocks: Blocks, block_codes: list[int],
                 state: memoryview | None, state_outcome: _ho.StateOutcome, state_detail: str,
                 state_lease_id: int, client: Client, blocks_local_seconds: float, state_seconds: float,
                 total_seconds: float, pool_hits: int, local_hits: int) -> None:
        self.record = record
        self.plan = plan
        self.blocks = blocks
        """Views of the record's leading local blocks, in order (all of them when none is missing)."""
        self.block_codes = block_codes
        self.state = state
        self.state_outcome = state_outcome
        self.state_detail = state_detail
        self.blocks_local_seconds = blocks_local_seconds
        """Sidecar time from the accept to every block local."""
        self.state_seconds = state_seconds
        self.total_seconds = total_seconds
        """Client time of the whole call."""
        self.pool_hits = pool_hits
        self.local_hits = local_hits
        self.lease_id = state_lease_id
        self._client = client

    @property
    def local_blocks(self) -> int:
        """Leading blocks of the record that are local now."""
        return leading_ok(self.block_codes)

    @property
    def missing_blocks(self) -> int:
        return sum(c != pb.OK for c in self.block_codes)

    @property
    def complete(self) -> bool:
        """Every block local, and the state too when the record names one."""
        return not self.missing_blocks and self.state_outcome not in (_ho.StateOutcome.EXPIRED,
                                                                     _ho.StateOutcome.GONE)

    def release(self) -> None:
        self.blocks.release()
        super().release()


class Reads(_Leased):
    """The answer of :meth:`Client.get_many`: per key its code (OK, NOT_FOUND, ...) and a view
    of the object (None where the code is not OK), the views held by one lease until
    :meth:`release` or its expiry (as :class:`Blocks`)."""

    def __init__(self, codes: list[int], views: list[memoryview | None], client: Client, lease_id: int) -> None:
        self.codes, self.views = codes, views
        self.lease_id = lease_id
        self._client = client

    @property
    def prefix(self) -> int:
        """How many keys from the start were read (what an engine can use of a matched prefix)."""
        return leading_ok(self.codes)


class RangeReads(_Leased):
    """The answer of :meth:`Client.get_ranges_many`: per key its code, the object's size and
    views of its ranges in the sidecar's arena (None where the code is not OK), all held by one
    lease until :meth:`release` or its expiry."""

    def __init__(self, codes: list[int], sizes: list[int], views: list[list[memoryview] | None], client: Client,
                 lease_id: int) -> None:
        self.codes, self.sizes, self.views = codes, sizes, views
        self.lease_id = lease_id
        self._client = client
