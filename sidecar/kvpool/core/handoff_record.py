"""Prefill → decode handoff records and the decode side's plan: the pure part (no I/O).

A prefill instance's sidecar publishes a finished prefill's blocks to the pool, keeps its state
object (single copy, host memory) exportable for a bounded time, and returns a
:class:`HandoffRecord`; the engines carry it over their own channel (bytes or JSON) and the
decode instance's sidecar takes the blocks from the pool and the state point to point from the
prefill sidecar (:mod:`kvpool.sidecar.handoff`).

A record is versioned and signed: an HMAC-SHA256 tag over its canonical binary encoding, keyed
by :func:`handoff_key` (the tenant's secret, known to every sidecar of that tenant and to no
engine), so a forged or altered record is refused with ``HANDOFF_INVALID``, another tenant's with
``WRONG_TENANT``, and one past its ``expires_unix_ms`` with ``HANDOFF_EXPIRED``.  The state
export has its own, shorter, deadline (``state_expires_unix_ms``): past it the decode side does
not ask the prefill sidecar and takes the bounded replay of the hit rule instead.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import hmac
import json
import struct
from dataclasses import dataclass, field, replace

from kvpool.core.errors import Code, HandoffInvalid
from kvpool.core.keys import KEY_BYTES
from kvpool.core.planning import HitPlan, plan_hit

VERSION = 1
MAGIC = b"KVHO"
TAG_BYTES = 32
FLAG_STATE = 1
"""The record names a state object (``state_key`` at ``state_position``)."""
FLAG_PEER = 2
"""The prefill sidecar exports the state point to point (``peer``, ``export_id``, ``state_offset``)."""

# magic, version, flags, reserved, prompt, block, n_keys, state position, state size,
# state checksum, state offset, export id, created, expires, state expires
_HEAD = struct.Struct("<4sBBHIIIIQQQQQQQ")
_STR = struct.Struct("<H")
MAX_KEYS = 1 << 20
MAX_STR = 1024

__all__ = ["HandoffInvalid", "HandoffRecord", "StateOutcome", "check", "from_bytes", "from_json", "handoff_key",
           "parse", "plan_handoff", "sign", "state_sources", "validate"]


class StateOutcome(enum.IntEnum):
    """Where the decode side's state object came from (values = ``kvpool.v1.HandoffState``)."""

    NONE = 0
    """The record names no state object (prompt of at most one block, or no window state)."""
    PEER = 1
    """Fetched point to point from the prefill sidecar."""
    POOL = 2
    """Read from the pool (the prefill sidecar handed it over on eviction or drain)."""
    LOCAL = 3
    """Already in this sidecar's local tier."""
    EXPIRED = 4
    """The export's hold had ended: not asked for; the plan replays the last block."""
    GONE = 5
    """Asked for but not had (the prefill sidecar gone, restarted, refusing, or the bytes failed
    their checksum; not in the pool either): the plan replays the last block."""


