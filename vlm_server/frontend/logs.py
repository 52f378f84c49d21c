"""Structured logging: one line per record as ``key=value`` pairs or as JSON.

Structured fields travel in ``extra={"fields": {...}}``; the access log writes one such line
per request (`log_request`).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Mapping
from typing import Any

ACCESS_LOGGER = "vlm.access"
access_log = logging.getLogger(ACCESS_LOGGER)


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    base: dict[str, Any] = {
        "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        + f".{int(record.msecs):03d}Z",
        "level": record.levelname.lower(),
        "logger": record.name,
        "msg": record.getMessage(),
    }
    base.update(getattr(record, "fields", None) or {})
    if record.exc_info:
        base["exc"] = logging.Formatter().formatException(record.exc_info)
    return base


def _kv_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    text = str(value)
    if not text or any(c in text for c in ' "=\n\t'):
        return json.dumps(text)
    return text


class KeyValueFormatter(logging.Formatter):
    """``ts=... level=info logger=vlm.access msg=request request_id=... task=caption``."""

    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{k}={_kv_value(v)}" for k, v in _fields(record).items())


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_fields(record), default=str)


def configure_logging(fmt: str = "kv", level: str = "info") -> None:
    """Send every log record to stderr in the chosen format (replaces root handlers)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


def log_request(fields: Mapping[str, Any]) -> None:
    """The access-log line of one finished request."""
    access_log.info("request", extra={"fields": dict(fields)})
