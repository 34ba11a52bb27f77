"""Encryption at rest with real store nodes: SSD and shared-filesystem tiers, tampering, foreign
tenants' files and restarts with another master key."""

from __future__ import annotations

import hashlib
import hmac
import os
import random
import shutil
from pathlib import Path
from typing import Any

from kvpool.wire.counters import StoreCounter
from kvpool.wire.proto import store_pb2 as pb

KiB = 1 << 10
T1 = {"tenantId": "t1", "token": "tok-1", "salt": "c2FsdC0x"}  # salt-1
T2 = {"tenantId": "t2", "token": "tok-2", "salt": "c2FsdC0y"}  # salt-2


def _key_file(tmp: Path, name: str) -> Path:
    p = tmp / name
    p.write_text(os.urandom(32).hex() + "\n")
    return p


def _read_all(c: Any, keys: list[bytes], batch: int = 4) -> list[bytes | None]:
    out: list[bytes | None] = []
    for i in range(0, len(keys), batch):
        out += [bytes(g) if g is not None else None for g in c.get(keys[i:i + batch])]
    return out


def _put_all(c: Any, keys: list[bytes], vals: list[bytes], batch: int = 4) -> None:
    for i in range(0, len(keys), batch):
        assert c.put(keys[i:i + batch], vals[i:i + batch]) == [pb.OK] * len(keys[i:i + batch])


