"""The server's image resolver: bytes sent again are not decoded again."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from image_pipeline import DEFAULT_LIMITS, ImagePreparer, PreparedImage, sample_image_bytes
from vlm_server.service.images import ImageCache, ImageResolver


class CountingPreparer(ImagePreparer):
    def __init__(self, calls: list[int]) -> None:
        super().__init__(DEFAULT_LIMITS)
        self.calls = calls

    def prepare(self, data: bytes) -> PreparedImage:
        self.calls.append(len(data))
        return super().prepare(data)


def test_repeated_bytes_skip_decoding() -> None:
    calls: list[int] = []

    async def run() -> None:
        with ThreadPoolExecutor(2) as pool:
            preparer = CountingPreparer(calls)
            resolver = ImageResolver(DEFAULT_LIMITS, ImageCache(64 << 20), pool, preparer)
            data = sample_image_bytes()
            a = await resolver.decode(data)
            b = await resolver.decode(data)
            assert a is b and len(calls) == 1 and resolver.encoding_hits == 1
            # The same picture re-encoded is new bytes: decoded, then found by content.
            c = await resolver.decode(data + b"\0")
            assert len(calls) == 2 and c.content_hash == a.content_hash
            # Evicted from the bounded cache: decoded again.
            small = ImageResolver(DEFAULT_LIMITS, ImageCache(1), pool, preparer)
            await small.decode(data)
            small.cache._items.clear()
            await small.decode(data)
            assert len(calls) == 4

    asyncio.run(run())
