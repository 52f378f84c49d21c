"""Decoding untrusted image bytes into oriented RGB Pillow images.

Accepted containers: JPEG (and MPO, the multi-picture JPEG variant cameras
write), PNG, WebP, GIF, BMP and TIFF. Animated or multi-page files give their
first frame. The EXIF orientation is applied (``ImageOps.exif_transpose``
semantics; the reference model code ignores it).

Colour handling (why it differs from a bare ``convert("RGB")``):

* alpha (LA, PA, RGBA, P with transparency, ...) is dropped, keeping the colour
  stored under it, exactly like the reference's ``convert("RGB")``;
* 16-bit grey (``I;16*``) is scaled by 255/65535 with rounding; Pillow's own
  conversion clips everything above 255 to white;
* 32-bit integer grey (``I``): values within 0..255 are used as they are, values
  within 0..65535 are scaled like 16-bit, anything else is stretched min..max;
* float grey (``F``): values within 0..1 are scaled by 255, values within 0..255
  are used as they are, anything else is stretched min..max; NaN becomes 0;
* CMYK uses Pillow's plain conversion; embedded ICC profiles are ignored, as in
  the reference.

Nothing here touches Pillow's global settings: ``LOAD_TRUNCATED_IMAGES`` stays
off, so truncated files are refused, and ``MAX_IMAGE_PIXELS`` is left alone.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# Importing the plugins registers them with Pillow at import time, instead of
# lazily (and concurrently) inside the first Image.open calls of worker threads.
from PIL import (
    BmpImagePlugin,  # noqa: F401
    ExifTags,
    GifImagePlugin,  # noqa: F401
    Image,
    JpegImagePlugin,  # noqa: F401
    PngImagePlugin,  # noqa: F401
    TiffImagePlugin,  # noqa: F401
    UnidentifiedImageError,
    WebPImagePlugin,  # noqa: F401
)

from .budget import DecodeBudget, reserve
from .errors import ImageError, ImageErrorReason
from .jpeg import Allocator, draft_scale, orient, try_decode_jpeg
from .limits import DEFAULT_LIMITS, ImageLimits
from .sniff import check_structure

__all__ = [
    "ACCEPTED_FORMATS",
    "DecodedImage",
    "Header",
    "check_size",
    "decode",
    "decode_image",
    "exif_orientation",
    "read_header",
    "sniff_format",
    "to_rgb",
    "upright_rgb",
]

ACCEPTED_FORMATS: tuple[str, ...] = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
_JPEG_FORMATS = frozenset({"JPEG", "MPO"})

# EXIF orientation value -> the transpose that displays the image upright.
_TRANSPOSES: dict[int, Image.Transpose] = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_SWAPS_AXES = frozenset({5, 6, 7, 8})

_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\xff\xd8\xff", "JPEG"),
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"II+\x00", "TIFF"),  # BigTIFF
    (b"MM\x00+", "TIFF"),
)

# Target size callback: oriented (height, width) of the original -> the smallest
# (height, width) the caller needs; used to decide on reduced-size JPEG decoding.
TargetFn = Callable[[int, int], tuple[int, int]]


@dataclass(frozen=True, slots=True, eq=False)
class DecodedImage:
    """Oriented RGB pixels plus the oriented size of the original.

    ``pixels`` (uint8 ``[h, w, 3]``, C-contiguous) is smaller than ``width x height``
    when a large JPEG was decoded at reduced scale.
    """

    pixels: np.ndarray
    width: int
    height: int

    @property
    def image(self) -> Image.Image:
        """The pixels as a Pillow image (a copy)."""
        return Image.fromarray(self.pixels)

    @property
    def decoded_size(self) -> tuple[int, int]:
        """``(height, width)`` of ``pixels``."""
        return self.pixels.shape[0], self.pixels.shape[1]

    @property
    def reduced(self) -> bool:
        """True when ``pixels`` is a reduced-scale decode."""
        return self.decoded_size != (self.height, self.width)


def sniff_format(data: bytes) -> str | None:
    """Accepted format name suggested by the leading magic bytes, if any."""
    head = bytes(data[:16])
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    for magic, name in _MAGIC:
        if head.startswith(magic):
            return name
    return None


def _bomb(exc: Exception, limits: ImageLimits) -> ImageError:
    """Pillow's own bomb guard fired (beyond twice its MAX_IMAGE_PIXELS): say it in terms of
    this server's limit, not Pillow's."""
    found = re.search(r"\((\d+) pixels\)", str(exc))
    pixels = f"{int(found.group(1))} pixels" if found else "more pixels than Pillow opens"
    return ImageError(
        ImageErrorReason.TOO_MANY_PIXELS,
        f"image has {pixels}; the limit is {limits.max_image_pixels}",
    )


def check_size(
    width: int, height: int, limits: ImageLimits, encoded_bytes: int | None = None
) -> None:
    """Raise :class:`ImageError` if a (declared) image size breaks ``limits``.

    With ``encoded_bytes``, also the ratio rule: pixels beyond ``limits.image_free_pixels``
    need one encoded byte per ``limits.max_image_pixels_per_byte`` pixels.
    """
    if width < limits.min_image_side or height < limits.min_image_side:
        raise ImageError(
            ImageErrorReason.TOO_SMALL,
            f"image is {width}x{height}; each side must be at least {limits.min_image_side} px",
        )
    if width * height > limits.max_image_pixels:
        raise ImageError(
            ImageErrorReason.TOO_MANY_PIXELS,
            f"image is {width}x{height} = {width * height} pixels; "
            f"the limit is {limits.max_image_pixels}",
        )
    if limits.max_image_side is not None and max(width, height) > limits.max_image_side:
        raise ImageError(
            ImageErrorReason.TOO_LARGE_SIDE,
            f"image is {width}x{height}; each side must be at most {limits.max_image_side} px",
        )
    ratio = limits.max_image_pixels_per_byte
    if encoded_bytes is not None and ratio is not None:
        allowed = limits.image_free_pixels + ratio * encoded_bytes
        if width * height > allowed:
            raise ImageError(
                ImageErrorReason.TOO_COMPRESSED,
                f"image is {width}x{height} = {width * height} pixels from {encoded_bytes} "
                f"bytes; beyond {limits.image_free_pixels} pixels each byte may carry at most "
                f"{ratio} pixels (max_image_pixels_per_byte)",
            )


def exif_orientation(image: Image.Image) -> int:
    """EXIF orientation (1..8) of ``image``; 1 when absent, invalid or unreadable.

    A broken EXIF block should not make an otherwise good picture fail, so any
    error while parsing it counts as "no orientation".
    """
    try:
        value = image.getexif().get(ExifTags.Base.Orientation, 1)
    except Exception:
        return 1
    return value if isinstance(value, int) and value in _TRANSPOSES else 1


def _stretch(values: np.ndarray) -> np.ndarray:
    """Linearly map min..max of the finite values to 0..255."""
    finite = np.isfinite(values)
    if not finite.any():
        return np.zeros(values.shape, dtype=np.uint8)
    lo = float(values[finite].min())
    hi = float(values[finite].max())
    if hi <= lo:
        return np.zeros(values.shape, dtype=np.uint8)
    out = (np.nan_to_num(values, nan=lo, posinf=hi, neginf=lo) - lo) * (255.0 / (hi - lo))
    return np.rint(out).astype(np.uint8)


def _wide_grey_to_uint8(image: Image.Image) -> np.ndarray:
    """Scale a 16-bit, 32-bit integer or float grey image to uint8 (see module doc)."""
    mode = image.mode
    arr = np.asarray(image)
    if mode.startswith("I;16"):
        # round(v * 255 / 65535) through a table: no large temporaries for big images.
        table = ((np.arange(65536, dtype=np.uint32) * 255 + 32767) // 65535).astype(np.uint8)
        return table[arr.astype(np.uint16, copy=False)]
    if mode == "I":
        lo, hi = int(arr.min()), int(arr.max())
        if lo >= 0 and hi <= 255:
            return arr.astype(np.uint8)
        if lo >= 0 and hi <= 65535:
            return ((arr.astype(np.uint32) * 255 + 32767) // 65535).astype(np.uint8)
        return _stretch(arr.astype(np.float64))
    # mode "F"
    values = arr.astype(np.float32)
    finite = np.isfinite(values)
    if finite.all():
        lo, hi = float(values.min()), float(values.max())
        if lo >= 0.0 and hi <= 1.0:
            return np.rint(values * 255.0).astype(np.uint8)
        if lo >= 0.0 and hi <= 255.0:
            return np.rint(values).astype(np.uint8)
    return _stretch(values)


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert any Pillow mode to 8-bit RGB (see the module doc for the rules).

    Returns ``image`` itself when it is already RGB.
    """
    mode = image.mode
    if mode == "RGB":
        return image
    if mode.startswith("I;16") or mode in ("I", "F"):
        return Image.fromarray(_wide_grey_to_uint8(image)).convert("RGB")
    try:
        return image.convert("RGB")
    except (ValueError, OSError):
        pass
    # Rare modes without a direct path (e.g. premultiplied "La") go through a
    # mode with straight alpha first.
    for via in ("RGBA", "LA"):
        try:
            return image.convert(via).convert("RGB")
        except (ValueError, OSError):
            continue
    raise ImageError(
        ImageErrorReason.UNSUPPORTED_MODE, f"cannot convert pixel mode {mode!r} to RGB"
    )


