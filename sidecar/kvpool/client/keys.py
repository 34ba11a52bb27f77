"""Keys as the client sends them: one blob of fixed-length keys (:mod:`kvpool.core.keys`).

A key of the wrong length is the caller's mistake, so it is an
:class:`~kvpool.core.errors.InvalidArgument` here (the engine's error tree), not a ValueError.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.core import errors
from kvpool.core.keys import pack_keys as _pack_keys


def pack_keys(keys: Sequence[bytes]) -> bytes:
    """Keys as one blob; a key of the wrong length is an :class:`~kvpool.core.errors.InvalidArgument`."""
    try:
        return _pack_keys(keys)
    except errors.InvalidArgument:
        raise
    except (ValueError, TypeError) as exc:
        raise errors.InvalidArgument(str(exc)) from None
