"""Image preprocessing for Moondream 2: decode untrusted bytes, tile, normalize.

Typical use::

    prepared = prepare_image(data)            # ImageError on bad input
    pixels = prepared.normalized(device="cuda")  # [N, 3, 378, 378] bfloat16

    preparer = ImagePreparer(limits, device="cuda", budget=DecodeBudget(1 << 30))
    prepared = preparer.prepare(data)         # crops made and kept on the GPU

Modules, in data-flow order:

- ``limits``, ``errors``: what is accepted, and the typed refusal (``ImageError``).
- ``decode``: header checks (format, size, ratio, EXIF orientation), then pixels;
  ``jpeg``: the simplejpeg path for JPEG; ``budget``: decoded bytes in flight.
- ``prepared``: ``ImagePreparer``/``prepare_image``: pixels -> hash -> device -> crops.
- ``gpu_jpeg``: optional GPU decode of large JPEGs (the JPEG engines through nvImageCodec,
  or nvJPEG through torchvision), for the preparer; hashed by their encoded bytes. A
  server whose engine runs in its own process keeps such JPEGs encoded (``EncodedImage``)
  and the engine's process decodes them.
- ``crops``: global crop + overlap crops in torch, ``ResizeMode`` (vips | pillow);
  ``crop_graphs``: the crop path as a CUDA graph per picture size seen twice (an engine's).
- ``resample_plan``, ``vips_plan``, ``pillow_plan``: the resizers as integer stages;
  ``resample``: runs them bit-exact as float32 matmuls on any device.
- ``tiling``: crop geometry and the Pillow reference ``overlap_crop``;
  ``normalize``: uint8 crops -> [-1, 1] as the reference does it.
"""

from .budget import DecodeBudget
from .crops import ResizeMode, make_crops
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
from .prepared import (
    EncodedImage,
    HostImage,
    ImagePreparer,
    PreparedImage,
    content_hash,
    prepare_decoded,
    prepare_image,
    prepare_pil,
)
from .sample import sample_image, sample_image_bytes
from .tiling import DEFAULT_TILING, TilingSpec, overlap_crop, select_tiling

__all__ = [
    "ACCEPTED_FORMATS",
    "DEFAULT_LIMITS",
    "DEFAULT_TILING",
    "DecodeBudget",
    "DecodedImage",
    "EncodedImage",
    "HostImage",
    "ImageError",
    "ImageErrorReason",
    "ImageLimits",
    "ImagePreparer",
    "PreparedImage",
    "ResizeMode",
    "TilingSpec",
    "content_hash",
    "decode",
    "decode_image",
    "exif_orientation",
    "make_crops",
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