@dataclass(frozen=True)
class HandoffRecord:
    """What the decode side needs, small enough for the engines' own channel (32 B a block)."""

    tenant: str
    prompt_tokens: int
    block_tokens: int
    keys: tuple[bytes, ...]
    """Keys of the prompt's full blocks, in order (all published to the pool)."""
    created_unix_ms: int
    expires_unix_ms: int
    """After this the record is refused (``HANDOFF_EXPIRED``)."""
    state_position: int = 0
    """Attach position of the state object (a multiple of the block size), 0: none."""
    state_size: int = 0
    state_checksum: int = 0
    peer: str = ""
    """``host:port`` of the prefill sidecar's transfer port, "" when it exports nothing."""
    segment: str = ""
    state_offset: int = 0
    export_id: int = 0
    """The export's token at the prefill sidecar (its transfer guard admits only this read)."""
    state_expires_unix_ms: int = 0
    instance: str = ""
    """The prefill sidecar's instance id (a restarted sidecar has another)."""
    flags: int = 0
    version: int = VERSION
    tag: bytes = field(default=b"", compare=False)

    @property
    def has_state(self) -> bool:
        return bool(self.flags & FLAG_STATE) and self.state_position > 0

    @property
    def has_peer(self) -> bool:
        return bool(self.flags & FLAG_PEER) and bool(self.peer) and self.export_id != 0

    @property
    def state_key(self) -> bytes | None:
        """The block key at the state's attach position (what the state object is keyed by)."""
        if not self.has_state:
            return None
        return self.keys[self.state_position // self.block_tokens - 1]

    # -- encoding -----------------------------------------------------------------------------

    def body(self) -> bytes:
        """The canonical binary encoding without the tag (what the tag signs)."""
        head = _HEAD.pack(MAGIC, self.version, self.flags, 0, self.prompt_tokens, self.block_tokens, len(self.keys),
                          self.state_position, self.state_size, self.state_checksum, self.state_offset,
                          self.export_id, self.created_unix_ms, self.expires_unix_ms, self.state_expires_unix_ms)
        parts = [head]
        for s in (self.tenant, self.peer, self.segment, self.instance):
            b = s.encode()
            parts += [_STR.pack(len(b)), b]
        parts.append(b"".join(self.keys))
        return b"".join(parts)

    def to_bytes(self) -> bytes:
        if len(self.tag) != TAG_BYTES:
            raise HandoffInvalid("record is not signed")
        return self.body() + self.tag

    def to_json(self) -> str:
        """JSON for channels that carry text; :func:`from_json` reads it back (the same tag)."""
        return json.dumps({"kvpoolHandoff": self.version, "record": base64.b64encode(self.to_bytes()).decode()})

    def signed(self, key: bytes) -> HandoffRecord:
        return replace(self, tag=sign(key, self.body()))


def sign(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest()


def handoff_key(secret: bytes, tenant: str) -> bytes:
    """The tag key of ``tenant``'s records, from a secret every sidecar of the tenant holds (the
    tenant token or a mounted handoff key); bound to the tenant id so keys never cross tenants."""
    return hmac.new(secret, b"kvpool-handoff-v1\x00" + tenant.encode(), hashlib.sha256).digest()


def from_bytes(blob: bytes | bytearray | memoryview) -> HandoffRecord:
    """Decode a record (not yet verified: see :func:`check`); :class:`HandoffInvalid` if malformed."""
    data = bytes(blob)
    if len(data) < _HEAD.size + TAG_BYTES:
        raise HandoffInvalid(f"record of {len(data)} bytes is too short")
    (magic, version, flags, reserved, prompt, block, n_keys, spos, ssize, ssum, soff, export_id, created, expires,
     sexpires) = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise HandoffInvalid("not a kvpool handoff record (bad magic)")
    if version != VERSION:
        raise HandoffInvalid(f"handoff record version {version} is not supported (this side reads {VERSION})")
    if reserved:
        raise HandoffInvalid("record has reserved bits set")  # the tag signs the canonical form only
    pos = _HEAD.size
    strs: list[str] = []
    for _ in range(4):
        if pos + _STR.size > len(data):
            raise HandoffInvalid("record truncated in its strings")
        (n,) = _STR.unpack_from(data, pos)
        pos += _STR.size
        if n > MAX_STR or pos + n > len(data):
            raise HandoffInvalid("record string too long or truncated")
        try:
            strs.append(data[pos:pos + n].decode())
        except UnicodeDecodeError:
            raise HandoffInvalid("record string is not UTF-8") from None
        pos += n
    if n_keys > MAX_KEYS or pos + n_keys * KEY_BYTES + TAG_BYTES != len(data):
        raise HandoffInvalid(f"record length does not match its {n_keys} keys")
    keys = tuple(data[pos + i * KEY_BYTES:pos + (i + 1) * KEY_BYTES] for i in range(n_keys))
    pos += n_keys * KEY_BYTES
    rec = HandoffRecord(tenant=strs[0], prompt_tokens=prompt, block_tokens=block, keys=keys,
                        created_unix_ms=created, expires_unix_ms=expires, state_position=spos, state_size=ssize,
                        state_checksum=ssum, peer=strs[1], segment=strs[2], state_offset=soff, export_id=export_id,
                        state_expires_unix_ms=sexpires, instance=strs[3], flags=flags, version=version,
                        tag=data[pos:pos + TAG_BYTES])
    validate(rec)
    return rec


def from_json(text: str) -> HandoffRecord:
    try:
        doc = json.loads(text)
        blob = base64.b64decode(doc["record"], validate=True)
    except (ValueError, KeyError, TypeError):
        raise HandoffInvalid("not a kvpool handoff record (JSON)") from None
    if doc.get("kvpoolHandoff") != VERSION:
        raise HandoffInvalid(f"handoff record version {doc.get('kvpoolHandoff')!r} is not supported")
    return from_bytes(blob)


def parse(record: HandoffRecord | bytes | bytearray | memoryview | str) -> HandoffRecord:
    """A record from any of its forms (the object, its bytes, its JSON)."""
    if isinstance(record, HandoffRecord):
        return record
    if isinstance(record, str):
        return from_json(record)
    return from_bytes(record)


def validate(rec: HandoffRecord) -> None:
    """Field consistency a decoder can check without the key."""
    b = rec.block_tokens
    if b <= 0:
        raise HandoffInvalid("block size must be positive")
    if len(rec.keys) * b > rec.prompt_tokens:
        raise HandoffInvalid(f"{len(rec.keys)} blocks of {b} tokens exceed the prompt of {rec.prompt_tokens}")
    if any(len(k) != KEY_BYTES for k in rec.keys):
        raise HandoffInvalid(f"keys must be {KEY_BYTES} bytes")
    if rec.flags & FLAG_STATE:
        p = rec.state_position
        if p <= 0 or p % b or p // b > len(rec.keys):
            raise HandoffInvalid(f"state position {p} is not a block boundary within the record's blocks")
    if rec.flags & ~(FLAG_STATE | FLAG_PEER):
        raise HandoffInvalid(f"unknown record flags {rec.flags:#x}")


def check(rec: HandoffRecord, key: bytes, tenant: str, now_unix_ms: int) -> tuple[Code, str]:
    """Whether the decode side (of ``tenant``, holding ``key``) may act on ``rec``: (code, why).

    The tenant first (a clearer answer than the tag, which another tenant's key fails anyway),
    then the tag (constant time), then the record's own expiry."""
    if rec.tenant != tenant:
        return Code.WRONG_TENANT, f"record of tenant {rec.tenant!r} presented to a sidecar of tenant {tenant!r}"
    if len(rec.tag) != TAG_BYTES or not hmac.compare_digest(sign(key, rec.body()), rec.tag):
        return Code.HANDOFF_INVALID, "record tag does not verify (altered, forged, or signed with another key)"
    if now_unix_ms >= rec.expires_unix_ms:
        return Code.HANDOFF_EXPIRED, f"record expired {now_unix_ms - rec.expires_unix_ms} ms ago"
    return Code.OK, ""


def state_sources(rec: HandoffRecord, now_unix_ms: int, own_instance: str) -> tuple[list[str], StateOutcome]:
    """Where the decode side looks for the state, in order, and the outcome if none has it.

    Its own local tier first (cheap, and the same sidecar may be both sides), then the prefill
    sidecar while the export holds (never itself), then the pool (a prefill sidecar that was
    stopped hands its state objects over on drain)."""
    if not rec.has_state:
        return [], StateOutcome.NONE
    out = ["local"]
    expired = rec.has_peer and now_unix_ms >= rec.state_expires_unix_ms
    if rec.has_peer and not expired and rec.instance != own_instance:
        out.append("peer")
    out.append("pool")
    return out, StateOutcome.EXPIRED if expired else StateOutcome.GONE


def plan_handoff(rec: HandoffRecord, local_blocks: int, state_ok: bool, window_tokens: int = 128,
                 rollback_tokens: int = 6) -> HitPlan:
    """The decode side's plan after the fetch: ``local_blocks`` leading blocks of the record are
    local, and the state object is (``state_ok``) or is not there.

    With the state and every block up to its attach position p, the sequence continues from p
    (the prefill's own state: p = floor((L − 1) / B) × B, so 1..B tokens are computed). Otherwise
    it is the hit rule of DESIGN §5 over the local prefix with no state: the bounded replay of
    the last block (:func:`~kvpool.core.planning.plan_hit`).
    """
    b = rec.block_tokens
    local_blocks = max(0, min(local_blocks, len(rec.keys)))
    p = rec.state_position if rec.has_state else 0
    if state_ok and p and local_blocks * b >= p:
        return HitPlan(prompt_tokens=rec.prompt_tokens, hit_tokens=p, state_position=p,
                       compute_tokens=rec.prompt_tokens - p, cap_tokens=p, block_hit_tokens=p, block_tokens=b)
    return plan_hit(rec.prompt_tokens, local_blocks * b, (), b, window_tokens, rollback_tokens)
