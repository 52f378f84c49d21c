"""Pictures sent inline as ``data:`` URLs (RFC 2397, base64). The server never fetches a URL:
a remote one is refused with an error that says how to send the picture instead."""

from __future__ import annotations

import asyncio
import binascii

from vlm_server.frontend.refusals import invalid

_DECODE_ON_LOOP_CHARS = 1 << 20  # larger payloads decode in a thread: the loop stays responsive
# Characters one base64 step decodes (a multiple of 4): one C call holds the GIL, so a
# 30 MB payload in one call stalled the event loop for a tenth of a second or more.
_STEP_CHARS = 1 << 20
_MAX_HEADER_CHARS = 256  # "data:image/jpeg;base64," and a few parameters
_EXAMPLE = "data:image/jpeg;base64,/9j/..."
# Media types that may carry a picture; the decoder then checks the bytes themselves.
_GENERIC_TYPES = ("", "application/octet-stream")


def _b64decode(url: str, start: int) -> bytes:
    """The base64 payload of ``url`` from ``start``, decoded a step at a time (strict: only
    the last step may carry padding)."""
    parts = [
        binascii.a2b_base64(url[i : i + _STEP_CHARS], strict_mode=True)
        for i in range(start, len(url), _STEP_CHARS)
    ]
    return b"".join(parts)


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
    # The header is short: no copy of the payload is made to find its end.
    comma = url.find(",", 5, 5 + _MAX_HEADER_CHARS)
    if comma < 0:
        raise invalid(field, "is a data URL without a comma after a short header")
    header = url[5:comma]
    media_type, *params = (p.strip().lower() for p in header.split(";"))
    if "base64" not in params:
        raise invalid(field, f"must be base64-encoded ({_EXAMPLE})")
    if media_type not in _GENERIC_TYPES and not media_type.startswith("image/"):
        raise invalid(field, f"media type {media_type[:40]!r} is not an image type")
    try:
        if len(url) - comma > _DECODE_ON_LOOP_CHARS:
            data = await asyncio.to_thread(_b64decode, url, comma + 1)
        else:
            data = _b64decode(url, comma + 1)
    except (binascii.Error, ValueError):
        raise invalid(field, "the data URL's payload is not valid base64") from None
    if not data:
        raise invalid(field, "the data URL carries no data")
    return data
