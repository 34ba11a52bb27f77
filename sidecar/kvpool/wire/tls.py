"""TLS of the pool's TCP channels: where a process's certificate, key and CA bundle are, and the
contexts and gRPC credentials built from them.

A :class:`TlsConfig` names three PEM files (a mounted Kubernetes TLS Secret's ``tls.crt``,
``tls.key`` and ``ca.crt``; :func:`add_tls_args` / :func:`from_args` are the flags).  Every
channel of the pool uses it: gRPC (store nodes, router), the data session and the handoff export
port (the transfer server, :mod:`kvpool.transfer.server`), the router's HTTP API.  The CA file
may hold several CAs (old + new during a rotation, :func:`kvpool.core.pki.bundle`), and files
are re-read when they change: a server picks a rotated certificate up at its next handshake
(gRPC through its dynamic credentials, ``ssl`` by a fresh context), with no restart.

Servers of the pool's own channels require a client certificate from the pool CA (mutual TLS);
who the peer is comes from its certificate (:func:`peer_identity`,
:func:`grpc_peer_identity`): the admin API takes only the operator's, an export only its
tenant's.  A client checks a server by name (the address's host or ``server_name``: the store
nodes' one Service name), except where the server is a peer of its own kind: a handoff reader
checks the prefill sidecar by the identity its certificate names (:meth:`TlsConfig.expecting`),
the way that server checks the reader, since a tenant's certificate serves no name (one that
did, the store nodes', would let a tenant pose as a store node).

A process installs its configuration once (:func:`install`); clients created without an
explicit one use it (:func:`current`), so every StoreClient of a sidecar or of a store node's
drain speaks TLS without being told.
"""

from __future__ import annotations

import argparse
import os
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from kvpool.core import pki

CERT_NAME, KEY_NAME, CA_NAME = "tls.crt", "tls.key", "ca.crt"
"""File names in a TLS directory: a Kubernetes ``kubernetes.io/tls`` Secret plus its CA."""


class TlsError(Exception):
    """A TLS configuration that cannot be used (a missing or unreadable file)."""


