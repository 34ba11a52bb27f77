"""Block keys: the prefix-chained SHA-256 key scheme of DESIGN §3.

A :class:`KeySpace` names everything that changes KV for the same tokens (model, weight
revision, LoRA adapter, KV dtype, layout, extra inputs, block size).  Its *seed* is the SHA-256
of a fixed, versioned encoding of those fields (:data:`SEED_ENCODING_VERSION`)::

    b"kvpool.keyspace\\x00" || u16 version
    || for each field in (model, revision, lora, kv_dtype, layout): u32 len || utf-8 bytes
    || u32 n_extra || for each (k, v) of extra sorted by k: u32 len || k || u32 len || v
    || u32 block_tokens
    (all integers little-endian)

Then ``key[0] = SHA-256(seed || tokens[0:B])`` and ``key[i] = SHA-256(key[i-1] || tokens[iB:(i+1)B])``
with tokens encoded as 4-byte little-endian unsigned integers.  Only full blocks have keys.
Keys never depend on Python's ``hash()`` or any per-process seed.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

SEED_ENCODING_VERSION = 1
KEY_BYTES = 32
_SEED_MAGIC = b"kvpool.keyspace\x00"

Tokens = Sequence[int] | npt.NDArray[np.integer]


def _lp(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def tokens_to_bytes(tokens: Tokens) -> bytes:
    """Encode tokens as little-endian u32; refuse values outside [0, 2**32)."""
    if isinstance(tokens, np.ndarray):
        arr = tokens
        if arr.ndim != 1:
            raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
        if arr.dtype != np.dtype("<u4"):
            if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
                raise ValueError("token ids must be in [0, 2**32)")
            arr = arr.astype("<u4")
        return arr.tobytes()
    # array.array would be faster for lists but silently wraps negatives on some paths; numpy
    # with an explicit range check is exact and fast enough (the chain dominates).
    arr64 = np.asarray(tokens, dtype=np.int64)
    if arr64.ndim != 1:
        raise ValueError("tokens must be a flat sequence of ints")
    if arr64.size and (int(arr64.min()) < 0 or int(arr64.max()) > 0xFFFFFFFF):
        raise ValueError("token ids must be in [0, 2**32)")
    return arr64.astype("<u4").tobytes()


@dataclass(frozen=True)
class KeySpace:
    """Everything that changes the KV of the same tokens; computes block keys within it."""

    model: str
    revision: str = ""
    lora: str = ""
    kv_dtype: str = ""
    layout: str = ""
    extra: Mapping[str, str] | None = None
    block_tokens: int = 128
    seed: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {self.block_tokens}")
        object.__setattr__(self, "seed", hashlib.sha256(self.seed_material()).digest())

    def seed_material(self) -> bytes:
        """The versioned byte encoding whose SHA-256 is the seed (see module docstring)."""
        parts = [_SEED_MAGIC, struct.pack("<H", SEED_ENCODING_VERSION)]
        for value in (self.model, self.revision, self.lora, self.kv_dtype, self.layout):
            parts.append(_lp(value.encode("utf-8")))
        extra = sorted((self.extra or {}).items())
        parts.append(struct.pack("<I", len(extra)))
        for k, v in extra:
            parts.append(_lp(str(k).encode("utf-8")))
            parts.append(_lp(str(v).encode("utf-8")))
        parts.append(struct.pack("<I", self.block_tokens))
        return b"".join(parts)

    def block_keys(self, tokens: Tokens, start_key: bytes | None = None) -> list[bytes]:
        """Keys of every full block of ``tokens`` (one 32-byte key per block).

        ``start_key`` continues a chain: pass the key of the block before ``tokens[0]``.
        """
        return chain_keys(self.seed if start_key is None else start_key,
                          tokens_to_bytes(tokens), self.block_tokens * 4)

    def num_blocks(self, n_tokens: int) -> int:
        return n_tokens // self.block_tokens


def chain_keys(seed: bytes, data: bytes, block_bytes: int) -> list[bytes]:
    """The SHA-256 chain over full ``block_bytes`` chunks of ``data`` (serial by nature).

    The loop body is three C calls; the per-block Python overhead is what bounds it.
    """
    n = len(data) // block_bytes
    out: list[bytes] = [b""] * n
    mv = memoryview(data)
    sha = hashlib.sha256
    prev = seed
    off = 0
    for i in range(n):
        h = sha(prev)
        h.update(mv[off:off + block_bytes])
        prev = h.digest()
        out[i] = prev
        off += block_bytes
    return out


def pack_keys(keys: Sequence[bytes]) -> bytes:
    """Concatenate keys for the wire, checking each is 32 bytes."""
    blob = b"".join(keys)
    if len(blob) != KEY_BYTES * len(keys):
        bad = next(i for i, k in enumerate(keys) if len(k) != KEY_BYTES)
        raise ValueError(f"key {bad} has {len(keys[bad])} bytes, expected {KEY_BYTES}")
    return blob


def unpack_keys(blob: bytes) -> list[bytes]:
    """Split a concatenation of 32-byte keys (the wire form) into a list."""
    if len(blob) % KEY_BYTES:
        raise ValueError(f"key blob of {len(blob)} bytes is not a multiple of {KEY_BYTES}")
    # A void dtype keeps trailing NUL bytes (an 'S32' view would strip them) and its tolist()
    # builds the bytes objects in C: ~7x faster than slicing in a Python loop.
    keys: list[bytes] = np.frombuffer(blob, dtype=f"V{KEY_BYTES}").tolist()
    return keys
