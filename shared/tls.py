"""Optional mutual TLS on every gRPC hop (router <-> rankers, trigger -> rankers, clients -> router).

Configured by three PEM files shared by a deployment: the CA that signs every service's and
client's certificate, this process's certificate and its key. With them a server requires a
client certificate signed by that CA, and a client presents its own and checks the server's.
Without them (the default) traffic is plaintext, for loopback and trusted networks.
The key's contents are never logged.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from shared.config import ConfigError, setting


@dataclass(frozen=True)
class TlsSettings:
    """Mixed into each gRPC service's config (env vars shared by every service)."""

    tls_ca: str = setting(
        "", env="RELAYGR_TLS_CA", help="CA certificate (PEM) for mutual TLS ('': plaintext)"
    )
    tls_cert: str = setting("", env="RELAYGR_TLS_CERT", help="this service's certificate (PEM)")
    tls_key: str = setting("", env="RELAYGR_TLS_KEY", help="this service's private key (PEM)")

    @property
    def tls_enabled(self) -> bool:
        return bool(self.tls_ca or self.tls_cert or self.tls_key)

    def validate_tls(self) -> None:
        given = [bool(self.tls_ca), bool(self.tls_cert), bool(self.tls_key)]
        if any(given) and not all(given):
            raise ConfigError("mutual TLS needs all of RELAYGR_TLS_CA, RELAYGR_TLS_CERT and RELAYGR_TLS_KEY")
        for path in (self.tls_ca, self.tls_cert, self.tls_key):
            if path and not Path(path).is_file():
                raise ConfigError(f"TLS file {path!r} does not exist")

    def _read(self) -> tuple[bytes, bytes, bytes]:
        return (
            Path(self.tls_ca).read_bytes(),
            Path(self.tls_cert).read_bytes(),
            Path(self.tls_key).read_bytes(),
        )

    def server_credentials(self) -> grpc.ServerCredentials:
        ca, cert, key = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        ca, cert, key = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def server_ssl_context(self, alpn: tuple[str, ...] = ("h2",)) -> ssl.SSLContext:
        """The same mutual TLS for a server that is not gRPC's (the router's HTTP/2 relay):
        a client certificate signed by the CA is required."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.tls_ca)
        context.load_cert_chain(self.tls_cert, self.tls_key)
        context.verify_mode = ssl.CERT_REQUIRED
        context.set_alpn_protocols(list(alpn))
        return context

    def client_ssl_context(self, alpn: tuple[str, ...] = ("h2",)) -> ssl.SSLContext:
        """The client side of the same: checks the server's certificate, presents ours."""
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca)
        context.load_cert_chain(self.tls_cert, self.tls_key)
        context.set_alpn_protocols(list(alpn))
        return context

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        if self.tls_enabled:
            return int(server.add_secure_port(address, self.server_credentials()))
        return int(server.add_insecure_port(address))

    def channel(self, target: str, options: list[tuple[str, Any]] | None = None) -> grpc.aio.Channel:
        if self.tls_enabled:
            return grpc.aio.secure_channel(target, self.channel_credentials(), options=options)
        return grpc.aio.insecure_channel(target, options=options)


PLAINTEXT = TlsSettings()
