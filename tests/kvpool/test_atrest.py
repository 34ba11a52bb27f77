"""Encryption at rest, pure: key derivation vectors, seal/open, and every way a blob must fail."""

from __future__ import annotations

import hashlib
import hmac
import random

import pytest

from kvpool.tiers.atrest import (
    HKDF_INFO,
    HKDF_SALT,
    KEY_ID,
    NONCE,
    OVERHEAD,
    AtRest,
    MasterKeyError,
    derive_tenant_key,
    key_id,
    parse_master_key,
    parse_previous_keys,
    sealed_size,
)

MASTER = bytes(range(32))
KEY = hashlib.sha256(b"block").digest()


def _hkdf_sha256(ikm: bytes, salt: bytes, info: bytes, length: int) -> bytes:
    """RFC 5869 written out with hmac: an implementation independent of the one under test."""
    prk = hmac.new(salt, ikm, hashlib.sha256).digest()
    out, t, i = b"", b"", 1
    while len(out) < length:
        t = hmac.new(prk, t + info + bytes([i]), hashlib.sha256).digest()
        out += t
        i += 1
    return out[:length]


def test_reference_hkdf_matches_rfc5869_case_1() -> None:
    okm = _hkdf_sha256(bytes.fromhex("0b" * 22), bytes.fromhex("000102030405060708090a0b0c"),
                       bytes.fromhex("f0f1f2f3f4f5f6f7f8f9"), 42)
    assert okm.hex() == ("3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf"
                         "34007208d5b887185865")


@pytest.mark.parametrize("tenant", ["default", "team-a", "tenant-ü", ""])
def test_tenant_key_is_hkdf_of_master_and_tenant(tenant: str) -> None:
    want = _hkdf_sha256(MASTER, HKDF_SALT, HKDF_INFO + tenant.encode(), 32)
    assert derive_tenant_key(MASTER, tenant) == want


def test_derivation_vector_is_pinned() -> None:
    # A change here makes every sealed file of every pool unreadable: it needs a new format version.
    assert derive_tenant_key(MASTER, "team-a").hex() == (
        "348f988510dc0182c4c14708eddd86031e2af3b50afa055d9604ae98e508374b")


def test_keys_differ_per_tenant_and_per_master() -> None:
    keys = {derive_tenant_key(m, t) for m in (MASTER, MASTER[::-1]) for t in ("a", "b", "ab", "a\0b")}
    assert len(keys) == 8


def test_master_key_file_contents() -> None:
    assert parse_master_key(b"x" * 44 + b"\n") == b"x" * 44  # a text key: the editor's newline goes
    binary = bytes(range(200, 232)) + b"\n"
    assert parse_master_key(binary) == binary  # raw bytes are used as they are
    with pytest.raises(MasterKeyError, match="at least 32 bytes"):
        parse_master_key(b"short\n")
    with pytest.raises(MasterKeyError):
        AtRest(b"x" * 31)
    assert "x" * 32 not in repr(AtRest(b"x" * 32))


@pytest.mark.parametrize("size", [0, 1, 15, 16, 17, 4096, 100_003])
def test_seal_open_round_trip(size: int) -> None:
    rng = random.Random(size)
    data = rng.randbytes(size)
    a = AtRest(MASTER)
    blob = a.seal("t", KEY, 0, 7, memoryview(data))
    assert len(blob) == sealed_size(size) == size + OVERHEAD
    if size >= 16:
        assert data not in bytes(blob)
    out = bytearray(size)
    assert a.open_into("t", KEY, 0, 7, blob, memoryview(out))
    assert bytes(out) == data
    # Another instance from the same master key (another node of the pool) opens it too.
    out2 = bytearray(size)
    assert AtRest(MASTER).open_into("t", KEY, 0, 7, bytes(blob), memoryview(out2)) and out2 == data


def test_nonces_are_fresh() -> None:
    a = AtRest(MASTER)
    blobs = {bytes(a.seal("t", KEY, 0, 1, b"same bytes")) for _ in range(64)}
    assert len(blobs) == 64
    assert len({b[KEY_ID:KEY_ID + NONCE] for b in blobs}) == 64


def _blob() -> tuple[AtRest, bytes, bytes]:
    a = AtRest(MASTER)
    data = random.Random(1).randbytes(1000)
    return a, data, bytes(a.seal("tenant-a", KEY, 0, 42, data))


@pytest.mark.parametrize("change", [
    {"tenant": "tenant-b"},            # copied from another tenant's partition (another key)
    {"key": hashlib.sha256(b"other").digest()},  # swapped between two objects of one tenant
    {"kind": 1},                       # a block presented as a state object
    {"generation": 43},                # an older seal of the same slot
    {"master": MASTER[::-1]},          # a node restarted with another master key
])
def test_foreign_blobs_fail(change: dict[str, object]) -> None:
    a, data, blob = _blob()
    args: dict[str, object] = {"tenant": "tenant-a", "key": KEY, "kind": 0, "generation": 42, **change}
    opener = AtRest(change["master"]) if "master" in change else a  # type: ignore[arg-type]
    out = bytearray(len(data))
    assert not opener.open_into(args["tenant"], args["key"], args["kind"], args["generation"],  # type: ignore[arg-type]
                                blob, memoryview(out))
    assert bytes(out) != data


