"""The checksum every stored blob carries: XXH3-64 (pure)."""

from __future__ import annotations

import xxhash


def checksum(view: memoryview | bytes) -> int:
    """XXH3-64 of a buffer (the checksum carried by every blob)."""
    return int(xxhash.xxh3_64_intdigest(view))
