"""The handoff under certificates shaped as the operator issues them in Kubernetes.

There no certificate names the address a peer dials: the store nodes' certificate names the
pool's Service (clients check it with ``--tls-server-name``), a tenant's names only
``spiffe://kvpool/tenant/<id>``.  The decode sidecar dials the prefill sidecar's pod IP with the
configuration it uses for the store nodes, so it must check that server by its identity (its own
tenant's), not by a name: the handoff works, and a store node's certificate (which *does* carry
the server name) or another tenant's, posing as the prefill sidecar, is refused.

Sidecar 0 is the prefill side, 1 the decode side (tenant acme), 2 another tenant.
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Iterator
from typing import Any

import pytest

from kvpool.apps.cluster import KUBE_POOL, KUBE_SERVER_NAME, LocalCluster
from kvpool.core import handoff_record as ho
from kvpool.core import pki
from kvpool.core.handoff_record import StateOutcome
from kvpool.core.keys import KeySpace
from kvpool.transfer import Segment, SegmentRegistry, TransferCode, TransferEngine, TransferRequest, TransferServer
from kvpool.wire import tls as wtls
from kvpool.wire.proto import store_pb2 as pb

KiB, MiB = 1 << 10, 1 << 20
B = 128
CLUSTER = dict(stores=2, sidecars=3, store_bytes=64 * MiB, local_bytes=16 * MiB, tenants=["acme", "acme", "globex"],
               kube_certs=True)


@pytest.fixture
def lc(module_cluster: LocalCluster) -> LocalCluster:
    return module_cluster


def _prefill(client: Any, rng: random.Random) -> tuple[list[bytes], bytes, int]:
    """Blocks and a state object put through sidecar ``client``: (keys, state, prompt length)."""
    ks = KeySpace(model=f"kube-certs-{rng.random()}", block_tokens=B)
    prompt = 4 * B + 17
    keys = ks.block_keys([rng.randrange(50000) for _ in range(prompt)])
    state = rng.randbytes(200_000)
    assert client.put(keys, [rng.randbytes(32 * KiB) for _ in keys]) == [pb.OK] * len(keys)
    assert client.put_state(keys[-1], len(keys) * B, state) == pb.OK
    return keys, state, prompt


def _names(cfg: wtls.TlsConfig) -> tuple[pki.Identity | None, list[str]]:
    from cryptography import x509
    pem = cfg.read()[0]
    san = x509.load_pem_x509_certificate(pem).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return pki.identity_of(pem), [str(v) for v in san.get_values_for_type(x509.DNSName)] + [
        str(v) for v in san.get_values_for_type(x509.IPAddress)]


def test_the_certificates_name_no_address(lc: LocalCluster) -> None:
    """The premise: nothing passes by the address it is dialled at."""
    tls_dir = os.path.join(lc.workdir, "tls")
    node = wtls.TlsConfig.from_dir(os.path.join(tls_dir, "store-0"))
    assert _names(node) == (pki.node(f"{KUBE_POOL}-store"), [KUBE_SERVER_NAME, f"*.{KUBE_SERVER_NAME}"])
    assert _names(wtls.TlsConfig.from_dir(os.path.join(tls_dir, "sidecar-0"))) == (pki.tenant("acme"), [])
    assert lc.client_tls is not None and lc.client_tls.server_name == KUBE_SERVER_NAME


def test_the_handoff_reads_the_state_from_the_prefill_sidecar(lc: LocalCluster, rng: random.Random) -> None:
    with lc.connect(0) as p, lc.connect(1) as d:
        keys, state, prompt = _prefill(p, rng)
        rec = p.publish_prefill(keys, prompt)
        assert rec.has_peer and rec.peer.startswith("127.0.0.1:")
        with d.accept_handoff(rec) as res:
            assert res.state_outcome == StateOutcome.PEER, res.state_detail
            assert bytes(res.state or b"") == state and res.complete


@pytest.fixture
def impostor(lc: LocalCluster, rng: random.Random) -> Iterator[Any]:
    """``serve(name, identity, dns)``: a transfer server with a certificate of the pool's CA for
    ``identity`` serving ``state`` as segment ``arena``, and a record of acme's pointing the decode
    side at it, signed with the pool's handoff key (what a leaked key or a spoofed pod IP gives an
    attacker): (record, state).  The bytes are genuine, so only the server's identity can refuse."""
    with lc.connect(0) as p:
        keys, state, prompt = _prefill(p, rng)
        genuine = p.publish_prefill(keys, prompt)
    with open(lc.handoff_key_file, "rb") as f:
        key = ho.handoff_key(f.read().strip(), "acme")
    servers: list[TransferServer] = []
    buf = bytearray(state)

    def serve(name: str, identity: pki.Identity, dns: tuple[str, ...] = ()) -> ho.HandoffRecord:
        cfg = lc.issue(name, identity, dns=dns, ips=())
        registry = SegmentRegistry()
        registry.register(Segment("arena", memoryview(buf)))
        server = TransferServer(registry, tls=cfg).start()
        servers.append(server)
        return dataclasses.replace(genuine, peer=server.address, segment="arena", state_offset=0).signed(key)

    try:
        yield serve, state
    finally:
        for s in servers:
            s.stop()


def test_a_store_node_or_another_tenant_posing_as_the_prefill_sidecar_is_refused(lc: LocalCluster,
                                                                                   impostor: Any) -> None:
    serve, state = impostor
    store_names = (KUBE_SERVER_NAME, f"*.{KUBE_SERVER_NAME}")
    with lc.connect(1) as d:
        # A store node's certificate carries the very name the sidecar checks store nodes by.
        for rec in (serve("pose-store", pki.node(f"{KUBE_POOL}-store"), store_names),
                    serve("pose-globex", pki.tenant("globex")),
                    serve("pose-router", pki.Identity(pki.ROLE_ROUTER), store_names)):
            with d.accept_handoff(rec) as res:
                assert res.state_outcome == StateOutcome.GONE and res.state is None, res.state_detail
                assert "CONNECTION" in res.state_detail and "not spiffe://kvpool/tenant/acme" in res.state_detail
        # The same server with a certificate of the record's tenant is a sidecar of acme: served.
        with d.accept_handoff(serve("acme-peer", pki.tenant("acme"))) as res:
            assert res.state_outcome == StateOutcome.PEER and bytes(res.state or b"") == state, res.state_detail


def test_a_reader_of_another_tenant_is_still_refused(lc: LocalCluster, rng: random.Random) -> None:
    """The server's side of the same check, under these certificates: an export reads only to
    its tenant's identity, whoever checks whom by name."""
    with lc.connect(0) as p:
        keys, state, prompt = _prefill(p, rng)
        rec = p.publish_prefill(keys, prompt)

    def read(name: str, identity: pki.Identity) -> tuple[TransferCode, bytes]:
        cfg = lc.issue(name, identity, dns=(), ips=()).expecting(pki.tenant("acme"))
        buf = bytearray(rec.state_size)
        with TransferEngine(tls=cfg, stall_timeout=5.0) as eng:
            st = eng.submit(rec.peer, [TransferRequest("read", memoryview(buf), rec.segment, rec.state_offset,
                                                       rec.state_size, token=rec.export_id)]).wait(10.0)[0]
        return st.code, bytes(buf)

    assert read("read-globex", pki.tenant("globex"))[0] == TransferCode.CONNECTION
    assert read("read-acme", pki.tenant("acme")) == (TransferCode.OK, state)
