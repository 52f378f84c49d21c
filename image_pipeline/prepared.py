"""The main entry point: bytes in, uint8 crops + metadata out."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from PIL import Image

from .decode import DecodedImage, check_size, decode, upright_rgb
from .errors import ImageError, ImageErrorReason
from .limits import DEFAULT_LIMITS, ImageLimits
from .normalize import normalize_crops
from .tiling import DEFAULT_TILING, Tiling, TilingSpec, overlap_crop

__all__ = ["PreparedImage", "content_hash", "prepare_decoded", "prepare_image", "prepare_pil"]


@dataclass(frozen=True, slots=True, eq=False)
class PreparedImage:
    """Crops of one image, ready for the vision encoder.

    Attributes:
        crops: uint8 ``[1 + h_t*w_t, crop, crop, 3]``, C-contiguous, on the CPU.
            Index 0 is the global crop, then local crops in row-major order.
            Treat it as read-only: it may be shared through a cache.
        tiling: ``(h_t, w_t)``.
        content_hash: SHA-256 hex of the pixels the crops were made from (see
            :func:`content_hash`); usable as a cache key together with the tiling
            spec.
        width, height: size of the upright original image.
        decoded_size: ``(height, width)`` of the pixels actually resized; smaller
            than the original when a large JPEG was decoded at reduced scale.
    """

    crops: torch.Tensor
    tiling: Tiling
    content_hash: str
    width: int
    height: int
    decoded_size: tuple[int, int]

    @property
    def num_crops(self) -> int:
        """``1 + h_t * w_t``."""
        return self.crops.shape[0]

    def normalized(
        self, dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """Crops as ``[N, 3, H, W]`` in [-1, 1]; see :func:`normalize_crops`."""
        return normalize_crops(self.crops, dtype=dtype, device=device)


def content_hash(image: Image.Image, original_size: tuple[int, int] | None = None) -> str:
    """SHA-256 hex of an RGB image's pixels and shape.

    The shape is hashed with the pixels, so a different size never gives the same
    digest, and the container the pixels came in plays no part. ``original_size``
    ``(height, width)`` marks a reduced-scale decode: its digest then differs from
    any full-size image's, since the same picture decoded at full size would give
    other pixels.
    """
    if image.mode != "RGB":
        raise ValueError(f"expected an RGB image, got mode {image.mode!r}")
    header = f"rgb8 {image.height}x{image.width}"
    if original_size is not None and original_size != (image.height, image.width):
        header += f" reduced-from {original_size[0]}x{original_size[1]}"
    digest = hashlib.sha256(header.encode("ascii") + b"\n")
    digest.update(image.tobytes())
    return digest.hexdigest()


def prepare_decoded(decoded: DecodedImage, tiling: TilingSpec = DEFAULT_TILING) -> PreparedImage:
    """Crop an already decoded image. The tiling follows the original size."""
    tiles = tiling.tiling_for(decoded.height, decoded.width)
    crops, _ = overlap_crop(decoded.image, tiling, tiles)
    image = decoded.image
    return PreparedImage(
        crops=torch.from_numpy(crops),
        tiling=tiles,
        content_hash=content_hash(image, (decoded.height, decoded.width)),
        width=decoded.width,
        height=decoded.height,
        decoded_size=(image.height, image.width),
    )


def prepare_image(
    data: bytes,
    limits: ImageLimits = DEFAULT_LIMITS,
    tiling: TilingSpec = DEFAULT_TILING,
    *,
    reduced_decode: bool = True,
) -> PreparedImage:
    """Decode untrusted image bytes and cut the encoder crops.

    Large JPEGs are decoded at a reduced DCT scale (1/2, 1/4, 1/8) when the
    result still covers the local canvas (and the global crop) in both
    dimensions; the tiling is always chosen from the original size. Set
    ``reduced_decode=False`` to always decode at full size.

    Thread-safe: no shared mutable state.

    Raises:
        ImageError: for any problem with the data itself.
    """

    def canvas_for(height: int, width: int) -> tuple[int, int]:
        canvas_h, canvas_w = tiling.canvas_size(tiling.tiling_for(height, width))
        return max(canvas_h, tiling.crop_size), max(canvas_w, tiling.crop_size)

    decoded = decode(data, limits, target=canvas_for if reduced_decode else None)
    return prepare_decoded(decoded, tiling)


def prepare_pil(
    image: Image.Image,
    limits: ImageLimits = DEFAULT_LIMITS,
    tiling: TilingSpec = DEFAULT_TILING,
) -> PreparedImage:
    """Like :func:`prepare_image` for an image that is already a Pillow object.

    The EXIF orientation, if the image still has one, is applied and every mode
    is converted as in :func:`decode_image`; the caller's image is not modified.
    Size limits apply (the byte limit cannot). Not safe to call concurrently on
    the same lazily loaded image object.
    """
    if not isinstance(image, Image.Image):
        raise TypeError(f"expected a PIL image, got {type(image).__name__}")
    check_size(image.width, image.height, limits)
    try:
        image.load()
        rgb = upright_rgb(image)
    except ImageError:
        raise
    except Exception as exc:
        raise ImageError(ImageErrorReason.CORRUPT, f"cannot read image: {exc}") from exc
    decoded = DecodedImage(image=rgb, width=rgb.width, height=rgb.height)
    return prepare_decoded(decoded, tiling)
