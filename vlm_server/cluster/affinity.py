"""Affinity keys: which cached state a request would reuse, so the router can send it there.

A request's key names its image (the BLAKE3 of its bytes, or the routing tag of an id that
`EncodeImage` returned through the cluster) and, when set, its adapter: an adapter changes the
decoder, so the same image's prefix under two adapters is two cache entries anyway. Pure
functions of the request message: no Ray, no model.

Image ids: the server's ids name the image's pixels, which the router cannot compute without
decoding. Through the cluster `EncodeImage` answers ``<id>~<tag>``, the tag being the key of
the uploaded bytes, so the id and the bytes route to the same replica; the replica strips the
tag before its own server sees the id.
"""

from __future__ import annotations

from typing import Any

import blake3

ID_TAG_SEPARATOR = "~"
_KEY_HEX = 16  # 64 bits of the digest: plenty to spread keys, short in an id


# Keys only route (the server digests every picture itself), so a large picture's key reads
# its length, head and tail: constant time in the proxy's event loop whatever the size.
WHOLE_BYTES = 1 << 20
SAMPLE_BYTES = 256 << 10


def sampled_key(size: int, head: bytes | memoryview, tail: bytes | memoryview) -> str:
    """The key of a large picture from its length and its first and last sample bytes."""
    h = blake3.blake3(size.to_bytes(8, "big"))
    h.update(head)
    h.update(tail)
    return h.hexdigest()[:_KEY_HEX]


def bytes_key(data: bytes) -> str:
    """The affinity key of an encoded image."""
    if len(data) <= WHOLE_BYTES:
        return blake3.blake3(data).hexdigest()[:_KEY_HEX]
    view = memoryview(data)
    return sampled_key(len(data), view[:SAMPLE_BYTES], view[-SAMPLE_BYTES:])


def tag_image_id(image_id: str, data: bytes) -> str:
    """The id the cluster returns for an upload of ``data``: the server's id plus its key."""
    return f"{image_id}{ID_TAG_SEPARATOR}{bytes_key(data)}"


def untag_image_id(image_id: str) -> str:
    """The server's own id (an untagged id unchanged)."""
    return image_id.partition(ID_TAG_SEPARATOR)[0]


def _image_key(request: Any) -> str | None:
    try:
        which = request.WhichOneof("image")
    except (AttributeError, ValueError):  # no image oneof: EncodeImageRequest, GetModelInfo
        data = getattr(request, "image_bytes", b"")
        return bytes_key(data) if data else None
    if which == "image_bytes":
        return bytes_key(request.image_bytes)
    if which == "image_id":
        image_id: str = request.image_id
        _, sep, tag = image_id.partition(ID_TAG_SEPARATOR)
        return tag if sep and tag else image_id
    return None


def _adapter(request: Any) -> str | None:
    settings = getattr(request, "settings", None)
    if settings is None:
        return None
    try:
        has = settings.HasField("adapter")
    except ValueError:  # a settings message without the field (an older proto)
        return None
    return settings.adapter or None if has else None


def affinity_key(request: Any) -> str | None:
    """The key of a gRPC request message; None: no affinity (route by load alone)."""
    image = _image_key(request)
    adapter = _adapter(request)
    if image is not None and adapter is not None:
        return f"{adapter}|{image}"
    return image if image is not None else adapter
