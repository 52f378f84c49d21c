"""The server's image resolver: bytes sent again are not decoded again."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

import vlm_server.service.images as images_mod
from image_pipeline import DEFAULT_LIMITS, sample_image_bytes
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
