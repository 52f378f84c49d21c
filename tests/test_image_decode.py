"""Decoding untrusted bytes: formats, EXIF orientation, colour modes, limits, errors."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import pickle
import random
import struct
import tracemalloc
import zlib

import numpy as np
import pytest
from PIL import GifImagePlugin, Image, ImageDraw

from image_pipeline import (
    DEFAULT_TILING,
    ImageError,
    ImageErrorReason,
    ImageLimits,
    decode,
    decode_image,
    exif_orientation,
    prepare_image,
    to_rgb,
)
from image_pipeline.decode import read_header

R = ImageErrorReason


def encode(image: Image.Image, fmt: str, **params: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **params)
    return buffer.getvalue()


def noise_image(width: int = 64, height: int = 48, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def blocks_image(width: int = 64, height: int = 48) -> Image.Image:
    """Few flat colours: survives GIF palettes and lossy codecs recognisably."""
    image = Image.new("RGB", (width, height), (200, 200, 200))
    draw = ImageDraw.Draw(image)
    draw.rectangle([0, 0, width // 2 - 1, height // 2 - 1], fill=(255, 0, 0))
    draw.rectangle([width // 2, height // 2, width - 1, height - 1], fill=(0, 0, 255))
    return image


def png_chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))


def png_with_declared_size(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims ``width x height`` RGB pixels."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + png_chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + png_chunk(b"IEND", b"")
    )


def reason_of(data: bytes, limits: ImageLimits | None = None) -> ImageErrorReason:
    with pytest.raises(ImageError) as info:
        decode_image(data, limits or ImageLimits())
    return info.value.reason


# ---------------------------------------------------------------- formats


LOSSLESS = [
    ("PNG", {}),
    ("BMP", {}),
    ("TIFF", {}),
    ("TIFF", {"compression": "tiff_lzw"}),
    ("WEBP", {"lossless": True}),
]


@pytest.mark.parametrize(("fmt", "params"), LOSSLESS, ids=lambda v: str(v))
def test_lossless_formats_roundtrip_exactly(fmt: str, params: dict) -> None:
    original = noise_image()
    decoded = decode_image(encode(original, fmt, **params))
    assert decoded.mode == "RGB" and decoded.size == (64, 48)
    np.testing.assert_array_equal(np.asarray(decoded), np.asarray(original))


@pytest.mark.parametrize(
    ("fmt", "params"),
    [("JPEG", {"quality": 95}), ("WEBP", {"quality": 95}), ("GIF", {})],
)
def test_lossy_formats_decode(fmt: str, params: dict) -> None:
    original = blocks_image()
    decoded = decode_image(encode(original, fmt, **params))
    assert decoded.mode == "RGB" and decoded.size == (64, 48)
    diff = np.abs(np.asarray(decoded, dtype=int) - np.asarray(original, dtype=int))
    assert diff.mean() < 4


def test_mpo_is_accepted_as_jpeg() -> None:
    data = encode(blocks_image(), "MPO", save_all=True, append_images=[noise_image()])
    assert Image.open(io.BytesIO(data)).format == "MPO"
    assert decode_image(data).size == (64, 48)


def test_animated_gif_with_many_frames_gives_first_frame_fast() -> None:
    frames = [Image.new("P", (32, 32), i % 256) for i in range(400)]
    for frame in frames:
        frame.putpalette([c for i in range(256) for c in (i, 255 - i, 7)])
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    # Fast because only the first frame is read: no frame beyond it is ever sought (work,
    # not wall time, so a busy machine cannot fail it).
    seen: list[int] = []
    original = GifImagePlugin.GifImageFile._seek

    def counting(self: GifImagePlugin.GifImageFile, frame: int, *args: object) -> None:
        seen.append(frame)
        original(self, frame, *args)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(GifImagePlugin.GifImageFile, "_seek", counting)
        decoded = decode_image(data)
    assert max(seen, default=0) == 0
    assert np.all(np.asarray(decoded) == (0, 255, 7))


def test_multipage_tiff_gives_first_page() -> None:
    pages = [Image.new("RGB", (16, 16), (i, 2 * i, 3 * i)) for i in range(1, 30)]
    data = encode(pages[0], "TIFF", save_all=True, append_images=pages[1:])
    assert np.all(np.asarray(decode_image(data)) == (1, 2, 3))


def test_animated_webp_gives_first_frame() -> None:
    frames = [Image.new("RGB", (16, 16), c) for c in [(250, 0, 0), (0, 250, 0), (0, 0, 250)]]
    data = encode(frames[0], "WEBP", save_all=True, append_images=frames[1:], lossless=True)
    assert np.all(np.asarray(decode_image(data)) == (250, 0, 0))


@pytest.mark.parametrize("fmt", ["PPM", "TGA", "ICO", "PCX", "AVIF", "JPEG2000", "PDF"])
def test_other_formats_are_unsupported(fmt: str) -> None:
    try:
        data = encode(blocks_image(), fmt)
    except (KeyError, OSError):
        pytest.skip(f"this Pillow cannot write {fmt}")
    assert reason_of(data) == R.UNSUPPORTED_FORMAT


# ---------------------------------------------------------------- EXIF orientation

# Inverse of each orientation's display transform: how to store an upright picture.
STORE = {
    1: None,
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_90,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_270,
}


def upright_marker_image() -> Image.Image:
    """96 wide, 48 high: red marker top-left, blue marker top-right, grey elsewhere."""
    image = Image.new("RGB", (96, 48), (128, 128, 128))
    draw = ImageDraw.Draw(image)
    draw.rectangle([0, 0, 23, 23], fill=(255, 0, 0))
    draw.rectangle([72, 0, 95, 23], fill=(0, 0, 255))
    return image


def exif_with_orientation(orientation: int) -> Image.Exif:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif


def assert_upright(decoded: Image.Image) -> None:
    assert decoded.size == (96, 48)
    pixels = np.asarray(decoded, dtype=int)
    assert np.abs(pixels[12, 12] - (255, 0, 0)).max() < 40
    assert np.abs(pixels[12, 84] - (0, 0, 255)).max() < 40
    assert np.abs(pixels[36, 48] - (128, 128, 128)).max() < 40


@pytest.mark.parametrize("orientation", range(1, 9))
def test_jpeg_exif_orientation(orientation: int) -> None:
    upright = upright_marker_image()
    stored = upright if STORE[orientation] is None else upright.transpose(STORE[orientation])
    data = encode(stored, "JPEG", quality=95, exif=exif_with_orientation(orientation).tobytes())
    decoded = decode(data)
    assert (decoded.width, decoded.height) == (96, 48)
    assert_upright(decoded.image)
    # The orientation is consumed: nothing downstream may rotate again.
    assert exif_orientation(decoded.image) == 1


@pytest.mark.parametrize("orientation", [3, 6, 8])
@pytest.mark.parametrize("fmt", ["PNG", "WEBP", "TIFF"])
def test_exif_orientation_in_other_containers(fmt: str, orientation: int) -> None:
    upright = upright_marker_image()
    stored = upright.transpose(STORE[orientation])
    exif = exif_with_orientation(orientation)
    if fmt == "TIFF":
        data = encode(stored, fmt, tiffinfo={0x0112: orientation})
    elif fmt == "WEBP":
        data = encode(stored, fmt, lossless=True, exif=exif.tobytes())
    else:
        data = encode(stored, fmt, exif=exif)
    assert_upright(decode_image(data))


def test_xmp_orientation_is_honoured_like_exif_transpose() -> None:
    from PIL import PngImagePlugin

    stored = upright_marker_image().transpose(STORE[6])
    info = PngImagePlugin.PngInfo()
    info.add_itxt("XML:com.adobe.xmp", '<x:xmpmeta><rdf:Description tiff:Orientation="6"/>')
    assert_upright(decode_image(encode(stored, "PNG", pnginfo=info)))


@pytest.mark.parametrize("orientation", [0, 9, 255])
def test_invalid_orientation_is_ignored(orientation: int) -> None:
    upright = upright_marker_image()
    data = encode(upright, "JPEG", quality=95, exif=exif_with_orientation(orientation).tobytes())
    assert_upright(decode_image(data))


def test_corrupt_exif_block_does_not_reject_the_image() -> None:
    data = encode(upright_marker_image(), "JPEG", quality=95, exif=b"Exif\x00\x00II*\x00\xff\xff")
    assert_upright(decode_image(data))


# ---------------------------------------------------------------- colour modes


def test_alpha_is_dropped_not_composited() -> None:
    rgba = Image.new("RGBA", (8, 8), (10, 20, 30, 0))  # fully transparent
    for fmt in ["PNG", "TIFF", "WEBP"]:
        params = {"lossless": True, "exact": True} if fmt == "WEBP" else {}
        decoded = np.asarray(decode_image(encode(rgba, fmt, **params)))
        assert np.all(decoded == (10, 20, 30)), fmt
    la = Image.new("LA", (8, 8), (77, 0))
    assert np.all(np.asarray(decode_image(encode(la, "PNG"))) == 77)


def test_palette_with_transparency() -> None:
    image = Image.new("P", (8, 8), 1)
    image.putpalette([255, 0, 0, 0, 255, 0] + [0, 0, 0] * 254)
    for fmt, params in [("PNG", {"transparency": 1}), ("GIF", {"transparency": 1})]:
        decoded = decode_image(encode(image, fmt, **params))
        assert np.all(np.asarray(decoded) == (0, 255, 0)), fmt


def test_palette_without_transparency() -> None:
    image = Image.new("P", (8, 8), 0)
    image.putpalette([12, 34, 56] * 256)
    for fmt in ["PNG", "GIF", "BMP", "TIFF"]:
        assert np.all(np.asarray(decode_image(encode(image, fmt))) == (12, 34, 56)), fmt


def test_bilevel_and_grey() -> None:
    bilevel = Image.new("1", (8, 8), 1)
    for fmt in ["PNG", "BMP", "TIFF"]:
        assert np.all(np.asarray(decode_image(encode(bilevel, fmt))) == 255), fmt
    grey = Image.new("L", (8, 8), 99)
    for fmt in ["PNG", "BMP", "TIFF", "JPEG"]:
        assert np.all(np.abs(np.asarray(decode_image(encode(grey, fmt)), dtype=int) - 99) <= 1)


def test_cmyk() -> None:
    cmyk = Image.new("CMYK", (8, 8), (0, 255, 255, 0))  # red
    for fmt in ["JPEG", "TIFF"]:
        decoded = np.asarray(decode_image(encode(cmyk, fmt)), dtype=int)
        assert np.abs(decoded - (255, 0, 0)).max() <= 3, fmt


def test_ycbcr_and_lab_tiff() -> None:
    red = Image.new("RGB", (8, 8), (255, 0, 0))
    data = encode(red.convert("YCbCr"), "TIFF")
    try:
        Image.open(io.BytesIO(data)).load()
    except OSError:
        pytest.skip("this Pillow cannot read back its own YCbCr TIFF")
    decoded = decode_image(data)
    assert np.abs(np.asarray(decoded, dtype=int) - (255, 0, 0)).max() <= 3
    lab = to_rgb(Image.new("LAB", (2, 2), (255, 128, 128)))  # L=100, a=b=0: white
    assert np.all(np.asarray(lab) >= 250)


SIXTEEN_BIT = np.array([[0, 257, 32896, 65535], [128, 129, 1000, 65000]], dtype=np.uint16)
SIXTEEN_BIT_EXPECTED = np.rint(SIXTEEN_BIT / 257.0).astype(np.uint8)


@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
def test_16_bit_grey_is_scaled_not_clipped(fmt: str) -> None:
    image = Image.fromarray(SIXTEEN_BIT)
    assert image.mode == "I;16"
    data = encode(image, fmt)
    assert Image.open(io.BytesIO(data)).mode.startswith("I;16")
    decoded = np.asarray(decode_image(data))
    for channel in range(3):
        np.testing.assert_array_equal(decoded[..., channel], SIXTEEN_BIT_EXPECTED)


def test_16_bit_big_endian_mode() -> None:
    image = Image.fromarray(SIXTEEN_BIT.astype(">u2"))
    assert image.mode == "I;16B"
    np.testing.assert_array_equal(np.asarray(to_rgb(image))[..., 1], SIXTEEN_BIT_EXPECTED)


def test_16_bit_rgb_png_keeps_colours() -> None:
    # Pillow decodes 16-bit RGB PNG to 8-bit RGB itself; check it stays sensible.
    raw = np.zeros((2, 2, 3), dtype=">u2")
    raw[..., 0] = 65535
    raw[..., 2] = 32896
    rows = b"".join(b"\x00" + raw[y].tobytes() for y in range(2))
    data = (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", struct.pack(">IIBBBBB", 2, 2, 16, 2, 0, 0, 0))
        + png_chunk(b"IDAT", zlib.compress(rows))
        + png_chunk(b"IEND", b"")
    )
    decoded = np.asarray(decode_image(data), dtype=int)
    assert np.abs(decoded - (255, 0, 128)).max() <= 1


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([0, 100, 255], [0, 100, 255]),  # 8-bit data stored as 32-bit
        ([0, 257, 65535], [0, 1, 255]),  # 16-bit range
        ([-1000, 0, 1000], [0, 128, 255]),  # anything else: stretched
    ],
)
def test_32_bit_integer_grey(values: list[int], expected: list[int]) -> None:
    image = Image.fromarray(np.array([values], dtype=np.int32))
    assert image.mode == "I"
    np.testing.assert_array_equal(
        np.asarray(decode_image(encode(image, "TIFF")))[0, :, 0], expected
    )


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([0.0, 0.5, 1.0], [0, 128, 255]),  # unit range
        ([0.0, 2.0, 255.0], [0, 2, 255]),  # 8-bit range
        ([-1.0, 0.0, 1.0], [0, 128, 255]),  # anything else: stretched
        ([float("nan"), 0.0, 1000.0], [0, 0, 255]),
        ([5.0, 5.0, 5.0], [5, 5, 5]),
        ([1e9, 1e9, 1e9], [0, 0, 0]),
    ],
)
def test_float_grey(values: list[float], expected: list[int]) -> None:
    image = Image.fromarray(np.array([values], dtype=np.float32))
    assert image.mode == "F"
    np.testing.assert_array_equal(
        np.asarray(decode_image(encode(image, "TIFF")))[0, :, 0], expected
    )


@pytest.mark.parametrize(
    "mode",
    [
        *["1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX"],
        *["CMYK", "YCbCr", "LAB", "HSV", "I", "I;16", "I;16B", "I;16L", "F"],
    ],
)
def test_to_rgb_handles_every_mode(mode: str) -> None:
    converted = to_rgb(Image.new(mode, (5, 3)))
    assert converted.mode == "RGB" and converted.size == (5, 3)


def test_premultiplied_alpha_is_unpremultiplied_then_dropped() -> None:
    assert np.asarray(to_rgb(Image.new("La", (1, 1), (100, 128))))[0, 0].tolist() == [199] * 3
    rgba = to_rgb(Image.new("RGBa", (1, 1), (100, 50, 20, 128)))
    assert np.asarray(rgba)[0, 0].tolist() == [199, 99, 39]


# ---------------------------------------------------------------- limits and errors


def test_empty_input() -> None:
    assert reason_of(b"") == R.EMPTY
    assert reason_of(bytearray()) == R.EMPTY


def test_too_many_bytes() -> None:
    data = encode(noise_image(), "PNG")
    assert reason_of(data, ImageLimits(max_image_bytes=len(data) - 1)) == R.TOO_LARGE_BYTES
    assert decode_image(data, ImageLimits(max_image_bytes=len(data))).size == (64, 48)


@pytest.mark.parametrize(
    "data",
    [b"\x00", b"hello world" * 10, bytes(range(256)) * 4, b"%PDF-1.4\n", b"<svg></svg>"],
)
def test_garbage_is_unsupported(data: bytes) -> None:
    assert reason_of(data) == R.UNSUPPORTED_FORMAT


@pytest.mark.parametrize(
    "data",
    [
        b"\xff\xd8\xff",
        b"\x89PNG\r\n\x1a\n",
        b"GIF89a",
        b"BM",
        b"II*\x00",
        b"RIFF\x00\x00\x00\x00WEBP",
    ],
)
def test_bare_magic_is_corrupt(data: bytes) -> None:
    assert reason_of(data) == R.CORRUPT


@pytest.mark.parametrize(
    ("fmt", "params"),
    [
        ("JPEG", {}),
        ("JPEG", {"progressive": True}),
        ("PNG", {}),
        ("GIF", {}),
        ("BMP", {}),
        ("TIFF", {}),
        ("WEBP", {}),
        ("WEBP", {"lossless": True}),
    ],
    ids=lambda v: str(v),
)
@pytest.mark.parametrize("keep", [0.3, 0.6, 0.95])
def test_truncated_files_are_corrupt(fmt: str, params: dict, keep: float) -> None:
    data = encode(noise_image(96, 64), fmt, **params)
    assert reason_of(data[: int(len(data) * keep)]) == R.CORRUPT


def test_png_with_corrupt_pixel_data() -> None:
    ihdr = struct.pack(">IIBBBBB", 16, 16, 8, 2, 0, 0, 0)
    data = (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + png_chunk(b"IDAT", b"this is not zlib data at all")
        + png_chunk(b"IEND", b"")
    )
    assert reason_of(data) == R.CORRUPT


def test_png_with_bad_checksum() -> None:
    data = bytearray(encode(noise_image(), "PNG"))
    data[40] ^= 0xFF  # inside IDAT
    assert reason_of(bytes(data)) == R.CORRUPT


def test_decompression_bomb_is_refused_from_the_header() -> None:
    # 100000 x 100000 RGB would need 30 GB. Refused without allocating it.
    data = png_with_declared_size(100_000, 100_000)
    tracemalloc.start()
    try:
        assert reason_of(data) == R.TOO_MANY_PIXELS
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 5_000_000  # nothing decoded: that is what made it fast


def test_a_bomb_beyond_pillows_guard_is_refused_with_the_servers_limit() -> None:
    """Pillow refuses first (beyond twice its MAX_IMAGE_PIXELS) with its own number; the
    refusal states the limit the client can act on (--max-image-pixels), not Pillow's."""
    data = png_with_declared_size(20_000, 20_000)
    limits = ImageLimits(max_image_pixels=12_000_000)
    with pytest.raises(ImageError) as info:
        decode_image(data, limits)
    assert info.value.reason is R.TOO_MANY_PIXELS
    assert "12000000" in info.value.message and "178956970" not in info.value.message
    assert "400000000 pixels" in info.value.message


def test_pixel_limit_below_pillows_own_guard() -> None:
    # 64 MP: below Pillow's bomb guard, above our default 50 MP.
    data = png_with_declared_size(8000, 8000)
    tracemalloc.start()
    try:
        assert reason_of(data) == R.TOO_MANY_PIXELS
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 5_000_000


def test_pillows_guard_still_maps_to_too_many_pixels() -> None:
    # Our limit allows it, Pillow's unchanged global guard does not.
    limits = ImageLimits(max_image_pixels=10**12, max_image_side=None)
    assert reason_of(png_with_declared_size(100_000, 100_000), limits) == R.TOO_MANY_PIXELS


def test_gif_with_huge_logical_screen() -> None:
    data = bytearray(encode(blocks_image(16, 16), "GIF"))
    data[6:10] = struct.pack("<HH", 60_000, 60_000)
    assert reason_of(bytes(data)) == R.TOO_MANY_PIXELS


def test_custom_pixel_limit() -> None:
    data = encode(noise_image(100, 100), "PNG")
    assert reason_of(data, ImageLimits(max_image_pixels=9_999)) == R.TOO_MANY_PIXELS
    assert decode_image(data, ImageLimits(max_image_pixels=10_000)).size == (100, 100)


def test_side_limits() -> None:
    tall = png_with_declared_size(1, 40_000)  # few pixels, absurd side
    assert reason_of(tall) == R.TOO_LARGE_SIDE
    thin = encode(Image.new("RGB", (1, 5)), "PNG")
    assert decode_image(thin).size == (1, 5)
    assert reason_of(thin, ImageLimits(min_image_side=2)) == R.TOO_SMALL
    assert (
        reason_of(encode(noise_image(), "PNG"), ImageLimits(max_image_side=63)) == R.TOO_LARGE_SIDE
    )


