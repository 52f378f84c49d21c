"""gRPC server credentials from certificate files: TLS, and mutual TLS with a client CA."""

from __future__ import annotations

from pathlib import Path

import grpc


def server_credentials(
    cert: str | None, key: str | None, client_ca: str | None = None
) -> grpc.ServerCredentials | None:
    """The credentials of ``--tls-cert``/``--tls-key`` (and ``--tls-client-ca``: clients must
    present a certificate it signed); None without a certificate (plaintext)."""
    if cert is None or key is None:
        return None
    ca = Path(client_ca).read_bytes() if client_ca else None
    return grpc.ssl_server_credentials(
        [(Path(key).read_bytes(), Path(cert).read_bytes())],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )
