"""Untrusted picture bytes, generated: small pictures in every format the server reads (JPEG
plain, progressive, grey, CMYK and with EXIF orientation, PNG with and without alpha, GIF,
WebP, BMP, TIFF), then bytes flipped, cut short, spliced or overwritten. Decoding either gives
upright RGB pixels of the size the header promised (turned at most), or raises `ImageError`
with a reason and a message; never another exception. Examples are derandomized: the same
bytes every run."""

from __future__ import annotations

import io
from functools import cache

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from image_pipeline.decode import decode, read_header
from image_pipeline.errors import ImageError
from image_pipeline.limits import ImageLimits

LIMITS = ImageLimits(max_image_pixels=4_000_000, max_image_side=4096)


@cache
def _pictures() -> tuple[bytes, ...]:
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (24, 40, 3), dtype=np.uint8))
    rgba = Image.fromarray(rng.integers(0, 256, (20, 16, 4), dtype=np.uint8), "RGBA")
    out = []
    for image, fmt, kw in [
        (rgb, "JPEG", {"quality": 80}),
        (rgb, "JPEG", {"progressive": True}),
        (rgb.convert("L"), "JPEG", {}),
        (rgb.convert("CMYK"), "JPEG", {}),
        (rgb, "PNG", {}),
        (rgba, "PNG", {}),
        (rgb.convert("P"), "GIF", {}),
        (rgb, "WEBP", {"quality": 60}),
        (rgb, "BMP", {}),
        (rgb, "TIFF", {}),
    ]:
        buf = io.BytesIO()
        image.save(buf, format=fmt, **kw)
        out.append(buf.getvalue())
    turned = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotated 90 degrees
    rgb.save(turned, format="JPEG", exif=exif.tobytes())
    out.append(turned.getvalue())
    return tuple(out)


@st.composite
def _mangled(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(_pictures())))
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        kind = draw(st.sampled_from(["flip", "cut", "splice", "overwrite"]))
        if not data:
            break
        at = draw(st.integers(min_value=0, max_value=len(data) - 1))
        if kind == "flip":
            data[at] ^= 1 << draw(st.integers(min_value=0, max_value=7))
        elif kind == "cut":
            del data[at:]
        elif kind == "splice":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        else:
            chunk = draw(st.binary(min_size=1, max_size=8))
            data[at : at + len(chunk)] = chunk
    return bytes(data)


@pytest.mark.filterwarnings("ignore::UserWarning")  # Pillow's notes on the corrupt EXIF made
@settings(
    max_examples=1000,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=_mangled() | st.binary(max_size=64))
def test_mangled_pictures_decode_or_raise_an_image_error(data: bytes) -> None:
    try:
        header = read_header(data, LIMITS)
        out = decode(data, LIMITS, header=header)
    except ImageError as err:
        assert err.reason and str(err)
        return
    assert out.pixels.dtype == np.uint8 and out.pixels.ndim == 3 and out.pixels.shape[2] == 3
    assert out.pixels.shape[:2] == (out.height, out.width)
    # The header's upright size; a PNG's orientation can come after its pixels, turning it.
    assert sorted((out.height, out.width)) == sorted(header.size)


@pytest.mark.parametrize("index", range(11))
def test_every_unmangled_picture_decodes(index: int) -> None:
    data = _pictures()[index]
    out = decode(data, LIMITS)
    assert out.pixels.shape[2] == 3 and min(out.width, out.height) >= 16
