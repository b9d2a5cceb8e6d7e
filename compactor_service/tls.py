"""TCP addresses and TLS for the compactor's gRPC transport (imports gRPC only).

The Unix socket (the default) is protected by file permissions. A TCP listener has no
such protection, so:

* a loopback address (``127.0.0.0/8``, ``::1``, ``localhost``) may listen in plaintext;
* any other address needs TLS (``--tls-cert`` and ``--tls-key``), and with
  ``--tls-client-ca`` every client must present a certificate signed by that CA
  (mutual TLS), which is how the compactor authenticates its schedulers over TCP.

Clients (``GrpcCompactor``, ``compactor-health``) connect with ``channel_credentials``:
the CA that signed the server's certificate and, for mutual TLS, their own certificate
and key.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TcpAddress:
    host: str
    port: int

    @property
    def target(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False  # a host name: it may resolve to anything


def parse_tcp_address(text: str, flag: str = "--tcp") -> TcpAddress:
    """``HOST:PORT`` (IPv6 as ``[::1]:PORT``) or a ``ValueError`` naming ``flag``."""
    usage = f"{flag} takes HOST:PORT, e.g. 127.0.0.1:50151 or [::1]:50151, got {text!r:.80}"
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(usage)
    if host.startswith("["):
        if not host.endswith("]"):
            raise ValueError(usage)
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(usage) from None
    elif ":" in host or any(c.isspace() or c in "/@" for c in host):
        raise ValueError(usage)
    port = int(port_text)
    if not 0 < port < 65536:
        raise ValueError(f"{flag}: port {port} is out of range; allowed: 1-65535")
    return TcpAddress(host, port)


def _read(path: str | None, flag: str) -> bytes | None:
    if not path:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"{flag} {path}: cannot read it ({error.strerror})") from None
    if not data.strip():
        raise ValueError(f"{flag} {path} is empty; give a PEM file")
    if b"-----BEGIN" not in data:
        raise ValueError(f"{flag} {path} is not PEM (no -----BEGIN line)")
    return data


@dataclass(frozen=True)
class ServerTls:
    """The listener's PEM files, read and checked (no gRPC object yet, so a supervising
    parent can hold it across ``fork``)."""

    cert_pem: bytes
    key_pem: bytes
    client_ca_pem: bytes | None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key_pem, self.cert_pem)],
            root_certificates=self.client_ca_pem,
            require_client_auth=self.client_ca_pem is not None,
        )


def load_server_tls(cert: str | None, key: str | None, client_ca: str | None) -> ServerTls | None:
    """The listener's TLS files, or None for plaintext (no TLS flag given)."""
    if not cert and not key:
        if client_ca:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (the server's own)")
        return None
    if not cert or not key:
        raise ValueError("--tls-cert and --tls-key go together: give both PEM files")
    return ServerTls(
        cert_pem=_read(cert, "--tls-cert"),
        key_pem=_read(key, "--tls-key"),
        client_ca_pem=_read(client_ca, "--tls-client-ca"),
    )


def channel_credentials(
    ca: str | None, cert: str | None = None, key: str | None = None, *, flag_prefix: str = "--tls"
) -> grpc.ChannelCredentials | None:
    """Client credentials: None (plaintext) unless a CA is given; ``cert``/``key`` for
    mutual TLS."""
    if not ca:
        if cert or key:
            raise ValueError(f"{flag_prefix}-cert/{flag_prefix}-key need {flag_prefix}-ca")
        return None
    if bool(cert) != bool(key):
        raise ValueError(f"{flag_prefix}-cert and {flag_prefix}-key go together: give both")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca, f"{flag_prefix}-ca"),
        private_key=_read(key, f"{flag_prefix}-key"),
        certificate_chain=_read(cert, f"{flag_prefix}-cert"),
    )


def open_channel(
    target: str, credentials: grpc.ChannelCredentials | None, options=()
) -> grpc.Channel:
    if credentials is None:
        return grpc.insecure_channel(target, options=list(options))
    return grpc.secure_channel(target, credentials, options=list(options))