@dataclass(frozen=True)
class TlsConfig:
    """A process's certificate, key and trusted CA bundle (paths; read when used)."""

    cert_file: str
    key_file: str
    ca_file: str
    server_name: str = ""
    """The name a client checks in a server's certificate instead of the address's host (one
    name for every store node of a pool, say); "" checks the host (its IP or DNS SAN)."""
    server_identity: pki.Identity | None = None
    """The kvpool identity a client requires of a server's certificate *instead of* a name (a
    peer of the client's own kind, :meth:`expecting`); ``ssl`` clients only (the transfer
    engine, :mod:`kvpool.transfer.stream`), not gRPC."""
    _cache: dict[str, Any] = field(default_factory=dict, init=False, compare=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, compare=False, repr=False)

    @classmethod
    def from_dir(cls, directory: str, server_name: str = "") -> TlsConfig:
        return cls(os.path.join(directory, CERT_NAME), os.path.join(directory, KEY_NAME),
                   os.path.join(directory, CA_NAME), server_name)

    def expecting(self, identity: pki.Identity) -> TlsConfig:
        """The same files, as a client that checks servers by ``identity`` (the URI SAN of their
        verified certificate) and not by name: a sidecar reading another sidecar of its tenant
        (a handoff export), whose certificate names the tenant and no host."""
        return replace(self, server_identity=identity)

    def stamp(self) -> tuple[int, ...]:
        """A cheap change stamp of the three files (three ``stat``; a symlink swap of a mounted
        Secret or a rewrite changes it): a client holding credentials built from the files
        rebuilds them when it changed (:class:`kvpool.pool.node_client.StoreClient`)."""
        try:
            stats = [os.stat(p) for p in (self.cert_file, self.key_file, self.ca_file)]
        except OSError as exc:
            raise TlsError(f"TLS files unreadable: {exc}") from None
        return tuple(v for st in stats for v in (st.st_ino, st.st_mtime_ns, st.st_size))

    def _cached(self, what: str, build: Callable[[], Any]) -> Any:
        """``build()``'s result, built again when a file changed (a rotation)."""
        stamp = self.stamp()
        with self._lock:
            hit = self._cache.get(what)
            if hit is not None and hit[0] == stamp:
                return hit[1]
        value = build()
        with self._lock:
            self._cache[what] = (stamp, value)
        return value

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(certificate chain, key, CA bundle), PEM, of one generation: a refresh landing between
        the three reads (the files are replaced one after another, or a Secret's symlink swapped
        between two opens) is read again, within :data:`READ_SECONDS`, until the files stood
        still across the reads and the key is the certificate's."""
        return self._cached("pem", lambda: _read_consistent(self))  # type: ignore[no-any-return]

    def identity(self) -> pki.Identity | None:
        """The kvpool identity this process's own certificate names."""
        return pki.identity_of(self.read()[0])

    # -- ssl (the transfer server and its clients, the router's HTTP API) ---------------------

    def server_context(self, client_auth: bool = True) -> ssl.SSLContext:
        """A server context (TLS 1.2+); with ``client_auth`` a certificate from the bundle's CAs
        is required of every client."""
        def build() -> ssl.SSLContext:
            ctx = self._context(ssl.PROTOCOL_TLS_SERVER)
            ctx.verify_mode = ssl.CERT_REQUIRED if client_auth else ssl.CERT_NONE
            return ctx
        return self._cached(f"server-{client_auth}", build)  # type: ignore[no-any-return]

    def listening_context(self, client_auth: bool = True) -> ssl.SSLContext:
        """A server context for wrapping a *listening* socket once (an HTTP server): each
        handshake switches to :meth:`server_context` of the files as they are then, so a renewed
        certificate and bundle are served with no restart."""
        ctx = self.server_context(client_auth)
        wrapper = self._context(ssl.PROTOCOL_TLS_SERVER)
        wrapper.verify_mode = ctx.verify_mode

        def current(sock: ssl.SSLObject | ssl.SSLSocket, _name: str | None, _ctx: ssl.SSLContext) -> None:
            sock.context = self.server_context(client_auth)
        wrapper.sni_callback = current
        return wrapper

    def client_context(self) -> ssl.SSLContext:
        """A client context: the server verified against the bundle (and its name, unless
        :attr:`server_identity` is checked instead, by :meth:`wrap_client`), this process's
        certificate presented."""
        def build() -> ssl.SSLContext:
            ctx = self._context(ssl.PROTOCOL_TLS_CLIENT)
            # The chain is still verified (CERT_REQUIRED); the name gives way to the identity.
            ctx.check_hostname = self.server_identity is None
            return ctx
        return self._cached("client", build)  # type: ignore[no-any-return]

    def _context(self, protocol: ssl._SSLMethod) -> ssl.SSLContext:
        """A TLS 1.2+ context of ``protocol`` presenting this certificate, trusting the bundle."""
        ctx = ssl.SSLContext(protocol)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        _, _, ca = self.read()
        # ``ssl`` loads a certificate and key only from files: a pair read while a rotation
        # rewrote them fails the library's own match check, and is loaded again.
        deadline = time.monotonic() + READ_SECONDS
        while True:
            try:
                ctx.load_cert_chain(self.cert_file, self.key_file)
                break
            except ssl.SSLError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(_READ_RETRY_SECONDS)
        ctx.load_verify_locations(cadata=ca.decode())
        return ctx

    def wrap_client(self, sock: Any, host: str) -> ssl.SSLSocket:
        """``sock`` (connected) as a TLS client of ``host``; the handshake done, the server
        checked (its chain against the bundle; its name, or its :attr:`server_identity`).  A
        server of another identity raises ``ssl.SSLCertVerificationError`` before a byte is sent
        to it (the TLS socket closed; ``sock`` is detached by the wrap either way)."""
        conn = self.client_context().wrap_socket(sock, server_hostname=self.server_name or host)
        if self.server_identity is None:
            return conn
        who = peer_identity(conn)
        if who != self.server_identity:
            conn.close()
            raise ssl.SSLCertVerificationError(
                f"server {host} is {who or 'no kvpool identity'}, not {self.server_identity}")
        return conn

    # -- gRPC --------------------------------------------------------------------------------

    def channel_credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self.read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def server_credentials(self, client_auth: bool = True) -> grpc.ServerCredentials:
        """Credentials that re-read the files when they change (picked up at the next handshake)."""
        def config() -> Any:
            cert, key, ca = self.read()
            return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)
        seen = [self.stamp()]

        def fetch() -> Any:
            try:
                stamp = self.stamp()
                if stamp == seen[0]:
                    return None  # unchanged: keep the current one
                fresh = config()
            except TlsError:
                return None  # mid-refresh past the read's bound: keep serving the current one
            seen[0] = stamp
            return fresh
        return grpc.dynamic_ssl_server_credentials(config(), fetch, require_client_authentication=client_auth)


READ_SECONDS = 2.0
"""How long :meth:`TlsConfig.read` tries for a consistent set before it fails (a refresh writes
its files within milliseconds; a certificate whose key never comes is a broken Secret)."""
_READ_RETRY_SECONDS = 0.02


def _read_files(cfg: TlsConfig) -> tuple[bytes, bytes, bytes]:
    try:
        out = []
        for p in (cfg.cert_file, cfg.key_file, cfg.ca_file):
            with open(p, "rb") as f:
                out.append(f.read())
    except OSError as exc:
        raise TlsError(f"TLS files unreadable: {exc}") from None
    return out[0], out[1], out[2]


def _read_consistent(cfg: TlsConfig) -> tuple[bytes, bytes, bytes]:
    """The three files of one generation (:meth:`TlsConfig.read`)."""
    deadline = time.monotonic() + READ_SECONDS
    while True:
        before = cfg.stamp()
        cert, key, ca = _read_files(cfg)
        if cfg.stamp() == before and pki.key_matches(cert, key):
            return cert, key, ca
        if time.monotonic() >= deadline:
            raise TlsError(f"TLS key {cfg.key_file} does not match certificate {cfg.cert_file} "
                           f"(or they kept changing) for {READ_SECONDS:g}s")
        time.sleep(_READ_RETRY_SECONDS)


