"""The server's image resolver (bytes sent again are not decoded again) and its cache (no
client can flush the others' images)."""

from __future__ import annotations

import asyncio
import contextvars
import io
import logging
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from PIL import Image

from image_pipeline import (
    DEFAULT_LIMITS,
    DecodeBudget,
    ImagePreparer,
    PreparedImage,
    ResizeMode,
    prepare_image,
    sample_image_bytes,
)
from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.engine.api import Engine, EngineError, ErrorCode
from vlm_server.frontend import images, received
from vlm_server.frontend.images import ImageCache, ImageResolver, image_preparer
from vlm_server.options.command_line import load_config
from vlm_server.options.table import ServerConfig
from vlm_server.server.main import serve


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


def test_attached_bytes_stand_for_the_field_in_their_own_task_only() -> None:
    """A door attaches a large picture beside its message instead of setting it (each set or
    read of the field copies it); the resolver takes it from there, and no other task sees it."""

    async def run() -> None:
        with ThreadPoolExecutor(2) as pool:
            resolver = ImageResolver(DEFAULT_LIMITS, ImageCache(64 << 20), pool)
            message = pb.QueryRequest(question="q")
            assert await resolver.resolve(message) is None

            async def other_task() -> object:
                return received.attached(message)

            received.attach(message, "image_bytes", sample_image_bytes())
            assert received.image_field(message) == "image_bytes"
            assert received.attached(pb.QueryRequest(question="q")) is None  # another message
            image = await resolver.resolve(message)
            assert image is not None and image.width > 0
            # A task started afterwards sees it (a copy of this context); one of its own not.
            assert await asyncio.create_task(other_task()) is not None
            assert await asyncio.create_task(other_task(), context=contextvars.Context()) is None
            received.attach(message, "image_bytes", b"\xff" * 10)
            with pytest.raises(Exception, match="image_bytes"):
                await resolver.resolve(message)  # not a picture: refused, naming the field

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


def test_bad_images_are_invalid_argument_naming_the_field() -> None:
    async def run() -> None:
        with ThreadPoolExecutor(2) as pool:
            preparer = ImagePreparer(DEFAULT_LIMITS, budget=DecodeBudget(1000))
            resolver = ImageResolver(DEFAULT_LIMITS, ImageCache(64 << 20), pool, preparer)
            with pytest.raises(EngineError) as info:
                await resolver.decode(sample_image_bytes(), field="image_bytes")
            assert info.value.code is ErrorCode.INVALID_ARGUMENT
            assert info.value.field == "image_bytes"
            assert str(info.value).startswith("image_bytes: over_decode_budget:")

    asyncio.run(run())


def test_server_config_builds_the_image_path() -> None:
    config = load_config(
        [
            "--image-resize",
            "pillow",
            "--image-device",
            "cpu",
            "--image-reduced-decode",
            "false",
            "--image-decode-budget",
            "64MiB",
            "--max-image-pixels-per-byte",
            "0",
        ],
        environ={},
    )
    preparer = image_preparer(config)
    assert preparer.resize is ResizeMode.PILLOW and preparer.device.type == "cpu"
    assert not preparer.reduced_decode and preparer.budget.capacity == 64 << 20
    assert preparer.limits.max_image_pixels_per_byte is None
    assert image_preparer(ServerConfig()).resize is ResizeMode.VIPS
    with pytest.raises(ValueError):
        ServerConfig(image_resize="bilinear")


def _host_decoder(data: bytes, device: torch.device) -> torch.Tensor:
    raise AssertionError("not called here")


def test_gpu_decode_flag_reaches_the_preparer(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    asked: list[tuple[torch.device, str]] = []

    def decoder_for(device: torch.device, kind: str) -> object:
        asked.append((device, kind))
        return _host_decoder

    monkeypatch.setattr(images, "gpu_decoder", decoder_for)
    on_cuda = image_preparer(
        ServerConfig(image_device="cuda:1", image_gpu_decode_min_pixels=2_000_000)
    )
    assert asked == [(torch.device("cuda:1"), "auto")]
    image_preparer(
        ServerConfig(
            image_device="cuda", image_gpu_decode_min_pixels=1, image_gpu_decoder="nvimgcodec"
        )
    )
    assert asked[1] == (torch.device("cuda"), "nvimgcodec")
    del asked[1]
    assert on_cuda.gpu_decoder is _host_decoder and on_cuda.gpu_decode_min_pixels == 2_000_000
    # Off, or crops made on the CPU: no GPU decoder is looked for.
    assert image_preparer(ServerConfig(image_device="cuda")).gpu_decoder is None
    assert "image-gpu-decode" not in caplog.text
    on_cpu = image_preparer(ServerConfig(image_device="cpu", image_gpu_decode_min_pixels=1))
    assert on_cpu.gpu_decoder is None and len(asked) == 1
    assert "--image-gpu-decode-min-pixels has no effect: images are cropped on cpu" in caplog.text


def _unavailable(device: torch.device, kind: str) -> object:
    raise RuntimeError("torchvision cannot be imported (No module named 'torchvision')")


def test_gpu_decode_without_torchvision_is_refused_naming_the_flag(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(images, "gpu_decoder", _unavailable)
    config = ServerConfig(image_device="cuda", image_gpu_decode_min_pixels=1_000_000)
    said = r"--image-gpu-decode-min-pixels 1000000 with --image-gpu-decoder auto: torchvision"
    with pytest.raises(ValueError, match=said):
        image_preparer(config)


def test_server_without_torchvision_for_gpu_decode_does_not_start(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(images, "gpu_decoder", _unavailable)
    config = ServerConfig(
        image_device="cuda", image_gpu_decode_min_pixels=1, port=0, http_port=0, metrics_port=0
    )

    def no_engine() -> Engine:
        raise AssertionError("the server must stop before loading a model")

    with caplog.at_level(logging.ERROR):
        assert asyncio.run(serve(config, no_engine)) == 1
    said = "cannot start: --image-gpu-decode-min-pixels 1 with --image-gpu-decoder auto: torch"
    assert said in caplog.text


def test_concurrent_requests_with_the_same_new_bytes_share_one_decode() -> None:
    calls: list[int] = []

    async def run() -> None:
        with ThreadPoolExecutor(4) as pool:
            preparer = CountingPreparer(calls)
            resolver = ImageResolver(DEFAULT_LIMITS, ImageCache(64 << 20), pool, preparer)
            data = sample_image_bytes()
            images = await asyncio.gather(*(resolver.decode(data) for _ in range(5)))
            assert len(calls) == 1 and all(image is images[0] for image in images)
            # Bad bytes: every waiter gets the error, naming its own field.
            bad = b"\xff\xd8\xff" + b"junk" * 10
            results = await asyncio.gather(
                resolver.decode(bad, field="a"),
                resolver.decode(bad, field="b"),
                return_exceptions=True,
            )
            assert [str(r).split(":")[0] for r in results] == ["a", "b"]
            assert all(isinstance(r, EngineError) for r in results)
            assert not resolver._decoding

    asyncio.run(run())
