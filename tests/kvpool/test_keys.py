"""Block keys: fixed test vectors, chaining properties, determinism across processes."""

import hashlib
import struct
import subprocess
import sys

import numpy as np
import pytest

from kvpool.core.keys import SEED_ENCODING_VERSION, KeySpace, pack_keys, tokens_to_bytes, unpack_keys

# Test vectors: another implementation of the scheme checks itself against these.
VECTOR_KS = dict(model="meta-llama/Llama-3.1-8B", revision="abc", kv_dtype="bf16", layout="tp1r0", block_tokens=4)
VECTOR_SEED = "a4c15c75c7af01ac8f33043f1a3334cad074cd4e9c2aa6e9ca9440f56db71d6c"
VECTOR_KEYS = ["97a7a847f5e8d73782d80da11eba7e1bad8d5a2ffdd2157dc56d4324da898cf9",
               "e91656a1d09eda407bb9acccd0b23ff035084b6736a4bb485dd5df7dfc953c45"]
VECTOR_DEFAULT_SEED = "08aa2f7969ff033abe37d93a0d81089cda248dc35d1a0d7b0639721a94456bee"


def _independent_seed(model: str, revision: str, lora: str, kv_dtype: str, layout: str,
                      extra: dict[str, str], block_tokens: int) -> bytes:
    """The documented encoding written out again, independently of kvpool.core.keys."""
    def lp(s: str) -> bytes:
        b = s.encode()
        return struct.pack("<I", len(b)) + b
    m = b"kvpool.keyspace\x00" + struct.pack("<H", 1)
    m += b"".join(lp(x) for x in (model, revision, lora, kv_dtype, layout))
    m += struct.pack("<I", len(extra)) + b"".join(lp(k) + lp(v) for k, v in sorted(extra.items()))
    m += struct.pack("<I", block_tokens)
    return hashlib.sha256(m).digest()


def test_vectors() -> None:
    ks = KeySpace(**VECTOR_KS)  # type: ignore[arg-type]
    assert SEED_ENCODING_VERSION == 1
    assert ks.seed.hex() == VECTOR_SEED
    assert [k.hex() for k in ks.block_keys(list(range(10)))] == VECTOR_KEYS
    assert KeySpace("m").seed.hex() == VECTOR_DEFAULT_SEED


def test_seed_matches_independent_encoding() -> None:
    extra = {"mm": "deadbeef", "a": "1"}
    ks = KeySpace("m", "r", "lora-x", "fp8", "tp2r1", extra, 16)
    assert ks.seed == _independent_seed("m", "r", "lora-x", "fp8", "tp2r1", extra, 16)


def test_chain_definition() -> None:
    ks = KeySpace("m", block_tokens=3)
    toks = [1, 2, 3, 4, 5, 6, 7]
    keys = ks.block_keys(toks)
    assert len(keys) == 2  # only full blocks
    k0 = hashlib.sha256(ks.seed + struct.pack("<3I", 1, 2, 3)).digest()
    k1 = hashlib.sha256(k0 + struct.pack("<3I", 4, 5, 6)).digest()
    assert keys == [k0, k1]


def test_every_field_changes_the_seed() -> None:
    base = KeySpace("m")
    variants = [KeySpace("m2"), KeySpace("m", revision="r"), KeySpace("m", lora="l"),
                KeySpace("m", kv_dtype="fp8"), KeySpace("m", layout="tp2"), KeySpace("m", extra={"x": "1"}),
                KeySpace("m", block_tokens=64)]
    seeds = {base.seed, *(v.seed for v in variants)}
    assert len(seeds) == len(variants) + 1
    # Field boundaries are length-prefixed: moving a character between fields changes the seed.
    assert KeySpace("ab", revision="c").seed != KeySpace("a", revision="bc").seed


def test_token_change_changes_its_block_and_later_only() -> None:
    ks = KeySpace("m", block_tokens=16)
    rng = np.random.default_rng(1)
    toks = rng.integers(0, 50000, 16 * 8).astype(np.uint32)
    keys = ks.block_keys(toks)
    for pos in (0, 17, 16 * 5 + 3, 16 * 8 - 1):
        t2 = toks.copy()
        t2[pos] ^= 1
        k2 = ks.block_keys(t2)
        b = pos // 16
        assert k2[:b] == keys[:b]
        assert all(x != y for x, y in zip(k2[b:], keys[b:], strict=True))


def test_list_and_numpy_inputs_agree() -> None:
    ks = KeySpace("m", block_tokens=8)
    toks = list(range(100))
    assert ks.block_keys(toks) == ks.block_keys(np.array(toks, dtype=np.int64)) == \
        ks.block_keys(np.array(toks, dtype=np.uint32))


def test_continuation_with_start_key() -> None:
    ks = KeySpace("m", block_tokens=4)
    toks = list(range(40))
    keys = ks.block_keys(toks)
    assert ks.block_keys(toks[16:], start_key=keys[3]) == keys[4:]


def test_bad_tokens_are_refused() -> None:
    with pytest.raises(ValueError):
        tokens_to_bytes([-1])
    with pytest.raises(ValueError):
        tokens_to_bytes([2 ** 32])
    with pytest.raises(ValueError):
        tokens_to_bytes(np.zeros((2, 2), dtype=np.int32))
    with pytest.raises(ValueError):
        KeySpace("m", block_tokens=0)


def test_pack_unpack_keeps_trailing_zero_bytes() -> None:
    keys = [bytes(32), b"\x01" * 31 + b"\x00", b"\xff" * 32]
    assert unpack_keys(pack_keys(keys)) == keys
    with pytest.raises(ValueError):
        pack_keys([b"short"])
    with pytest.raises(ValueError):
        unpack_keys(b"x" * 33)


def test_keys_equal_across_processes() -> None:
    code = ("import sys; from kvpool.core.keys import KeySpace; "
            "sys.stdout.write(KeySpace('m', lora='z', block_tokens=4).block_keys(list(range(12)))[-1].hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={"PYTHONHASHSEED": str(seed), "PATH": "/usr/bin:/bin"}, check=True).stdout
            for seed in (0, 1, 12345)}
    assert outs == {KeySpace("m", lora="z", block_tokens=4).block_keys(list(range(12)))[-1].hex()}