# -- a process's configuration -------------------------------------------------------------------

_installed: TlsConfig | None = None
_by_address: dict[str, TlsConfig] = {}


def install(cfg: TlsConfig | None) -> None:
    """This process's TLS configuration: what clients created without one use."""
    global _installed
    _installed = cfg


def current() -> TlsConfig | None:
    return _installed


def use_for(address: str, cfg: TlsConfig | None) -> None:
    """Clients of ``address`` created without a configuration use ``cfg`` (None: forget it).
    For a process that talks to pools it did not start in (``LocalCluster`` in a test): its
    nodes speak TLS, other servers of the same process may not."""
    if cfg is None:
        _by_address.pop(address, None)
    else:
        _by_address[address] = cfg


def resolve(cfg: TlsConfig | None | bool, address: str = "") -> TlsConfig | None:
    """A client's configuration: the one given, else the one for ``address``
    (:func:`use_for`), else the process's (``None``, :func:`install`); plaintext for ``False``."""
    if cfg is False:
        return None
    if cfg is None or cfg is True:
        return _by_address.get(address, _installed)
    return cfg


def channel(address: str, cfg: TlsConfig | None, options: list[tuple[str, Any]]) -> grpc.Channel:
    """A gRPC channel to ``address``: TLS with ``cfg``, plaintext without."""
    if cfg is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, cfg.channel_credentials(), options=[*options, *cfg.channel_options()])


def add_port(server: grpc.Server, address: str, cfg: TlsConfig | None, client_auth: bool = True) -> int:
    """Bind ``address`` on ``server`` (TLS with ``cfg``); the port bound, 0 when it failed."""
    if cfg is None:
        return int(server.add_insecure_port(address))
    return int(server.add_secure_port(address, cfg.server_credentials(client_auth)))


# -- who the peer is --------------------------------------------------------------------------

def _first_identity(uris: Any) -> pki.Identity | None:
    for uri in uris:
        found = pki.parse_identity(uri.decode() if isinstance(uri, bytes) else str(uri))
        if found is not None:
            return found
    return None


def peer_identity(sock: Any) -> pki.Identity | None:
    """The kvpool identity of a TLS socket's peer (the URI SAN of its verified certificate), None
    without one."""
    getpeercert = getattr(sock, "getpeercert", None)
    cert = getpeercert() if getpeercert is not None else None
    if not cert:
        return None
    return _first_identity(v for kind, v in cert.get("subjectAltName", ()) if kind == "URI")


def grpc_peer_identity(context: grpc.ServicerContext) -> pki.Identity | None:
    """The kvpool identity of a gRPC call's peer (the URI SAN of its verified client certificate,
    which gRPC lists among the peer's subject alternative names)."""
    auth = context.auth_context() or {}
    return _first_identity(auth.get("x509_subject_alternative_name") or ())


# -- flags ---------------------------------------------------------------------------------------

def add_tls_args(group: Any) -> None:
    """The TLS flags of a kvpool process (a mounted Secret's files, or its directory)."""
    group.add_argument("--tls-dir", default=None,
                       help=f"directory of this process's TLS files ({CERT_NAME}, {KEY_NAME}, {CA_NAME}: a "
                            "mounted Secret); every TCP channel of the pool then uses TLS")
    group.add_argument("--tls-cert", default=None, help="this process's certificate chain (PEM)")
    group.add_argument("--tls-key", default=None, help="its private key (PEM)")
    group.add_argument("--tls-ca", default=None,
                       help="the pool's CA bundle (PEM; old and new CA during a rotation)")
    group.add_argument("--tls-server-name", default="",
                       help="name checked in servers' certificates instead of their address's host")


def from_args(args: argparse.Namespace) -> TlsConfig | None:
    """The configuration the flags name (None: plaintext); fails fast on a partial set."""
    files = (args.tls_cert, args.tls_key, args.tls_ca)
    if args.tls_dir:
        if any(files):
            raise TlsError("--tls-dir or --tls-cert/--tls-key/--tls-ca, not both")
        cfg = TlsConfig.from_dir(args.tls_dir, args.tls_server_name)
    elif any(files):
        if not all(files):
            raise TlsError("--tls-cert, --tls-key and --tls-ca go together")
        cfg = TlsConfig(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)
    else:
        return None
    cfg.read()  # unreadable files fail here, at start, not at the first connection
    return cfg


def write_dir(directory: str, pair: pki.KeyPair, ca_bundle: bytes) -> TlsConfig:
    """Write a key pair and a CA bundle as a TLS directory (what a mounted Secret looks like)."""
    os.makedirs(directory, exist_ok=True)
    for name, data, mode in ((CERT_NAME, pair.cert_pem, 0o644), (KEY_NAME, pair.key_pem, 0o600),
                             (CA_NAME, ca_bundle, 0o644)):
        path = os.path.join(directory, name)
        tmp = path + ".tmp"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # atomic, as a Secret update's symlink swap
    return TlsConfig.from_dir(directory)
