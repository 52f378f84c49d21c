"""Affinity keys of HTTP requests: the same key the gRPC request for the same picture and
adapter has (`affinity.affinity_key`), read from the JSON body.

The Moondream routes carry the picture as ``image_url``, the OpenAI chat route as a message
part's ``image_url.url``; both are base64 data URLs. A key only routes (the replica validates
the request), so anything unexpected gives None: route by load, let the replica answer.
"""

from __future__ import annotations

import binascii
import json
from typing import Any

from vlm_server.cluster.affinity import SAMPLE_BYTES, WHOLE_BYTES, bytes_key, sampled_key
from vlm_server.http.adapter_names import requested

_MAX_HEADER_CHARS = 256


def _payload(url: Any) -> str | None:
    if not isinstance(url, str) or url[:5].lower() != "data:":
        return None
    comma = url.find(",", 5, 5 + _MAX_HEADER_CHARS)
    return url[comma + 1 :] if comma >= 0 else None


def data_url_key(url: Any) -> str | None:
    """`affinity.bytes_key` of the bytes a base64 data URL carries, decoding at most its
    head and tail (constant time whatever the picture's size)."""
    text = _payload(url)
    if not text or len(text) % 4:
        return None
    try:
        size = len(text) // 4 * 3 - (len(text) - len(text.rstrip("=")))
        if size <= WHOLE_BYTES:
            return bytes_key(binascii.a2b_base64(text, strict_mode=True))
        head_chars = (SAMPLE_BYTES + 2) // 3 * 4
        head = binascii.a2b_base64(text[:head_chars], strict_mode=True)[:SAMPLE_BYTES]
        # The tail from a 4-character boundary, then its last sample bytes.
        start = len(text) - head_chars - 4
        tail = binascii.a2b_base64(text[start:], strict_mode=True)[-SAMPLE_BYTES:]
    except (binascii.Error, ValueError):
        return None
    return sampled_key(size, head, tail)


def _image_url(body: dict[str, Any]) -> Any:
    if "image_url" in body:  # the Moondream routes
        return body["image_url"]
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    for message in messages:  # the chat route: the user's image part
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, dict) and part.get("type") == "image_url":
                inner = part.get("image_url")
                return inner.get("url") if isinstance(inner, dict) else inner
    return None


def body_key(body: bytes) -> str | None:
    """The affinity key of a JSON request body (None: no picture or adapter, or not JSON)."""
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(parsed, dict):
        return None
    image = data_url_key(_image_url(parsed))
    try:
        asked = requested(parsed)
    except Exception:  # disagreeing adapter fields: the replica names them
        asked = None
    adapter = asked[0] if asked else None
    if image is not None and adapter is not None:
        return f"{adapter}|{image}"
    return image if image is not None else adapter
