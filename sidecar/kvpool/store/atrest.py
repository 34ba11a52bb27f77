"""Encryption at rest of the tiers below DRAM (SSD slots, shared-filesystem files), per tenant.

Pure (no files, no sockets): the store node hands sealed bytes to its tiers and opens what they
read back.  Keys and format:

- tenant key = HKDF-SHA256(master key, salt ``kvpool at-rest v1``, info ``kvpool tenant key\\0`` ‖
  tenant id), 32 bytes: AES-256-GCM.  Derived on first use and kept in this process only; the
  master key comes from a file (a mounted Secret) and never leaves the store node.
- sealed object = nonce (12 random bytes) ‖ ciphertext ‖ tag (16 bytes), :data:`OVERHEAD` = 28.
- associated data = format tag ‖ tenant id ‖ kind ‖ object key ‖ generation ‖ plaintext size ‖
  nonce.  A blob sealed for another tenant (another key), another object key or kind, another
  generation or size — or tampered, or truncated — fails authentication; the node counts it and
  treats the object as a miss.

Random 96-bit nonces: NIST SP 800-38D bounds one key to 2^32 seals; a tenant key seals one blob
per demotion, so a node would need 2^32 demotions of one tenant before that bound matters.
"""

from __future__ import annotations

import os
import struct
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

NONCE = 12
TAG = 16
OVERHEAD = NONCE + TAG
MASTER_KEY_MIN_BYTES = 32
HKDF_SALT = b"kvpool at-rest v1"
HKDF_INFO = b"kvpool tenant key\0"
AAD_TAG = b"kvpool-at-rest/1\0"
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


def load_master_key(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise MasterKeyError(f"cannot read the master key file {path}: {exc.strerror}") from None
    return parse_master_key(raw)


def derive_tenant_key(master: bytes, tenant_id: str) -> bytes:
    """The tenant's AES-256 key (deterministic: every node of a pool derives the same one)."""
    _, hashes, _, hkdf = _crypto()
    kdf = hkdf.HKDF(algorithm=hashes.SHA256(), length=32, salt=HKDF_SALT, info=HKDF_INFO + tenant_id.encode())
    return bytes(kdf.derive(master))


def associated_data(tenant_id: str, key: bytes, kind: int, generation: int, size: int, nonce: bytes) -> bytes:
    t = tenant_id.encode()
    return b"".join((AAD_TAG, len(t).to_bytes(2, "little"), t, len(key).to_bytes(1, "little"), key,
                     _AAD_TAIL.pack(kind, generation, size), nonce))


def sealed_size(size: int) -> int:
    return size + OVERHEAD


class AtRest:
    """Seals and opens objects of every tenant under keys derived from one master key.

    Thread safety: AESGCM objects are safe to share between threads; the key cache is filled
    under the caller's lock or races benignly (two derivations of the same key).  :meth:`scratch`
    is one buffer: its users serialise (the store node's lock).
    """

    def __init__(self, master_key: bytes) -> None:
        if len(master_key) < MASTER_KEY_MIN_BYTES:
            raise MasterKeyError(f"the master key must hold at least {MASTER_KEY_MIN_BYTES} bytes")
        exceptions, _, aead, _ = _crypto()
        self._aesgcm = aead.AESGCM
        self._invalid_tag = exceptions.InvalidTag
        self._into = hasattr(aead.AESGCM, "encrypt_into")  # cryptography >= 45: no intermediate copy
        self._master = master_key
        self._ciphers: dict[str, AESGCM] = {}
        self._scratch = bytearray()

    def __repr__(self) -> str:  # never the key, not even in a traceback
        return f"AtRest(tenants={len(self._ciphers)})"

    def _cipher(self, tenant_id: str) -> AESGCM:
        c = self._ciphers.get(tenant_id)
        if c is None:
            c = self._ciphers[tenant_id] = self._aesgcm(derive_tenant_key(self._master, tenant_id))
        return c

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
        out[:NONCE] = nonce
        aad = associated_data(tenant_id, key, kind, generation, len(src), nonce)
        c = self._cipher(tenant_id)
        if self._into:
            c.encrypt_into(nonce, src, aad, out[NONCE:])
        else:  # cryptography < 45: one more copy
            out[NONCE:] = c.encrypt(nonce, bytes(src), aad)
        return out

    def open_into(self, tenant_id: str, key: bytes, kind: int, generation: int,
                  blob: memoryview | bytes | bytearray, dst: memoryview) -> bool:
        """Decrypt ``blob`` into ``dst`` (the plaintext size); False when it does not authenticate.

        On False, ``dst`` is zeroed (the caller frees it and reports a miss).
        """
        if len(blob) != sealed_size(len(dst)):
            return False
        view = memoryview(blob)
        nonce = bytes(view[:NONCE])
        aad = associated_data(tenant_id, key, kind, generation, len(dst), nonce)
        c = self._cipher(tenant_id)
        try:
            if self._into:
                c.decrypt_into(nonce, view[NONCE:], aad, dst)
            else:
                dst[:] = c.decrypt(nonce, bytes(view[NONCE:]), aad)
        except self._invalid_tag:
            # decrypt_into may have written the keystream-decrypted bytes before the tag check:
            # under the right key but bound to another object, those are real plaintext.
            dst[:] = bytes(len(dst))
            return False
        return True
