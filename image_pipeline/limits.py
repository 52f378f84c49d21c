"""Input limits applied before any pixel is decoded."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_LIMITS", "ImageLimits"]

MIB = 1024 * 1024


def check_int(name: str, value: object, minimum: int) -> None:
    """TypeError unless ``value`` is an int (not a bool), ValueError below ``minimum``."""
    # bool is an int subclass; True as a limit is always a mistake.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """Limits on an uploaded image, checked from the encoded size and the header.

    Attributes:
        max_image_bytes: largest accepted encoded size.
        max_image_pixels: largest accepted ``width * height`` as declared by the header.
            Checked before decoding, so decompression bombs are refused cheaply.
            Pillow's own bomb guard (``2 * Image.MAX_IMAGE_PIXELS``, about 179 MP by
            default) still applies on top of this; it is not changed here.
        min_image_side: smallest accepted width and height.
        max_image_side: largest accepted width and height, or ``None`` for no limit.
        max_image_pixels_per_byte: decompression sanity rule: the pixels beyond
            ``image_free_pixels`` need one encoded byte per this many pixels (``None``: off).
            Real pictures carry a few pixels per byte; a 143 KB PNG declaring
            7000 x 7000 carries 343 and costs seconds and hundreds of MB to decode.
        image_free_pixels: pixels exempt from the ratio rule (flat screenshots compress
            extremely well and are small).
    """

    max_image_bytes: int = 32 * MIB
    max_image_pixels: int = 50_000_000
    min_image_side: int = 1
    max_image_side: int | None = 32_768
    max_image_pixels_per_byte: int | None = 256
    image_free_pixels: int = 4 * MIB

    def __post_init__(self) -> None:
        check_int("max_image_bytes", self.max_image_bytes, 1)
        check_int("max_image_pixels", self.max_image_pixels, 1)
        check_int("min_image_side", self.min_image_side, 1)
        if self.max_image_side is not None:
            check_int("max_image_side", self.max_image_side, self.min_image_side)
        if self.max_image_pixels_per_byte is not None:
            check_int("max_image_pixels_per_byte", self.max_image_pixels_per_byte, 1)
        check_int("image_free_pixels", self.image_free_pixels, 0)
        if self.min_image_side * self.min_image_side > self.max_image_pixels:
            raise ValueError("min_image_side**2 exceeds max_image_pixels: no image could pass")


DEFAULT_LIMITS = ImageLimits()