def test_non_bytes_input_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        decode_image("not bytes")  # type: ignore[arg-type]


def test_memoryview_and_bytearray_inputs() -> None:
    data = encode(noise_image(), "PNG")
    expected = np.asarray(decode_image(data))
    np.testing.assert_array_equal(np.asarray(decode_image(bytearray(data))), expected)
    np.testing.assert_array_equal(np.asarray(decode_image(memoryview(data))), expected)


@pytest.mark.parametrize(
    ("fmt", "params"),
    [
        ("JPEG", {}),
        ("PNG", {}),
        ("GIF", {}),
        ("BMP", {}),
        ("TIFF", {}),
        ("TIFF", {"compression": "tiff_deflate"}),
        ("WEBP", {}),
    ],
    ids=lambda v: str(v),
)
@pytest.mark.filterwarnings("ignore::UserWarning")  # Pillow's notes about the broken files
def test_mutated_files_never_raise_anything_but_image_error(fmt: str, params: dict) -> None:
    original = encode(noise_image(40, 30), fmt, **params)
    rng = random.Random(f"{fmt}{params}")
    for _ in range(60):
        data = bytearray(original)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.3:
            data = data[: rng.randrange(1, len(data))]
        with contextlib.suppress(ImageError):
            prepare_image(bytes(data))


