"""Image input of a request: decode bytes off the event loop, or look up an uploaded id."""

from __future__ import annotations

import asyncio
import collections
import hashlib
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Protocol

from image_pipeline import ImageError, ImageLimits, PreparedImage, prepare_image
from vlm_server.service.errors import invalid


@dataclass
class _Entry:
    image: PreparedImage
    owner: str | None  # who uploaded it; None: cached from an inline image_bytes request


class ImageCache:
    """Least-recently-used map from content hash to prepared image, bounded by the bytes of
    the crops it holds (the most recent image is always kept).

    ``owner_bytes`` bounds each owner's share: past it, an owner's own least recently used
    images go first, so one client uploading many pictures cannot flush everyone else's
    ids. Images cached from inline requests (no owner) share one such share.
    Used from the event loop only, so it needs no lock.
    """

    def __init__(self, capacity_bytes: int, owner_bytes: int | None = None) -> None:
        if capacity_bytes < 1:
            raise ValueError("capacity_bytes must be >= 1")
        if owner_bytes is not None and owner_bytes < 1:
            raise ValueError("owner_bytes must be >= 1")
        self.capacity_bytes = capacity_bytes
        self.owner_bytes = capacity_bytes if owner_bytes is None else owner_bytes
        self.nbytes = 0
        self._items: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        self._held: collections.Counter[str | None] = collections.Counter()

    def __len__(self) -> int:
        return len(self._items)

    def held_by(self, owner: str | None) -> int:
        """Bytes of the images ``owner`` holds."""
        return self._held[owner]

    def get(self, image_id: str) -> PreparedImage | None:
        entry = self._items.get(image_id)
        if entry is None:
            return None
        self._items.move_to_end(image_id)
        return entry.image

    def put(self, image: PreparedImage, owner: str | None = None) -> tuple[str, bool]:
        """Store ``image`` for ``owner``; returns (its id, whether an upload, a put with an
        owner, already held it). An owned image stays owned when put again without one."""
        key = image.content_hash
        old = self._items.pop(key, None)
        uploaded = old is not None and old.owner is not None
        if old is not None:
            self._release(old)
            if owner is None:
                owner = old.owner
        entry = _Entry(image, owner)
        self._items[key] = entry
        self._held[owner] += image.crops.nbytes
        self.nbytes += image.crops.nbytes
        self._evict_own(key, owner)
        while self.nbytes > self.capacity_bytes and len(self._items) > 1:
            _, evicted = self._items.popitem(last=False)
            self._release(evicted)
        return key, uploaded

    def _evict_own(self, keep: str, owner: str | None) -> None:
        """Drop ``owner``'s oldest images (never ``keep``) until it is within its share."""
        if self._held[owner] <= self.owner_bytes:
            return
        for key in [k for k, e in self._items.items() if e.owner == owner and k != keep]:
            self._release(self._items.pop(key))
            if self._held[owner] <= self.owner_bytes:
                return

    def _release(self, entry: _Entry) -> None:
        size = entry.image.crops.nbytes
        self.nbytes -= size
        self._held[entry.owner] -= size
        if not self._held[entry.owner]:
            del self._held[entry.owner]


_HASH_ON_LOOP_BYTES = 1 << 20


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


class _HasImage(Protocol):
    def WhichOneof(self, name: str) -> str | None: ...


class ImageResolver:
    """Turns a request's ``image`` oneof into a `PreparedImage`."""

    # Digests of encoded bytes remembered (a few hundred bytes each).
    MAX_KNOWN_ENCODINGS = 4096

    def __init__(self, limits: ImageLimits, cache: ImageCache, executor: Executor) -> None:
        self.limits = limits
        self.cache = cache
        self._executor = executor
        # SHA-256 of encoded bytes -> content hash in `cache`: the same upload sent again
        # skips decoding and tiling (tens of milliseconds of CPU per 800x600 picture).
        self._by_encoding: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self.encoding_hits = 0

    async def decode(self, data: bytes, field: str = "image_bytes") -> PreparedImage:
        """Decode and tile in the thread pool; bad data -> INVALID_ARGUMENT naming ``field``.

        Bytes seen before (and still cached) are not decoded again."""
        loop = asyncio.get_running_loop()
        if len(data) > _HASH_ON_LOOP_BYTES:  # keep the event loop responsive for big uploads
            digest = await loop.run_in_executor(self._executor, _sha256, data)
        else:
            digest = _sha256(data)
        known = self._by_encoding.get(digest)
        if known is not None:
            image = self.cache.get(known)
            if image is not None:
                self._by_encoding.move_to_end(digest)
                self.encoding_hits += 1
                return image
        try:
            image = await loop.run_in_executor(self._executor, prepare_image, data, self.limits)
        except ImageError as err:
            raise invalid(field, f"{err.reason.value}: {err.message}") from None
        self.cache.put(image)
        self._by_encoding[digest] = image.content_hash
        self._by_encoding.move_to_end(digest)
        while len(self._by_encoding) > self.MAX_KNOWN_ENCODINGS:
            self._by_encoding.popitem(last=False)
        return image

    async def resolve(self, request: _HasImage) -> PreparedImage | None:
        """The request's image, or None when it sets neither image_bytes nor image_id."""
        which = request.WhichOneof("image")
        if which is None:
            return None
        if which == "image_id":
            image_id: str = request.image_id  # type: ignore[attr-defined]
            image = self.cache.get(image_id)
            if image is None:
                raise invalid(
                    "image_id",
                    f"unknown image id {image_id[:80]!r} (never uploaded "
                    "or evicted from the cache: call EncodeImage again)",
                )
            return image
        return await self.decode(request.image_bytes)  # type: ignore[attr-defined]
