"""Helpers of the HTTP door's tests: raw requests, server-sent events, the official client."""

from __future__ import annotations

import base64
import importlib
import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

# The official Python client, unmodified. Its releases require the local-inference runtime
# (hundreds of MB of GPU kernels) that its HTTP client never imports, so it cannot come from
# the dev extra: a test session installs this pinned release without dependencies into the
# pytest cache (once) and skips when that is impossible (offline).
MOONDREAM_CLIENT = "moondream==2.6.1"


def moondream_client(cache_dir: Path) -> ModuleType:
    try:
        return importlib.import_module("moondream")
    except ImportError:
        pass
    target = cache_dir / MOONDREAM_CLIENT.replace("==", "-")
    if not (target / "moondream" / "__init__.py").exists():
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"]
        cmd += ["--disable-pip-version-check", "--target", str(target), MOONDREAM_CLIENT]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            pytest.skip(f"cannot install {MOONDREAM_CLIENT}: {done.stderr.strip()[-300:]}")
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    return importlib.import_module("moondream")


def data_url(data: bytes, media_type: str = "image/jpeg") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def post(
    url: str, body: Any, headers: dict[str, str] | None = None, timeout: float = 60
) -> tuple[int, dict[str, str], bytes]:
    """POST ``body`` (JSON unless bytes); (status, headers, body) also for error statuses."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def post_json(url: str, body: Any, **kwargs: Any) -> tuple[int, Any]:
    status, _, raw = post(url, body, **kwargs)
    return status, json.loads(raw)


def events(raw: bytes) -> list[Any]:
    """The ``data:`` events of a server-sent event stream (JSON, or the raw string)."""
    out: list[Any] = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out
