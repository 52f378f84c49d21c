"""Encoded images' structure is checked before any decoder parses them: real files of every
accepted format pass, and hostile headers are refused at once as corrupt, naming what is wrong,
without Pillow ever opening them."""

from __future__ import annotations

import io
import struct

import pytest
from PIL import Image

from image_pipeline import ImageError
from image_pipeline.decode import read_header
from image_pipeline.errors import ImageErrorReason
from image_pipeline.sniff import check_structure
from tests.support.jpegs import encode, photo


@pytest.mark.parametrize(
    ("fmt", "params"),
    [
        ("JPEG", {}),
        ("JPEG", {"progressive": True, "exif": Image.Exif().tobytes()}),
        ("PNG", {}),
        ("GIF", {}),
        ("TIFF", {}),
        ("WEBP", {}),
        ("BMP", {}),
    ],
)
def test_real_files_pass(fmt: str, params: dict[str, object]) -> None:
    data = encode(photo(64, 48), fmt, **params)
    check_structure(data)
    assert read_header(data).image.size == (64, 48)


def _jpeg_with(segments: bytes) -> bytes:
    return b"\xff\xd8" + segments


HOSTILE = [
    ("FF D8 FF then zeros", b"\xff\xd8\xff" + bytes(2_000_000), "FF 00"),
    ("garbage after SOI", b"\xff\xd8" + b"\x00" * 5000, "no marker"),
    ("image data before a frame", _jpeg_with(b"\xff\xda\x00\x08" + bytes(6)), "before any frame"),
    ("a segment longer than the file", _jpeg_with(b"\xff\xe0\xff\xff"), "bad length"),
    ("a run of fill bytes", b"\xff\xd8" + b"\xff" * 100_000, "no marker"),
    ("too many segments", _jpeg_with(b"\xff\xfe\x00\x02" * 5000), "segments"),
    ("a PNG without IHDR", b"\x89PNG\r\n\x1a\n" + struct.pack(">I4s", 0, b"IEND"), "IHDR"),
    (
        "a PNG of endless chunks",
        b"\x89PNG\r\n\x1a\n"
        + struct.pack(">I4s13s4s", 13, b"IHDR", bytes(13), bytes(4))
        + struct.pack(">I4s4s", 0, b"tEXt", bytes(4)) * 5000,
        "chunks",
    ),
    ("a GIF of endless extensions", b"GIF89a" + bytes(7) + b"\x21\xfe\x00" * 5000, "blocks"),
    ("a TIFF directory of 60000 entries", b"II*\x00\x08\x00\x00\x00\x60\xea", "entries"),
]


@pytest.mark.parametrize(("case", "data", "says"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_headers_are_refused_before_pillow_opens_them(
    monkeypatch: pytest.MonkeyPatch, case: str, data: bytes, says: str
) -> None:
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("Pillow was asked to open a hostile header")

    monkeypatch.setattr(Image, "open", never)
    with pytest.raises(ImageError) as caught:
        read_header(data)
    assert caught.value.reason is ImageErrorReason.CORRUPT
    assert says in caught.value.message and "not a valid" in caught.value.message


def test_a_few_stray_bytes_between_segments_are_tolerated() -> None:
    """libjpeg decodes such files (with a warning): so do we."""
    good = encode(photo(32, 24), "JPEG")
    # After the first segment (APP0 or DQT), slip in some garbage.
    length = good[4] << 8 | good[5]
    cut = 4 + length
    data = good[:cut] + b"\x00" * 10 + good[cut:]
    check_structure(data)
    assert Image.open(io.BytesIO(data)).size == (32, 24)
