"""Batch handles: per-request completion tracking shared by every transport.

A request is *final* only once every slice of it has finished (succeeded or failed), so when a
status is visible no transport thread can still be writing into the caller's buffer — even if an
early slice already failed. The first error of a request is its status.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpool.transfer.status import STATUS_OK, TransferCode, TransferStatus


class BatchHandle:
    """Completion of one :meth:`TransferEngine.submit` call.

    Thread-safe. ``wait``/``poll`` may be called from any thread; callbacks added with
    :meth:`add_done_callback` run on the thread that completes the last request (keep them
    short — e.g. ``loop.call_soon_threadsafe``).
    """

    def __init__(self, count: int, on_request_done: Callable[[int, TransferStatus], None] | None = None) -> None:
        self._on_request_done = on_request_done
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._pending = [0] * count
        self._errors: list[TransferStatus | None] = [None] * count
        self._final: list[TransferStatus | None] = [None] * count
        self._remaining = count
        self._callbacks: list[Callable[[BatchHandle], None]] = []
        self._sealed = False
        if count == 0:
            self._done.set()

    # -- producer side (transports) ----------------------------------------------------------

    def _expect(self, index: int, slices: int) -> None:
        """Register ``slices`` more pieces of request ``index`` (before they can complete)."""
        self._pending[index] += slices

    def _seal(self) -> None:
        """All pieces are registered; finish requests that needed none (zero-length)."""
        with self._lock:
            self._sealed = True
            for index, pending in enumerate(self._pending):
                if pending == 0 and self._final[index] is None:
                    if self._on_request_done is not None:
                        self._on_request_done(index, self._errors[index] or STATUS_OK)
                    self._finish(index)
            callbacks = self._take_callbacks_if_done()
        for cb in callbacks:
            cb(self)

    def _complete(self, index: int, status: TransferStatus) -> None:
        """One piece of request ``index`` finished with ``status``."""
        hook = self._on_request_done
        if hook is not None:
            # The per-request hook must run before the batch can be seen as done (a waiter may
            # read what the hook produced), so the last piece's hook runs before _finish.
            with self._lock:
                if not status.ok and self._errors[index] is None:
                    self._errors[index] = status
                self._pending[index] -= 1
                last = self._pending[index] == 0 and self._sealed
                final = (self._errors[index] or STATUS_OK) if last else None
            if final is not None:
                try:
                    hook(index, final)
                except Exception:  # a caller bug must not wedge the transport thread
                    pass
            with self._lock:
                if last:
                    self._finish(index)
                callbacks = self._take_callbacks_if_done()
            for cb in callbacks:
                cb(self)
            return
        with self._lock:
            if not status.ok and self._errors[index] is None:
                self._errors[index] = status
            self._pending[index] -= 1
            if self._pending[index] == 0 and self._sealed:
                self._finish(index)
            callbacks = self._take_callbacks_if_done()
        for cb in callbacks:
            cb(self)

    def _finish(self, index: int) -> None:
        error = self._errors[index]
        self._final[index] = STATUS_OK if error is None else error
        self._remaining -= 1
        if self._remaining == 0:
            self._done.set()

    def _take_callbacks_if_done(self) -> list[Callable[[BatchHandle], None]]:
        if self._remaining or not self._callbacks:
            return []
        callbacks, self._callbacks = self._callbacks, []
        return callbacks

    # -- consumer side -----------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def __len__(self) -> int:
        return len(self._final)

    def poll(self) -> list[TransferStatus | None]:
        """Per-request status, ``None`` for requests still in progress."""
        with self._lock:
            return list(self._final)

    def wait(self, timeout: float | None = None) -> list[TransferStatus]:
        """Block until every request is final and return their statuses.

        Raises ``TimeoutError`` if ``timeout`` passes first; the batch keeps running (and its
        buffers stay in use) — the engine's stall timeout is what bounds a batch.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"batch not finished within {timeout} s")
        return [s if s is not None else STATUS_OK for s in self._final]

    async def wait_async(self) -> list[TransferStatus]:
        """``wait()`` for asyncio code: suspends the task, never blocks the event loop."""
        if not self.done:
            loop = asyncio.get_running_loop()
            future: asyncio.Future[None] = loop.create_future()

            def wake(_: BatchHandle) -> None:
                loop.call_soon_threadsafe(_resolve, future)

            self.add_done_callback(wake)
            await future
        return self.wait(0)

    def add_done_callback(self, callback: Callable[[BatchHandle], None]) -> None:
        with self._lock:
            if self._remaining:
                self._callbacks.append(callback)
                return
        callback(self)

    def __repr__(self) -> str:
        return f"<BatchHandle {len(self) - self._remaining}/{len(self)} done>"


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():  # the awaiting task may have been cancelled meanwhile
        future.set_result(None)


@dataclass(eq=False, slots=True)
class Slice:
    """A piece of one request as a transport moves it."""

    batch: BatchHandle
    index: int
    is_read: bool
    local: memoryview
    segment: bytes
    remote_offset: int
    length: int
    token: int
    attempts: int = 0
    request_id: int = field(default=0)

    def complete(self, status: TransferStatus) -> None:
        self.batch._complete(self.index, status)

    def fail(self, code: TransferCode, message: str) -> None:
        self.batch._complete(self.index, TransferStatus(code, message))
