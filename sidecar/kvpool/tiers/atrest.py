"""Encryption at rest of the tiers below DRAM (SSD slots, shared-filesystem files), per tenant.

Pure (no files, no sockets): the store node hands sealed bytes to its tiers and opens what they
read back.  Keys and format:

- tenant key = HKDF-SHA256(master key, salt ``kvpool at-rest v1``, info ``kvpool tenant key\\0`` ‖
  tenant id), 32 bytes: AES-256-GCM.  Derived on first use and kept in this process only; the
  master key comes from a file (a mounted Secret) and never leaves the store node.
- sealed object = key id (4 bytes) ‖ nonce (12 random bytes) ‖ ciphertext ‖ tag (16 bytes),
  :data:`OVERHEAD` = 32.  The key id names the master key that sealed it (HMAC-SHA256 of a fixed
  label under that master key, first 4 bytes: it says nothing about the key).
- associated data = format tag ‖ tenant id ‖ kind ‖ object key ‖ generation ‖ plaintext size ‖
  key id ‖ nonce.  A blob sealed for another tenant (another key), another object key or kind,
  another generation or size, under a master key this node no longer holds — or tampered, or
  truncated — fails authentication; the node counts it and treats the object as a miss.

Rotation: a node holds one current master key (every seal uses it) and any number of previous
ones (opened by key id, never used to seal).  New master key in ``key``, the old one moved to
``previous``, and what was sealed before stays readable; once the old objects have aged out of
the lower tiers (or the misses are acceptable: it is a cache), drop the old key.

Random 96-bit nonces: NIST SP 800-38D bounds one key to 2^32 seals; a tenant key seals one blob
per demotion, so a node would need 2^32 demotions of one tenant before that bound matters.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

KEY_ID = 4
NONCE = 12
TAG = 16
OVERHEAD = KEY_ID + NONCE + TAG
MASTER_KEY_MIN_BYTES = 32
HKDF_SALT = b"kvpool at-rest v1"
HKDF_INFO = b"kvpool tenant key\0"
AAD_TAG = b"kvpool-at-rest/2\0"
KEY_ID_LABEL = b"kvpool at-rest key id"
_AAD_TAIL = struct.Struct("<BQQ")  # kind, generation, plaintext size


def _crypto() -> Any:
    """The ``cryptography`` modules, imported on first use: a node without encryption at rest runs
    without the package (it comes with the ``dataplane`` extra)."""
    try:
        from cryptography import exceptions
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.ciphers import aead
        from cryptography.hazmat.primitives.kdf import hkdf
    except ImportError:  # pragma: no cover - depends on the installation
        raise MasterKeyError("encryption at rest needs the cryptography package (pip install 'kvpool[dataplane]')"
                             ) from None
    return exceptions, hashes, aead, hkdf


class MasterKeyError(ValueError):
    """The master key file is missing, unreadable or too short."""


def parse_master_key(raw: bytes) -> bytes:
    """The key material of a master-key file.

    A Secret's value is mounted as its bytes; a text key (e.g. base64 of 32 random bytes, what the
    operator generates) is used as written, without the trailing newline an editor adds.  Either
    way at least 32 bytes: HKDF stretches nothing that is not there.
    """
    key = raw.rstrip(b"\r\n") if raw.isascii() else raw
    if len(key) < MASTER_KEY_MIN_BYTES:
        raise MasterKeyError(f"the master key must hold at least {MASTER_KEY_MIN_BYTES} bytes, got {len(key)}")
    return key


def parse_previous_keys(raw: bytes) -> list[bytes]:
    """The keys of a previous-keys file: one text key per line (newest first), blank lines
    ignored, each at least 32 bytes."""
    if not raw.isascii():
        raise MasterKeyError("the previous master keys must be text, one key per line")
    keys = [line.strip() for line in raw.splitlines() if line.strip()]
    for i, k in enumerate(keys, 1):
        if len(k) < MASTER_KEY_MIN_BYTES:
            raise MasterKeyError(f"previous master key {i} must hold at least {MASTER_KEY_MIN_BYTES} bytes, "
                                 f"got {len(k)}")
    return keys


def load_master_key(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise MasterKeyError(f"cannot read the master key file {path}: {exc.strerror}") from None
    return parse_master_key(raw)


def load_previous_keys(path: str) -> list[bytes]:
    """A previous-keys file's keys; a file that does not exist holds none (the Secret has no
    ``previous`` entry: nothing was rotated yet)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise MasterKeyError(f"cannot read the previous master keys file {path}: {exc.strerror}") from None
    return parse_previous_keys(raw)


def key_id(master: bytes) -> bytes:
    """The 4-byte id of a master key, stored in front of what it seals."""
    return hmac.new(master, KEY_ID_LABEL, hashlib.sha256).digest()[:KEY_ID]


def derive_tenant_key(master: bytes, tenant_id: str) -> bytes:
    """The tenant's AES-256 key (deterministic: every node of a pool derives the same one)."""
    _, hashes, _, hkdf = _crypto()
    kdf = hkdf.HKDF(algorithm=hashes.SHA256(), length=32, salt=HKDF_SALT, info=HKDF_INFO + tenant_id.encode())
    return bytes(kdf.derive(master))


def associated_data(tenant_id: str, key: bytes, kind: int, generation: int, size: int, kid: bytes,
                    nonce: bytes) -> bytes:
    t = tenant_id.encode()
    return b"".join((AAD_TAG, len(t).to_bytes(2, "little"), t, len(key).to_bytes(1, "little"), key,
                     _AAD_TAIL.pack(kind, generation, size), kid, nonce))


def sealed_size(size: int) -> int:
    return size + OVERHEAD