def test_every_tampered_byte_fails() -> None:
    a, data, blob = _blob()
    # Every region: key id, nonce, ciphertext (start, middle, end), tag.
    body = KEY_ID + NONCE
    for pos in [0, KEY_ID - 1, KEY_ID, body - 1, body, body + 500, len(blob) - 17, len(blob) - 16, len(blob) - 1]:
        bad = bytearray(blob)
        bad[pos] ^= 0x01
        assert not a.open_into("tenant-a", KEY, 0, 42, bytes(bad), memoryview(bytearray(len(data)))), pos


def test_truncated_or_extended_blobs_fail() -> None:
    a, data, blob = _blob()
    for cut in (0, 1, KEY_ID, KEY_ID + NONCE, KEY_ID + NONCE + 16, len(blob) - 1):
        assert not a.open_into("tenant-a", KEY, 0, 42, blob[:cut], memoryview(bytearray(len(data))))
        # ...also when the reader believes the object is as short as what is left (size is bound too).
        n = max(0, cut - OVERHEAD)
        assert not a.open_into("tenant-a", KEY, 0, 42, blob[:cut], memoryview(bytearray(n)))
    assert not a.open_into("tenant-a", KEY, 0, 42, blob + b"\0", memoryview(bytearray(len(data))))
    assert not a.open_into("tenant-a", KEY, 0, 42, blob, memoryview(bytearray(len(data) + 1)))


# ------------------------------------------------------------------------------- rotation

NEW = bytes(range(100, 132))
OLDER = bytes(range(200, 232))


def test_key_id_is_hmac_of_a_label_and_says_nothing_of_the_key() -> None:
    assert key_id(MASTER) == hmac.new(MASTER, b"kvpool at-rest key id", hashlib.sha256).digest()[:4]
    assert key_id(MASTER) != key_id(NEW) and len(key_id(MASTER)) == KEY_ID


def test_a_rotated_node_opens_old_blobs_and_seals_under_the_new_key() -> None:
    old = AtRest(MASTER)
    data = random.Random(2).randbytes(3000)
    sealed_old = bytes(old.seal("t", KEY, 0, 5, data))
    assert old.sealed_with_current(sealed_old)
    rotated = AtRest(NEW, previous=[MASTER])
    out = bytearray(len(data))
    assert rotated.open_into("t", KEY, 0, 5, sealed_old, memoryview(out)) and out == data
    assert not rotated.sealed_with_current(sealed_old)
    sealed_new = bytes(rotated.seal("t", KEY, 0, 6, data))
    assert sealed_new[:KEY_ID] == key_id(NEW) and rotated.sealed_with_current(sealed_new)
    # A node that has not rotated yet cannot open what a rotated one sealed: the id is unknown.
    assert not old.open_into("t", KEY, 0, 6, sealed_new, memoryview(bytearray(len(data))))
    assert rotated.key_ids == [key_id(NEW), key_id(MASTER)]


def test_dropping_a_previous_key_makes_its_blobs_misses() -> None:
    data = b"x" * 500
    sealed_old = bytes(AtRest(MASTER).seal("t", KEY, 0, 1, data))
    a = AtRest(NEW, previous=[OLDER, MASTER])
    assert a.open_into("t", KEY, 0, 1, sealed_old, memoryview(bytearray(500)))
    a.set_keys(NEW, [OLDER])
    out = bytearray(500)
    assert not a.open_into("t", KEY, 0, 1, sealed_old, memoryview(out)) and bytes(out) == bytes(500)


def test_a_forged_key_id_does_not_open() -> None:
    a = AtRest(NEW, previous=[MASTER])
    blob = bytearray(a.seal("t", KEY, 0, 1, b"y" * 100))
    blob[:KEY_ID] = key_id(MASTER)  # claims the other held key: the tag is bound to the real one
    assert not a.open_into("t", KEY, 0, 1, bytes(blob), memoryview(bytearray(100)))


@pytest.mark.parametrize("raw, want", [
    (b"", []),
    (b"\n\n", []),
    (b"a" * 32 + b"\n", [b"a" * 32]),
    (b"a" * 32 + b"\r\n\n" + b"b" * 40, [b"a" * 32, b"b" * 40]),
])
def test_previous_keys_file(raw: bytes, want: list[bytes]) -> None:
    assert parse_previous_keys(raw) == want


@pytest.mark.parametrize("raw", [b"short\n", b"a" * 32 + b"\n" + b"b" * 31, bytes(range(256))])
def test_bad_previous_keys_are_refused(raw: bytes) -> None:
    with pytest.raises(MasterKeyError):
        parse_previous_keys(raw)
    with pytest.raises(MasterKeyError):
        AtRest(NEW, previous=[b"short"])
