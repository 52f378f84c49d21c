"""How a client proves itself and checks the server: TLS credentials and the API key."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc

PemSource = bytes | str | os.PathLike[str]


def _pem(source: PemSource | None) -> bytes | None:
    if source is None or isinstance(source, bytes):
        return source
    return Path(source).read_bytes()


@dataclass(frozen=True)
class Security:
    """``api_key`` goes out as ``authorization: Bearer KEY``; TLS is on when ``tls`` is set
    or any certificate is given (``ca_cert``: the CA that signed the server's certificate,
    default the system's roots; ``client_cert`` and ``client_key``: for mutual TLS). PEM
    bytes or file paths."""

    api_key: str | None = None
    tls: bool = False
    ca_cert: PemSource | None = None
    client_cert: PemSource | None = None
    client_key: PemSource | None = None

    @property
    def uses_tls(self) -> bool:
        return self.tls or any(
            v is not None for v in (self.ca_cert, self.client_cert, self.client_key)
        )

    def credentials(self) -> grpc.ChannelCredentials | None:
        """Channel credentials, or None for a plaintext channel."""
        if not self.uses_tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=_pem(self.ca_cert),
            private_key=_pem(self.client_key),
            certificate_chain=_pem(self.client_cert),
        )

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata carrying the API key (sent per call: it works over plaintext too,
        where gRPC refuses call credentials)."""
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()