class AtRest:
    """Seals and opens objects of every tenant under keys derived from the node's master keys:
    seals under the current one, opens under whichever one a blob names (see rotation above).

    Thread safety: AESGCM objects are safe to share between threads; the key cache is filled
    under the caller's lock or races benignly (two derivations of the same key); :meth:`set_keys`
    swaps whole maps, so a reader sees the old keys or the new ones.  :meth:`scratch` is one
    buffer, for one thread at a time (the tiers seal off the index lock, through
    :class:`~kvpool.tiers.sealed.SealedTier`'s per-thread buffers, not this one).
    """

    _ciphers: dict[tuple[bytes, str], AESGCM]
    """(master key id, tenant id) → the tenant's cipher under that master key."""

    def __init__(self, master_key: bytes, previous: Sequence[bytes] = ()) -> None:
        exceptions, _, aead, _ = _crypto()
        self._aesgcm: type[AESGCM] = aead.AESGCM
        self._invalid_tag = exceptions.InvalidTag
        self._into = hasattr(aead.AESGCM, "encrypt_into")  # cryptography >= 45: no intermediate copy
        self._scratch = bytearray()
        self.set_keys(master_key, previous)

    def set_keys(self, master_key: bytes, previous: Sequence[bytes] = ()) -> None:
        """Make ``master_key`` the sealing key and ``previous`` the keys still opened."""
        for k in (master_key, *previous):
            if len(k) < MASTER_KEY_MIN_BYTES:
                raise MasterKeyError(f"a master key must hold at least {MASTER_KEY_MIN_BYTES} bytes")
        masters = {key_id(k): k for k in reversed(previous)}
        current = key_id(master_key)
        masters[current] = master_key
        self._masters, self._ciphers, self.current_id = masters, {}, current

    @property
    def key_ids(self) -> list[bytes]:
        """Ids of the master keys held, the current one first."""
        return [self.current_id, *(k for k in self._masters if k != self.current_id)]

    def __repr__(self) -> str:  # never the key, not even in a traceback
        return f"AtRest(keys={len(self._masters)}, tenants={len(self._ciphers)})"

    def _cipher(self, kid: bytes, tenant_id: str) -> AESGCM | None:
        ciphers = self._ciphers
        c = ciphers.get((kid, tenant_id))
        if c is None:
            master = self._masters.get(kid)
            if master is None:
                return None
            c = ciphers[(kid, tenant_id)] = self._aesgcm(derive_tenant_key(master, tenant_id))
        return c

    def sealed_with_current(self, blob: memoryview | bytes | bytearray) -> bool:
        """Whether ``blob`` names the current master key (False: a previous one or none held)."""
        return bytes(memoryview(blob)[:KEY_ID]) == self.current_id

    def scratch(self, n: int) -> memoryview:
        """A reused buffer of ``n`` bytes, valid until the next call.  A fresh multi-MiB buffer per
        object costs a page fault per 4 KiB: more than AES-GCM itself (4x at 4 MiB objects)."""
        if len(self._scratch) < n:
            self._scratch = bytearray(-(-n // (1 << 20)) << 20)  # a new one: views of the old may live
        return memoryview(self._scratch)[:n]

    def seal(self, tenant_id: str, key: bytes, kind: int, generation: int,
             src: memoryview | bytes | bytearray, out: memoryview | None = None) -> memoryview:
        """``nonce ‖ ciphertext ‖ tag`` of ``src``, in one pass, into ``out`` (of
        :func:`sealed_size` bytes, e.g. from :meth:`scratch`) or a fresh buffer."""
        nonce = os.urandom(NONCE)
        if out is None:
            out = memoryview(bytearray(sealed_size(len(src))))
        elif len(out) != sealed_size(len(src)):
            raise ValueError(f"a sealed {len(src)}-byte object needs {sealed_size(len(src))} bytes, got {len(out)}")
        kid = self.current_id
        c = self._cipher(kid, tenant_id)
        assert c is not None
        out[:KEY_ID] = kid
        out[KEY_ID:KEY_ID + NONCE] = nonce
        aad = associated_data(tenant_id, key, kind, generation, len(src), kid, nonce)
        body = KEY_ID + NONCE
        if self._into:
            c.encrypt_into(nonce, src, aad, out[body:])
        else:  # cryptography < 45: one more copy
            out[body:] = c.encrypt(nonce, bytes(src), aad)
        return out

    def open_into(self, tenant_id: str, key: bytes, kind: int, generation: int,
                  blob: memoryview | bytes | bytearray, dst: memoryview) -> bool:
        """Decrypt ``blob`` into ``dst`` (the plaintext size); False when it does not authenticate.

        On a tag that does not check, ``dst`` is zeroed; on a blob of another size or under a
        master key not held, it is left as it was (the caller zeroes it: ``SealedTier``).
        """
        if len(blob) != sealed_size(len(dst)):
            return False
        view = memoryview(blob)
        kid = bytes(view[:KEY_ID])
        c = self._cipher(kid, tenant_id)
        if c is None:
            return False  # sealed under a master key this node does not hold (dropped, or another pool's)
        nonce = bytes(view[KEY_ID:KEY_ID + NONCE])
        aad = associated_data(tenant_id, key, kind, generation, len(dst), kid, nonce)
        body = KEY_ID + NONCE
        try:
            if self._into:
                c.decrypt_into(nonce, view[body:], aad, dst)
            else:
                dst[:] = c.decrypt(nonce, bytes(view[body:]), aad)
        except self._invalid_tag:
            # decrypt_into may have written the keystream-decrypted bytes before the tag check:
            # under the right key but bound to another object, those are real plaintext.
            dst[:] = bytes(len(dst))
            return False
        return True
