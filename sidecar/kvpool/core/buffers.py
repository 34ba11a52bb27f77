"""Caller buffers as flat byte views (pure): one helper for the client and the store node client."""

from __future__ import annotations

from typing import Any

Buffer = Any  # bytes, bytearray, memoryview, numpy array: anything with the buffer protocol


def as_bytes_view(value: Buffer) -> memoryview:
    """A flat unsigned-byte view of any buffer (no copy unless it is not contiguous)."""
    mv = memoryview(value)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B") if mv.c_contiguous else memoryview(bytes(mv))
    return mv