def _leaks(blobs: list[bytes], vals: list[bytes]) -> int:
    """How many values have a 48-byte window (taken from their middle) in any of the files."""
    return sum(any(v[len(v) // 2:len(v) // 2 + 48] in b for b in blobs) for v in vals)


def _files(d: Path) -> list[Path]:
    return [p for p in d.rglob("*") if p.is_file() and not p.name.startswith(".tmp")]


def _fs_path(root: Path, tenant: dict[str, str], key: bytes) -> Path:
    """The documented file name of a shared-fs object: HMAC-SHA256 keyed by the tenant's salt."""
    import base64
    salt = b"kvpool-tenant\0" + tenant["tenantId"].encode() + b"\0" + base64.b64decode(tenant["salt"])
    name = hmac.new(salt, key, hashlib.sha256).hexdigest()
    return root / name[:2] / name


def test_ssd_tier_encrypted_byte_exact_and_no_plaintext_on_disk(stores: Any, h: Any, rng: random.Random,
                                                                tmp_path: Path) -> None:
    key = _key_file(tmp_path, "master")
    nodes = stores.start_many({
        "enc": {"dram": "2MiB", "ssd": "64MiB", "ssd_path": tmp_path / "ssd-enc",
                "extra": ["--master-key-file", str(key)]},
        "plain": {"dram": "2MiB", "ssd": "64MiB", "ssd_path": tmp_path / "ssd-plain"}})
    sizes = [rng.choice([100, 4 * KiB, 100 * KiB, 256 * KiB, rng.randint(100, 300 * KiB)]) for _ in range(50)]
    keys = h.rand_keys(rng, len(sizes))
    vals = h.rand_values(rng, sizes)
    for name in ("enc", "plain"):
        c = nodes[name].client()
        _put_all(c, keys, vals, batch=5)
        st = c.stats()
        assert st.counters[StoreCounter.DEMOTED] > 10
        # What the SSD holds now (before reads promote anything back).
        slots = (tmp_path / f"ssd-{name}" / f"kvpool-{name}.slots").read_bytes()
        if name == "plain":
            # The scan finds plaintext where there is some (so its silence below means something).
            assert _leaks([slots], vals) > 10
            assert st.counters.get(StoreCounter.SEALED, 0) == 0
        else:
            assert _leaks([slots], vals) == 0
            assert st.counters[StoreCounter.SEALED] == st.counters[StoreCounter.DEMOTED]
        assert _read_all(c, keys) == vals
        order = list(range(len(keys)))
        rng.shuffle(order)
        assert _read_all(c, [keys[i] for i in order], batch=3) == [vals[i] for i in order]
        st = c.stats()
        assert st.counters[StoreCounter.PROMOTED] > 10
        assert st.counters.get(StoreCounter.AT_REST_AUTH_FAILURES, 0) == 0
        assert st.counters.get(StoreCounter.CHECKSUM_FAILURES, 0) == 0


def test_tampered_ssd_slots_are_counted_misses(stores: Any, h: Any, rng: random.Random, tmp_path: Path) -> None:
    key = _key_file(tmp_path, "master")
    node = stores.start("1MiB", ssd="16MiB", ssd_path=tmp_path / "ssd", node_id="tamper",
                        extra=["--master-key-file", str(key)])
    c = node.client()
    keys = h.rand_keys(rng, 30)
    vals = h.rand_values(rng, [60 * KiB] * 30)
    _put_all(c, keys, vals)
    st = c.stats()
    on_ssd = h.stats_tier(st, "ssd").objects
    assert on_ssd > 10
    # Flip one byte in every 4 KiB page of the slot file: every sealed extent is hit.
    path = tmp_path / "ssd" / "kvpool-tamper.slots"
    with open(path, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        for off in range(100, size, 4096):
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0x5A]))
    got = _read_all(c, keys, batch=2)
    assert all(g is None or g == v for g, v in zip(got, vals, strict=True)), "never wrong bytes"
    assert got.count(None) == on_ssd
    st = c.stats()
    assert st.counters[StoreCounter.AT_REST_AUTH_FAILURES] == on_ssd
    assert h.stats_tenant(st, "default").counters[StoreCounter.AT_REST_AUTH_FAILURES] == on_ssd
    assert st.counters.get(StoreCounter.CHECKSUM_FAILURES, 0) == 0  # the tag caught them before the checksum
    # Forgotten: asking again is a plain miss (no second failure), and the engine saw no error.
    assert c.exists(keys, prefix_only=False).present.count(True) == 30 - on_ssd
    assert c.stats().counters[StoreCounter.AT_REST_AUTH_FAILURES] == on_ssd


def test_sharedfs_foreign_tenant_and_tampered_files_are_counted_misses(stores: Any, h: Any, rng: random.Random,
                                                                        tmp_path: Path) -> None:
    fs = tmp_path / "sharedfs"
    key = _key_file(tmp_path, "master")
    enc = ["--master-key-file", str(key)]
    writer = stores.start("1MiB", sharedfs=fs, tenants=[T1, T2], node_id="writer", extra=enc)
    keys = h.rand_keys(rng, 24)
    v1 = h.rand_values(rng, [128 * KiB] * 24)
    v2 = h.rand_values(rng, [128 * KiB] * 24)  # the same keys, other bytes, other tenant
    c1, c2 = writer.client("tok-1"), writer.client("tok-2")
    _put_all(c1, keys, v1)
    _put_all(c2, keys, v2)
    assert c1.stats().counters[StoreCounter.SEALED] > 20
    blobs = [p.read_bytes() for p in _files(fs)]
    assert len(blobs) > 20 and _leaks(blobs, v1 + v2) == 0
    assert _read_all(c1, keys) == v1 and _read_all(c2, keys) == v2
    both = [i for i, k in enumerate(keys) if _fs_path(fs, T1, k).exists() and _fs_path(fs, T2, k).exists()]
    assert len(both) >= 9
    swapped, flipped, truncated = both[0::3], both[1::3], both[2::3]
    for i in swapped:  # tenant 2's file under tenant 1's name: same key, another tenant key
        shutil.copyfile(_fs_path(fs, T2, keys[i]), _fs_path(fs, T1, keys[i]))
    for i in flipped:
        p = _fs_path(fs, T1, keys[i])
        raw = bytearray(p.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        p.write_bytes(bytes(raw))
    for i in truncated:
        p = _fs_path(fs, T1, keys[i])
        p.write_bytes(p.read_bytes()[:-100])
    # A node that has never seen these keys adopts the files and must refuse the damaged ones.
    reader = stores.start("4MiB", sharedfs=fs, tenants=[T1, T2], node_id="reader", extra=enc)
    r1, r2 = reader.client("tok-1"), reader.client("tok-2")
    damaged = set(swapped) | set(flipped) | set(truncated)
    got = _read_all(r1, [keys[i] for i in both], batch=3)
    assert got == [None if i in damaged else v1[i] for i in both]
    # A truncated file is not even found (``Tier.locate`` checks its length against its header):
    # a plain miss.  The others look whole and are refused by their tag.
    opened = set(swapped) | set(flipped)
    st = r1.stats()
    assert h.stats_tenant(st, "t1").counters[StoreCounter.AT_REST_AUTH_FAILURES] == len(opened)
    # Tenant 2's own files, including the ones copied away, still open for tenant 2.
    assert _read_all(r2, [keys[i] for i in both], batch=3) == [v2[i] for i in both]
    st = reader.client().stats()
    assert st.counters[StoreCounter.AT_REST_AUTH_FAILURES] == len(opened)
    assert st.counters.get(StoreCounter.CHECKSUM_FAILURES, 0) == 0


def test_restart_with_another_master_key_serves_nothing(stores: Any, h: Any, rng: random.Random,
                                                        tmp_path: Path) -> None:
    fs = tmp_path / "sharedfs"
    right, wrong = _key_file(tmp_path, "right"), _key_file(tmp_path, "wrong")
    node = stores.start("1MiB", sharedfs=fs, node_id="store-k", extra=["--master-key-file", str(right)])
    c = node.client()
    keys = h.rand_keys(rng, 24)
    vals = h.rand_values(rng, [128 * KiB] * 24)
    _put_all(c, keys, vals)
    assert c.stats().counters[StoreCounter.DEMOTED] > 10
    node.kill()
    on_fs = len(_files(fs))
    assert on_fs > 10
    # The same key after a crash: the shared tier's objects are served, byte-exact.
    node = stores.start("4MiB", sharedfs=fs, node_id="store-k", extra=["--master-key-file", str(right)])
    c = node.client()
    got = _read_all(c, keys)
    assert sum(g is not None for g in got) == on_fs
    assert all(g is None or g == v for g, v in zip(got, vals, strict=True))
    node.kill()
    # No key at all: sealed files are not even matched.
    node = stores.start("4MiB", sharedfs=fs, node_id="store-k")
    c = node.client()
    assert c.exists(keys, prefix_only=False).present == [False] * 24
    assert _read_all(c, keys) == [None] * 24
    node.kill()
    # Another key: every file fails authentication, is counted, and none is served.
    node = stores.start("4MiB", sharedfs=fs, node_id="store-k", extra=["--master-key-file", str(wrong)])
    c = node.client()
    assert _read_all(c, keys) == [None] * 24
    assert c.stats().counters[StoreCounter.AT_REST_AUTH_FAILURES] == on_fs
    assert c.exists(keys, prefix_only=False).present == [False] * 24


def test_plaintext_files_are_not_trusted_by_an_encrypting_node(stores: Any, h: Any, rng: random.Random,
                                                               tmp_path: Path) -> None:
    fs = tmp_path / "sharedfs"
    plain = stores.start("1MiB", sharedfs=fs, node_id="plain")
    keys = h.rand_keys(rng, 16)
    vals = h.rand_values(rng, [128 * KiB] * 16)
    _put_all(plain.client(), keys, vals)
    assert len(_files(fs)) > 5
    enc = stores.start("4MiB", sharedfs=fs, node_id="enc", extra=["--master-key-file", str(_key_file(tmp_path, "k"))])
    c = enc.client()
    assert c.exists(keys, prefix_only=False).present == [False] * 16
    assert _read_all(c, keys) == [None] * 16


def test_bad_master_key_file_fails_at_start(stores: Any, tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_text("too short\n")
    for path in (short, tmp_path / "missing"):
        try:
            stores.start("1MiB", extra=["--master-key-file", str(path)])
        except RuntimeError as exc:
            assert "master" in str(exc) and "Traceback" not in str(exc)
        else:
            raise AssertionError(f"a node started with master key file {path}")


def _swap(path: Path, text: str) -> None:
    """Replace a file in one step, as the kubelet updates a mounted Secret (write, then rename)."""
    tmp = path.with_name(f".{path.name}.new")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_key_rotation_on_a_running_node(stores: Any, h: Any, rng: random.Random, tmp_path: Path) -> None:
    """A rotated Secret reaches the running node: what the old key sealed stays readable while the
    old key is listed as previous, new seals use the new key, a broken key file changes nothing,
    and once the old key is gone its objects are counted misses — never wrong bytes."""
    fs = tmp_path / "sharedfs"
    old, new = os.urandom(32).hex(), os.urandom(32).hex()
    key, previous = tmp_path / "key", tmp_path / "previous"  # no previous file yet: nothing rotated
    key.write_text(old + "\n")
    enc = ["--master-key-file", str(key), "--previous-master-keys-file", str(previous)]
    fast = {"masterKeyReloadSeconds": 0.1}
    node = stores.start("1MiB", sharedfs=fs, node_id="store-r", extra=enc, config=fast)
    c = node.client()
    k_old = h.rand_keys(rng, 24)
    v_old = h.rand_values(rng, [128 * KiB] * 24)
    _put_all(c, k_old, v_old)
    assert c.stats().counters[StoreCounter.DEMOTED] > 10

    _swap(previous, old + "\n")
    _swap(key, new + "\n")
    h.wait_for(lambda: c.stats().counters.get(StoreCounter.MASTER_KEY_RELOADS, 0) >= 1, 10, what="the key reload")
    got = _read_all(c, k_old)
    assert got == v_old
    st = c.stats()
    assert st.counters[StoreCounter.AT_REST_PREVIOUS_KEY_OPENS] > 10
    assert st.counters.get(StoreCounter.AT_REST_AUTH_FAILURES, 0) == 0

    k_new = h.rand_keys(rng, 24)
    v_new = h.rand_values(rng, [128 * KiB] * 24)
    _put_all(c, k_new, v_new)
    # A key file that cannot be used (too short) is refused once; the node keeps its keys.
    reloads = c.stats().counters[StoreCounter.MASTER_KEY_RELOADS]
    _swap(key, "too short\n")
    h.wait_for(lambda: c.stats().counters.get(StoreCounter.MASTER_KEY_RELOAD_ERRORS, 0) == 1, 10,
               what="the refused reload")
    assert c.stats().counters[StoreCounter.MASTER_KEY_RELOADS] == reloads
    assert _read_all(c, k_new) == v_new
    node.kill()

    # The old key retired: the new objects on the shared tier are served, the old ones are
    # counted authentication failures and misses.
    _swap(key, new + "\n")
    previous.unlink()
    node = stores.start("4MiB", sharedfs=fs, node_id="store-r", extra=enc, config=fast)
    c = node.client()
    got_new = _read_all(c, k_new)
    assert sum(g is not None for g in got_new) > 10
    assert all(g is None or g == v for g, v in zip(got_new, v_new, strict=True))
    assert c.stats().counters.get(StoreCounter.AT_REST_PREVIOUS_KEY_OPENS, 0) == 0
    # Old objects re-demoted after the rotation were sealed again under the new key (served);
    # the rest are still under the retired one.
    got_old = _read_all(c, k_old)
    lost = sum(g is None for g in got_old)
    assert all(g is None or g == v for g, v in zip(got_old, v_old, strict=True))
    assert lost > 5, got_old.count(None)
    assert c.stats().counters[StoreCounter.AT_REST_AUTH_FAILURES] == lost
