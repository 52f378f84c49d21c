"""Test certificates, made with the openssl command: a CA and certificates it signed for
127.0.0.1."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _signed(name: str, cwd: Path) -> None:
    """``name.pem`` / ``name.key``: a certificate for 127.0.0.1 signed by ``ca``."""
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj",
             f"/CN={name}", cwd=cwd)  # fmt: skip
    (cwd / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "2", "-out", f"{name}.pem", "-extfile",
             f"{name}.ext", cwd=cwd)  # fmt: skip


def make_certs(out: Path) -> Path:
    """A test CA (``ca.pem``) and the ``server`` and ``client`` certificates it signed, in
    ``out`` (skips the test without the openssl command)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make test certificates")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj",
             "/CN=test CA", "-addext", "basicConstraints=critical,CA:TRUE", cwd=out)  # fmt: skip
    _signed("server", out)
    _signed("client", out)
    return out