def upright_rgb(image: Image.Image, orientation: int | None = None) -> Image.Image:
    """RGB version of a loaded image with its EXIF orientation applied.

    ``orientation`` overrides the one read from the image. Returns ``image``
    itself when nothing has to change.
    """
    if orientation is None:
        orientation = exif_orientation(image)
    rgb = to_rgb(image)
    method = _TRANSPOSES.get(orientation)
    return rgb if method is None else rgb.transpose(method)


@dataclass(frozen=True, slots=True, eq=False)
class Header:
    """An image whose header passed every limit; no pixel decoded yet.

    Both decoding paths start here (the host decoders of :func:`decode` and the GPU JPEG
    path of the preparer), so each image meets the same checks before any decoding.

    Attributes:
        image: Pillow's lazily opened image (header read, pixels not loaded).
        nbytes: encoded size.
        orientation: EXIF orientation (1..8) of a JPEG, which keeps EXIF in a header
            segment; 1 for other formats, whose orientation is read after loading.
    """

    image: Image.Image
    nbytes: int
    orientation: int

    @property
    def is_jpeg(self) -> bool:
        """JPEG or MPO (the multi-picture JPEG variant cameras write)."""
        return self.image.format in _JPEG_FORMATS

    @property
    def plain_jpeg(self) -> bool:
        """A YCbCr or grey JPEG: what simplejpeg decodes (CMYK and others go to Pillow)."""
        return self.is_jpeg and self.image.mode in ("RGB", "L")

    @property
    def stored_size(self) -> tuple[int, int]:
        """``(height, width)`` as stored, before the orientation."""
        return self.image.height, self.image.width

    @property
    def size(self) -> tuple[int, int]:
        """``(height, width)`` upright (the JPEG orientation applied)."""
        return _oriented(self.image.height, self.image.width, self.orientation)

    def decode_cost(self, scale: int = 1) -> int:
        """Bytes a decode at ``1/scale`` reserves from the decode budget."""
        width, height = self.image.size
        per_pixel = _bytes_per_pixel(self.image, self.plain_jpeg)
        return -(-width // scale) * -(-height // scale) * per_pixel


def read_header(data: bytes, limits: ImageLimits = DEFAULT_LIMITS) -> Header:
    """Open (header only), check byte and size limits, read a JPEG's orientation.

    Raises:
        ImageError: for any problem with the data itself.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"data must be bytes-like, got {type(data).__name__}")
    size = memoryview(data).nbytes
    if size == 0:
        raise ImageError(ImageErrorReason.EMPTY, "image data is empty")
    if size > limits.max_image_bytes:
        raise ImageError(
            ImageErrorReason.TOO_LARGE_BYTES,
            f"image data is {size} bytes; the limit is {limits.max_image_bytes}",
        )
    check_structure(data)  # before Pillow's byte-by-byte header readers (sniff.py)
    try:
        image = Image.open(io.BytesIO(data), formats=list(ACCEPTED_FORMATS))
    except Image.DecompressionBombError as exc:
        raise _bomb(exc, limits) from exc
    except UnidentifiedImageError as exc:
        kind = sniff_format(data)
        if kind is None:
            raise ImageError(
                ImageErrorReason.UNSUPPORTED_FORMAT,
                "not a supported image format (accepted: JPEG, PNG, WebP, GIF, BMP, TIFF)",
            ) from exc
        raise ImageError(
            ImageErrorReason.CORRUPT, f"data looks like {kind} but cannot be read"
        ) from exc
    except Exception as exc:
        raise ImageError(ImageErrorReason.CORRUPT, f"cannot read image header: {exc}") from exc
    # The header's size is all we have read so far: refuse bombs before decoding.
    check_size(image.width, image.height, limits, size)
    # JPEG keeps EXIF in a header segment: readable before decoding, which the
    # reduced-scale decision and the GPU path need.
    orientation = exif_orientation(image) if image.format in _JPEG_FORMATS else 1
    return Header(image=image, nbytes=size, orientation=orientation)


def _bytes_per_pixel(image: Image.Image, simple_jpeg: bool) -> int:
    """Host bytes per stored pixel while decoding: the decoded mode plus the RGB result."""
    if simple_jpeg:
        return 3
    # Pillow keeps RGB-like modes in 4 bytes; wide grey modes in 2 or 4.
    return 4 + 4


def decode(
    data: bytes,
    limits: ImageLimits = DEFAULT_LIMITS,
    *,
    target: TargetFn | None = None,
    budget: DecodeBudget | None = None,
    alloc: Allocator | None = None,
    header: Header | None = None,
) -> DecodedImage:
    """Decode untrusted bytes into oriented RGB pixels.

    Args:
        data: encoded image.
        limits: byte, pixel, side and ratio limits, checked before pixels are decoded.
        target: optional callback from the oriented original size (height, width)
            to the smallest (height, width) the caller will resize from. When it
            is given, large JPEGs are decoded at a reduced DCT scale whose result
            still covers that size in both dimensions.
        budget: optional bound on decoded bytes in flight across threads; the
            decode waits for its share (see :class:`DecodeBudget`).
        alloc: optional allocator of the upright pixels of the simplejpeg path (the
            decoder's output, or the oriented copy when an orientation applies).
        header: ``read_header(data, limits)`` when the caller has it already.

    Raises:
        ImageError: for any problem with the data itself.
    """
    if header is None:
        header = read_header(data, limits)
    image = header.image
    stored_w, stored_h = image.size  # the header's size, before any reduced decode
    orientation = header.orientation
    scale = 1
    if header.is_jpeg and target is not None:
        # The decoder works in stored orientation: swap the need back.
        need_h, need_w = target(*header.size)
        if orientation in _SWAPS_AXES:
            need_h, need_w = need_w, need_h
        scale = draft_scale(stored_w, stored_h, need_w, need_h)
    # YCbCr and grey JPEGs go to simplejpeg; CMYK and others to Pillow.
    simple = header.plain_jpeg
    cost = header.decode_cost(scale)
    with reserve(budget, cost):
        # The array that ``alloc`` gives receives the final, upright pixels: the decoder's
        # output when nothing turns, else the oriented copy.
        into = alloc if orientation == 1 else None
        pixels = try_decode_jpeg(data, stored_w, stored_h, scale, into) if simple else None
        if pixels is not None:
            pixels = orient(pixels, orientation, alloc)
        else:
            pixels, orientation = _decode_with_pillow(data, limits, image, header.is_jpeg, scale)
    full_h, full_w = _oriented(stored_h, stored_w, orientation)
    return DecodedImage(pixels=pixels, width=full_w, height=full_h)


def _decode_with_pillow(
    data: bytes, limits: ImageLimits, image: Image.Image, is_jpeg: bool, scale: int
) -> tuple[np.ndarray, int]:
    """Pillow's decode of an opened image; returns (oriented RGB pixels, orientation)."""
    try:
        if is_jpeg:
            orientation = exif_orientation(image)
            if scale > 1:
                image.draft(None, (image.width // scale, image.height // scale))
            image.load()
        else:
            # PNG may keep EXIF after the pixel data; load first so it is seen.
            image.load()
            orientation = exif_orientation(image)
        rgb = upright_rgb(image, orientation)
        return np.array(rgb), orientation  # writable: torch.from_numpy wants that
    except ImageError:
        raise
    except Image.DecompressionBombError as exc:
        raise _bomb(exc, limits) from exc
    except MemoryError as exc:
        raise ImageError(ImageErrorReason.CORRUPT, "decoding the image ran out of memory") from exc
    except Exception as exc:
        # Pillow reports bad data as OSError, SyntaxError, ValueError, EOFError,
        # struct.error, zlib.error, ... depending on plugin and where it breaks.
        raise ImageError(ImageErrorReason.CORRUPT, f"cannot decode image: {exc}") from exc


def _oriented(height: int, width: int, orientation: int) -> tuple[int, int]:
    """(height, width) after applying ``orientation``."""
    return (width, height) if orientation in _SWAPS_AXES else (height, width)


def decode_image(data: bytes, limits: ImageLimits = DEFAULT_LIMITS) -> Image.Image:
    """Decode untrusted bytes into a full-size, upright RGB :class:`PIL.Image.Image`.

    Raises:
        ImageError: for any problem with the data itself.
    """
    return Image.fromarray(decode(data, limits).pixels)