# ---------------------------------------------------------------- ImageLimits / ImageError


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"max_image_bytes": 0}, ValueError),
        ({"max_image_pixels": -1}, ValueError),
        ({"min_image_side": 0}, ValueError),
        ({"max_image_side": 0}, ValueError),
        ({"min_image_side": 10, "max_image_side": 5}, ValueError),
        ({"min_image_side": 100, "max_image_pixels": 9_999}, ValueError),
        ({"max_image_bytes": 1.5}, TypeError),
        ({"max_image_pixels": True}, TypeError),
        ({"max_image_side": "big"}, TypeError),
    ],
)
def test_limits_validation(kwargs: dict, error: type[Exception]) -> None:
    with pytest.raises(error):
        ImageLimits(**kwargs)


def test_limits_defaults_and_frozen() -> None:
    limits = ImageLimits()
    assert limits.max_image_bytes == 32 * 1024 * 1024
    assert limits.max_image_pixels == 50_000_000
    assert ImageLimits(max_image_side=None).max_image_side is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        limits.max_image_bytes = 1  # type: ignore[misc]


def test_read_header_checks_limits_and_reads_the_jpeg_orientation_before_decoding() -> None:
    data = encode(noise_image(64, 48), "JPEG", exif=exif_with_orientation(6).tobytes())
    header = read_header(data)
    assert (header.orientation, header.stored_size, header.size) == (6, (48, 64), (64, 48))
    assert header.is_jpeg and header.plain_jpeg and header.nbytes == len(data)
    assert (header.decode_cost(), header.decode_cost(2)) == (64 * 48 * 3, 32 * 24 * 3)
    np.testing.assert_array_equal(decode(data, header=header).pixels, decode(data).pixels)
    # Other containers: the orientation comes with the pixels, Pillow's modes cost more.
    png = read_header(encode(noise_image(64, 48), "PNG", exif=exif_with_orientation(6)))
    assert png.orientation == 1 and not png.is_jpeg and png.decode_cost() == 64 * 48 * 8
    assert decode(encode(noise_image(64, 48), "PNG", exif=exif_with_orientation(6))).width == 48
    with pytest.raises(ImageError) as info:
        read_header(data, ImageLimits(max_image_pixels=64 * 48 - 1))
    assert info.value.reason is R.TOO_MANY_PIXELS


