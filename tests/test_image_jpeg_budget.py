"""The simplejpeg path equals Pillow's decode; the decode budget and the pixels-per-byte rule."""

from __future__ import annotations

import importlib
import io
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image, ImageOps

from image_pipeline import (
    DecodeBudget,
    ImageError,
    ImageErrorReason,
    ImageLimits,
    ImagePreparer,
    decode,
)
from image_pipeline.jpeg import draft_scale, orient, try_decode_jpeg

R = ImageErrorReason
# The package exports a function named like the module: fetch the module itself.
decode_mod = importlib.import_module("image_pipeline.decode")


def photo(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    rows = np.arange(height)[:, None, None]
    cols = np.arange(width)[None, :, None]
    base = 120 + 80 * np.sin(rows / 9.0 + cols / 13.0) + rng.normal(0, 25, (height, width, 3))
    return Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))


def jpeg(image: Image.Image, **params: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", **params)
    return buffer.getvalue()


def pillow_pixels(data: bytes, draft: tuple[int, int] | None = None) -> np.ndarray:
    image = Image.open(io.BytesIO(data))
    if draft is not None:
        image.draft(None, draft)
    return np.asarray(ImageOps.exif_transpose(image).convert("RGB"))


JPEGS = {
    "420": {"quality": 85},
    "422": {"quality": 90, "subsampling": 1},
    "444": {"quality": 95, "subsampling": 0},
    "progressive": {"quality": 80, "progressive": True},
    "restart_markers": {"quality": 80, "restart_marker_blocks": 3},
}


@pytest.mark.parametrize("params", JPEGS.values(), ids=JPEGS.keys())
def test_simplejpeg_decodes_exactly_like_pillow(params: dict) -> None:
    data = jpeg(photo(333, 251), **params)
    pixels = try_decode_jpeg(data, 333, 251, 1)
    assert pixels is not None  # the fast path was taken, not the fallback
    np.testing.assert_array_equal(pixels, pillow_pixels(data))
    np.testing.assert_array_equal(decode(data).pixels, pillow_pixels(data))


def test_grey_jpeg_becomes_rgb_like_pillow() -> None:
    data = jpeg(photo(200, 150).convert("L"))
    assert try_decode_jpeg(data, 200, 150, 1) is not None
    np.testing.assert_array_equal(decode(data).pixels, pillow_pixels(data))


@pytest.mark.parametrize("scale", [2, 4, 8])
def test_reduced_scale_equals_pillows_draft(scale: int) -> None:
    width, height = 1601, 1203  # odd sizes: the scaled size rounds up
    data = jpeg(photo(width, height, seed=scale))
    need = (width // scale, height // scale)
    assert draft_scale(width, height, *need) == scale
    pixels = try_decode_jpeg(data, width, height, scale)
    assert pixels is not None
    np.testing.assert_array_equal(pixels, pillow_pixels(data, draft=need))


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientations_equal_pillows_exif_transpose(orientation: int) -> None:
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = jpeg(photo(120, 70, seed=orientation), exif=exif.tobytes())
    decoded = decode(data)
    expected = pillow_pixels(data)
    np.testing.assert_array_equal(decoded.pixels, expected)
    assert (decoded.height, decoded.width) == expected.shape[:2]


# What each orientation displays, as a numpy view of the stored pixels.
ORIENTED_VIEWS = {
    1: lambda p: p,
    2: lambda p: p[:, ::-1],
    3: lambda p: p[::-1, ::-1],
    4: lambda p: p[::-1],
    5: lambda p: p.transpose(1, 0, 2),
    6: lambda p: p.transpose(1, 0, 2)[:, ::-1],
    7: lambda p: p.transpose(1, 0, 2)[::-1, ::-1],
    8: lambda p: p.transpose(1, 0, 2)[::-1],
}


@pytest.mark.parametrize("orientation", range(1, 9))
def test_orient_copies_the_views_into_the_given_array(orientation: int) -> None:
    pixels = np.random.default_rng(orientation).integers(0, 256, (37, 53, 3), dtype=np.uint8)
    expected = np.ascontiguousarray(ORIENTED_VIEWS[orientation](pixels))
    given: list[np.ndarray] = []

    def alloc(shape: tuple[int, int, int]) -> np.ndarray:
        given.append(np.full(shape, 7, dtype=np.uint8))
        return given[-1]

    for out in (orient(pixels, orientation), orient(pixels, orientation, alloc)):
        assert out.flags.c_contiguous and out.dtype == np.uint8
        np.testing.assert_array_equal(out, expected)
    if orientation == 1:
        assert not given and orient(pixels, 1, alloc) is pixels  # nothing to copy
    else:
        assert len(given) == 1 and orient(pixels, orientation, alloc) is given[-1]


def test_oriented_jpeg_lands_in_the_allocated_array() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6
    data = jpeg(photo(120, 70, seed=6), exif=exif.tobytes())
    given: list[np.ndarray] = []

    def alloc(shape: tuple[int, int, int]) -> np.ndarray:
        given.append(np.empty(shape, dtype=np.uint8))
        return given[-1]

    decoded = decode(data, alloc=alloc)
    assert len(given) == 1 and decoded.pixels is given[0]
    np.testing.assert_array_equal(decoded.pixels, pillow_pixels(data))


def test_jpeg_with_decoder_warnings_falls_back_to_pillow() -> None:
    data = jpeg(photo(64, 48))
    # Junk between two markers: libjpeg warns "extraneous bytes"; Pillow decodes anyway.
    sos = data.index(b"\xff\xda")
    odd = data[:sos] + b"\x00\x00\x00" + data[sos:]
    assert try_decode_jpeg(odd, 64, 48, 1) is None
    np.testing.assert_array_equal(decode(odd).pixels, pillow_pixels(odd))


def test_truncated_jpeg_is_still_refused_as_corrupt() -> None:
    data = jpeg(photo(300, 200))
    with pytest.raises(ImageError) as info:
        decode(data[: len(data) // 2])
    assert info.value.reason is R.CORRUPT


# ---------------------------------------------------------------- pixels per byte


def flat_png(width: int, height: int, mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, (width, height)).save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def black_rgb_png(width: int, height: int) -> bytes:
    """A valid all-black RGB PNG, compressed row by row (no full-size buffer)."""

    def chunk(tag: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(tag + body)
        return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", crc)

    packer = zlib.compressobj(9)
    row = bytes(1 + 3 * width)
    idat = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def test_decompression_amplification_is_refused_before_decoding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = black_rgb_png(7000, 7000)  # the hardening report's case: ~143 KB, 49 MP
    assert len(data) < 200_000
    loads = []
    monkeypatch.setattr(Image.Image, "load", lambda self: loads.append(1))
    with pytest.raises(ImageError) as info:
        decode(data)
    assert info.value.reason is R.TOO_COMPRESSED and not loads
    assert "max_image_pixels_per_byte" in info.value.message


def test_ratio_rule_is_a_limit_that_can_be_turned_off() -> None:
    data = flat_png(4500, 4500, "L")  # 20 MP of nothing in a few KB
    with pytest.raises(ImageError) as info:
        decode(data)
    assert info.value.reason is R.TOO_COMPRESSED
    decoded = decode(data, ImageLimits(max_image_pixels_per_byte=None))
    assert decoded.pixels.shape == (4500, 4500, 3)


def test_small_flat_images_are_exempt_from_the_ratio_rule() -> None:
    data = flat_png(1920, 1080)  # 2 MP screenshot of nothing: under image_free_pixels
    assert decode(data).pixels.shape == (1080, 1920, 3)
    with pytest.raises(ImageError) as info:
        decode(data, ImageLimits(image_free_pixels=0))
    assert info.value.reason is R.TOO_COMPRESSED


def test_ratio_limits_are_validated() -> None:
    with pytest.raises(ValueError):
        ImageLimits(max_image_pixels_per_byte=0)
    with pytest.raises(ValueError):
        ImageLimits(image_free_pixels=-1)


# ---------------------------------------------------------------- decode budget


def test_an_image_larger_than_the_whole_budget_is_refused() -> None:
    data = jpeg(photo(400, 300))
    preparer = ImagePreparer(budget=DecodeBudget(400 * 300 * 3 - 1))
    with pytest.raises(ImageError) as info:
        preparer.prepare(data)
    assert info.value.reason is R.OVER_DECODE_BUDGET
    assert "image_decode_budget" in info.value.message
    assert ImagePreparer(budget=DecodeBudget(400 * 300 * 3)).prepare(data).num_crops == 2


def test_budget_bounds_decoded_bytes_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    budget = DecodeBudget(2 * 400 * 300 * 3)  # room for two decodes at a time
    active = []
    lock = threading.Lock()
    real = decode_mod.try_decode_jpeg
    # Decodes meet in pairs: two must be in flight together (a budget of one would break
    # the barrier), whatever the machine's speed; the budget keeps a third out.
    pairs = threading.Barrier(2, timeout=30)

    def slow(*args: object) -> object:
        with lock:
            active.append(budget.in_flight)
        pairs.wait()
        return real(*args)

    monkeypatch.setattr(decode_mod, "try_decode_jpeg", slow)
    data = jpeg(photo(400, 300))
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda _: decode(data, budget=budget), range(12)))
    assert all(r.pixels.shape == (300, 400, 3) for r in results)
    assert budget.peak == 2 * 400 * 300 * 3  # two ran together, never three
    assert max(active) <= budget.capacity and budget.in_flight == 0


def test_budget_is_released_when_decoding_fails() -> None:
    budget = DecodeBudget(10 << 20)
    data = jpeg(photo(300, 200))
    for _ in range(3):
        with pytest.raises(ImageError):
            decode(data[: len(data) // 2], budget=budget)
    assert budget.in_flight == 0


def test_budget_validates_capacity() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError):
            DecodeBudget(bad)  # type: ignore[arg-type]


def test_decoder_writes_into_the_callers_array() -> None:
    data = jpeg(photo(320, 240))
    arrays = []

    def alloc(shape: tuple[int, int, int]) -> np.ndarray:
        arrays.append(np.empty(shape, dtype=np.uint8))
        return arrays[-1]

    decoded = decode(data, alloc=alloc)
    assert len(arrays) == 1 and decoded.pixels is arrays[0]
    np.testing.assert_array_equal(decoded.pixels, pillow_pixels(data))
