"""Image preprocessing for Moondream 2: decode untrusted bytes, tile, normalize.

Typical use::

    prepared = prepare_image(data)            # ImageError on bad input
    pixels = prepared.normalized(device="cuda")  # [N, 3, 378, 378] bfloat16
"""

from .decode import (
    ACCEPTED_FORMATS,
    DecodedImage,
    decode,
    decode_image,
    exif_orientation,
    to_rgb,
    upright_rgb,
)
from .errors import ImageError, ImageErrorReason
from .limits import DEFAULT_LIMITS, ImageLimits
from .normalize import normalize_crops
from .prepared import PreparedImage, content_hash, prepare_decoded, prepare_image, prepare_pil
from .sample import sample_image, sample_image_bytes
from .tiling import DEFAULT_TILING, TilingSpec, overlap_crop, select_tiling

__all__ = [
    "ACCEPTED_FORMATS",
    "DEFAULT_LIMITS",
    "DEFAULT_TILING",
    "DecodedImage",
    "ImageError",
    "ImageErrorReason",
    "ImageLimits",
    "PreparedImage",
    "TilingSpec",
    "content_hash",
    "decode",
    "decode_image",
    "exif_orientation",
    "normalize_crops",
    "overlap_crop",
    "prepare_decoded",
    "prepare_image",
    "prepare_pil",
    "sample_image",
    "sample_image_bytes",
    "select_tiling",
    "to_rgb",
    "upright_rgb",
]