def test_image_error_carries_reason_and_pickles() -> None:
    error = ImageError(R.TOO_SMALL, "image is 1x1")
    assert str(error) == "image is 1x1"
    assert error.reason == "too_small" and isinstance(error.reason, str)
    clone = pickle.loads(pickle.dumps(error))
    assert (clone.reason, clone.message) == (R.TOO_SMALL, "image is 1x1")
    assert ImageError("corrupt", "x").reason is R.CORRUPT  # type: ignore[arg-type]


# ---------------------------------------------------------------- reduced-scale JPEG decoding


def photo_like(width: int, height: int) -> Image.Image:
    """Smooth gradients plus a few shapes: like a photo, cheap to make."""
    w, h = width // 8, height // 8
    y = np.linspace(0, 1, h, dtype=np.float32)[:, None]
    x = np.linspace(0, 1, w, dtype=np.float32)[None, :]
    pixels = np.stack(
        [255 * x * np.ones_like(y), 255 * y * np.ones_like(x), 128 + 100 * np.sin(8 * x + 5 * y)],
        axis=-1,
    )
    small = Image.fromarray(pixels.astype(np.uint8))
    image = small.resize((width, height), Image.Resampling.BILINEAR)
    draw = ImageDraw.Draw(image)
    for k in range(6):
        x0, y0 = width * k // 7, height * ((k * 3) % 5) // 6
        draw.ellipse([x0, y0, x0 + width // 8, y0 + height // 8], fill=(255, 255 - 40 * k, 0))
    return image


@pytest.fixture(scope="module")
def big_jpeg() -> bytes:
    return encode(photo_like(4000, 3000), "JPEG", quality=90)


def test_large_jpeg_is_decoded_at_reduced_scale(big_jpeg: bytes) -> None:
    reduced = prepare_image(big_jpeg)
    full = prepare_image(big_jpeg, reduced_decode=False)
    assert (reduced.width, reduced.height) == (full.width, full.height) == (4000, 3000)
    assert reduced.tiling == full.tiling == (2, 4)
    # Canvas 644x1176: 1/2 scale (1500x2000) still covers it, 1/4 would not.
    assert reduced.decoded_size == (1500, 2000)
    assert full.decoded_size == (3000, 4000)
    diff = np.abs(reduced.crops.numpy().astype(int) - full.crops.numpy().astype(int))
    assert diff.mean() < 1.5
    assert reduced.content_hash != full.content_hash
    assert prepare_image(big_jpeg).content_hash == reduced.content_hash
    # Faster because a quarter of the pixels are decoded (decoded_size above): work, not
    # wall time, which a busy machine makes noise of.


def test_reduced_scale_respects_exif_rotation() -> None:
    # Stored 6000 wide x 2000 high, displayed rotated: 2000 wide x 6000 high.
    # Upright tiling 5x2, canvas 1442x644 (h x w); in stored orientation that is
    # 644 high x 1442 wide, so 1/2 scale (3000x1000 stored) is the right choice.
    # Ignoring the rotation would ask for 1442 of the stored 2000 rows: no reduction.
    stored = photo_like(6000, 2000)
    data = encode(stored, "JPEG", quality=85, exif=exif_with_orientation(6).tobytes())
    reduced = prepare_image(data)
    full = prepare_image(data, reduced_decode=False)
    assert (reduced.width, reduced.height) == (2000, 6000)
    assert reduced.tiling == full.tiling == DEFAULT_TILING.tiling_for(6000, 2000) == (5, 2)
    assert reduced.decoded_size == (3000, 1000)
    diff = np.abs(reduced.crops.numpy().astype(int) - full.crops.numpy().astype(int))
    assert diff.mean() < 1.5


@pytest.mark.parametrize(
    ("size", "decoded"),
    [
        ((1820, 1820), (910, 910)),  # canvas 910x910: exactly half still covers it
        ((1819, 1819), (1819, 1819)),  # half would be 910 wide but the rule needs 1819 // 910 >= 2
        ((1400, 1400), (1400, 1400)),
        ((3000, 1000), (1000, 3000)),  # tiling 2x5, canvas 644x1442: 1/2 is too short
        ((8000, 6000), (1500, 2000)),  # tiling 3x3, canvas 910x910: 1/4 (1/8 is too small)
    ],
)
def test_reduced_scale_never_goes_below_the_canvas(
    size: tuple[int, int], decoded: tuple[int, int]
) -> None:
    width, height = size
    data = encode(Image.new("RGB", size, (90, 60, 30)), "JPEG", quality=80)
    prepared = prepare_image(data)
    assert prepared.decoded_size == decoded
    canvas_h, canvas_w = DEFAULT_TILING.canvas_size(prepared.tiling)
    assert prepared.decoded_size[0] >= canvas_h and prepared.decoded_size[1] >= canvas_w
    assert prepared.tiling == DEFAULT_TILING.tiling_for(height, width)


def test_non_jpeg_is_never_reduced() -> None:
    data = encode(Image.new("RGB", (2000, 1500), (1, 2, 3)), "PNG")
    assert prepare_image(data).decoded_size == (1500, 2000)
