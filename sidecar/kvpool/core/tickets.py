"""Data-session tickets: what authenticates a plaintext data connection (the trusted-network opt-out).

A pool whose data session is not encrypted (``--plaintext-data-session`` on the store nodes, the
KVPool's ``spec.security.dataSession: Plaintext``) still never lets a tenant token cross the wire
in the clear: a client asks the node for a ticket over the TLS control channel (gRPC
``StoreData/DataTicket``, its bearer token checked there), and presents it as the first frame of
one new data connection.  The node binds that connection to the ticket's tenant; the frames after
it carry no token.

A ticket is ``nonce (16) | expires_unix_ms (u64) | tenant length (u16) | tenant | tag (16)``, the
tag an HMAC-SHA256 under a secret that never leaves the node (random per process life, so a
restart voids every ticket).  It is short-lived (:data:`TICKET_TTL_MS`) and single-use: the node
remembers the nonces it admitted until they expire, so a ticket read off the wire opens nothing.
Bytes on such a connection can still be read and, by an attacker on the path, altered or
injected: that is the opt-out's price, for networks where nobody untrusted is on the path.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
import threading

TICKET_TTL_MS = 30_000
"""How long a ticket may wait before its connection presents it."""
_HEAD = struct.Struct("<16sQH")
_TAG = 16
MAX_TICKET_BYTES = _HEAD.size + 1024 + _TAG


def encode(secret: bytes, tenant: str, expires_unix_ms: int, nonce: bytes) -> bytes:
    body = _HEAD.pack(nonce, expires_unix_ms, len(tenant.encode())) + tenant.encode()
    return body + hmac.new(secret, body, hashlib.sha256).digest()[:_TAG]


def decode(secret: bytes, ticket: bytes, now_unix_ms: int) -> tuple[str, bytes, int] | str:
    """(tenant, nonce, expiry) of a genuine, unexpired ticket; else why not (a string)."""
    if not _HEAD.size + _TAG <= len(ticket) <= MAX_TICKET_BYTES:
        return "not a ticket"
    body, tag = ticket[:-_TAG], ticket[-_TAG:]
    if not hmac.compare_digest(tag, hmac.new(secret, body, hashlib.sha256).digest()[:_TAG]):
        return "ticket not issued by this node (or by an earlier life of it)"
    nonce, expires, n = _HEAD.unpack_from(body)
    if len(body) != _HEAD.size + n:
        return "not a ticket"
    if now_unix_ms >= expires:
        return "ticket expired"
    try:
        return body[_HEAD.size:].decode(), nonce, expires
    except UnicodeDecodeError:
        return "not a ticket"


class TicketBook:
    """A node's tickets: issues them, admits each once before it expires.  Thread-safe."""

    def __init__(self, ttl_ms: int = TICKET_TTL_MS, secret: bytes | None = None) -> None:
        self.ttl_ms = ttl_ms
        self._secret = secret or secrets.token_bytes(32)
        self._used: dict[bytes, int] = {}  # nonce -> expiry
        self._lock = threading.Lock()

    def issue(self, tenant: str, now_unix_ms: int) -> tuple[bytes, int]:
        """A fresh ticket of ``tenant`` and its expiry (unix ms)."""
        expires = now_unix_ms + self.ttl_ms
        return encode(self._secret, tenant, expires, secrets.token_bytes(16)), expires

    def admit(self, ticket: bytes, now_unix_ms: int) -> str | None:
        """The tenant of a genuine ticket presented for the first time, None otherwise (a forged,
        expired or replayed one)."""
        got = decode(self._secret, ticket, now_unix_ms)
        if isinstance(got, str):
            return None
        tenant, nonce, expires = got
        with self._lock:
            if len(self._used) > 4096:  # forget the expired ones now and then, not per call
                self._used = {k: e for k, e in self._used.items() if e > now_unix_ms}
            if nonce in self._used:
                return None
            self._used[nonce] = expires
        return tenant
