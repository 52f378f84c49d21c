"""The server's image resolver (bytes sent again are not decoded again) and its cache (no
client can flush the others' images)."""

from __future__ import annotations

import asyncio
import io
from concurrent.futures import ThreadPoolExecutor

import pytest
from PIL import Image

import vlm_server.service.images as images_mod
from image_pipeline import DEFAULT_LIMITS, PreparedImage, prepare_image, sample_image_bytes
from vlm_server.service.images import ImageCache, ImageResolver


def test_repeated_bytes_skip_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = images_mod.prepare_image

    def counting(data: bytes, limits: object) -> object:
        calls.append(len(data))
        return real(data, limits)

    monkeypatch.setattr(images_mod, "prepare_image", counting)

    async def run() -> None:
        with ThreadPoolExecutor(2) as pool:
            resolver = ImageResolver(DEFAULT_LIMITS, ImageCache(64 << 20), pool)
            data = sample_image_bytes()
            a = await resolver.decode(data)
            b = await resolver.decode(data)
            assert a is b and len(calls) == 1 and resolver.encoding_hits == 1
            # The same picture re-encoded is new bytes: decoded, then found by content.
            c = await resolver.decode(data + b"\0")
            assert len(calls) == 2 and c.content_hash == a.content_hash
            # Evicted from the bounded cache: decoded again.
            small = ImageResolver(DEFAULT_LIMITS, ImageCache(1), pool)
            await small.decode(data)
            small.cache._items.clear()
            await small.decode(data)
            assert len(calls) == 4

    asyncio.run(run())


def _image(seed: int) -> PreparedImage:
    picture = Image.new("RGB", (64, 48), (seed * 37 % 256, seed * 91 % 256, 200))
    out = io.BytesIO()
    picture.save(out, format="PNG")
    return prepare_image(out.getvalue())


def test_one_owner_cannot_flush_the_others_images() -> None:
    images = [_image(i) for i in range(12)]
    size = images[0].crops.nbytes
    assert all(im.crops.nbytes == size for im in images)
    cache = ImageCache(6 * size, owner_bytes=2 * size)
    kept, present = cache.put(images[0], owner="alice")
    assert not present
    for image in images[1:]:
        cache.put(image, owner="mallory")
    assert cache.get(kept) is images[0]  # mallory only ever replaced her own
    assert cache.held_by("mallory") == 2 * size and cache.held_by("alice") == size
    assert [cache.get(im.content_hash) is not None for im in images[-2:]] == [True, True]
    # Images cached from inline requests (no owner) share one share as well.
    for image in images[1:8]:
        cache.put(image)
    assert cache.get(kept) is images[0] and cache.held_by(None) == 2 * size
    assert cache.nbytes <= cache.capacity_bytes


def test_put_reports_an_earlier_upload_and_keeps_its_owner() -> None:
    image = _image(1)
    cache = ImageCache(64 << 20, owner_bytes=32 << 20)
    assert cache.put(image) == (image.content_hash, False)  # cached from an inline request
    assert cache.put(image, owner="alice") == (image.content_hash, False)  # first upload
    assert cache.put(image) == (image.content_hash, True)  # inline use keeps the owner
    assert cache.held_by("alice") == image.crops.nbytes and cache.held_by(None) == 0
    assert cache.put(image, owner="bob") == (image.content_hash, True)
