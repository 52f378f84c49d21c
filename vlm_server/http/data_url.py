"""Pictures sent inline as ``data:`` URLs (RFC 2397, base64). The server never fetches a URL:
a remote one is refused with an error that says how to send the picture instead."""

from __future__ import annotations

import asyncio
import base64
import binascii

from vlm_server.frontend.refusals import invalid

_DECODE_ON_LOOP_CHARS = 1 << 20  # larger payloads decode in a thread: the loop stays responsive
_EXAMPLE = "data:image/jpeg;base64,/9j/..."
# Media types that may carry a picture; the decoder then checks the bytes themselves.
_GENERIC_TYPES = ("", "application/octet-stream")


def _b64decode(payload: str) -> bytes:
    return base64.b64decode(payload, validate=True)


async def decode(url: str, field: str) -> bytes:
    """The bytes a data URL carries; INVALID_ARGUMENT naming ``field`` for anything else."""
    scheme = url[: url.find(":")].lower() if ":" in url[:16] else ""
    if scheme in ("http", "https"):
        raise invalid(
            field,
            f"remote URLs are not fetched by this server; send the picture inline as a "
            f"base64 data URL ({_EXAMPLE})",
        )
    if scheme != "data":
        raise invalid(field, f"must be a base64 data URL ({_EXAMPLE})")
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise invalid(field, "is a data URL without a comma before its data")
    media_type, *params = (p.strip().lower() for p in header.split(";"))
    if "base64" not in params:
        raise invalid(field, f"must be base64-encoded ({_EXAMPLE})")
    if media_type not in _GENERIC_TYPES and not media_type.startswith("image/"):
        raise invalid(field, f"media type {media_type[:40]!r} is not an image type")
    try:
        if len(payload) > _DECODE_ON_LOOP_CHARS:
            data = await asyncio.to_thread(_b64decode, payload)
        else:
            data = _b64decode(payload)
    except (binascii.Error, ValueError):
        raise invalid(field, "the data URL's payload is not valid base64") from None
    if not data:
        raise invalid(field, "the data URL carries no data")
    return data
