"""Overlap-crop tiling (spec section 2, "Image crops").

An image becomes one squashed global crop plus ``h_t * w_t`` local crops cut from
the image resized to a canvas of ``(h_t*window + 2*margin) x (w_t*window + 2*margin)``
pixels. Neighbouring local crops overlap by ``2*margin`` pixels so the encoder's
features can be stitched back without seams.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from .limits import check_int

__all__ = ["DEFAULT_TILING", "TilingSpec", "cut_local_crops", "overlap_crop", "select_tiling"]

Tiling = tuple[int, int]

# The reference resizes with libvips when pyvips is importable and with Pillow LANCZOS
# otherwise. `overlap_crop` here is the Pillow one, bit-exact with the reference's
# fallback; the server makes its crops in torch (`crops.make_crops`), replicating
# either resizer bit for bit, and tests them against this function and pyvips.
RESAMPLE = Image.Resampling.LANCZOS


@dataclass(frozen=True, slots=True)
class TilingSpec:
    """Crop geometry. Defaults are Moondream 2's: 378 px crops of 14 px patches.

    Attributes:
        crop_size: side of every crop in pixels.
        patch_size: encoder patch side in pixels.
        overlap_margin: margin per side, in patches, shared with neighbouring tiles.
        max_crops: budget of local crops used by :func:`select_tiling`.
    """

    crop_size: int = 378
    patch_size: int = 14
    overlap_margin: int = 4
    max_crops: int = 12

    def __post_init__(self) -> None:
        check_int("crop_size", self.crop_size, 1)
        check_int("patch_size", self.patch_size, 1)
        check_int("overlap_margin", self.overlap_margin, 0)
        check_int("max_crops", self.max_crops, 1)
        if self.crop_size % self.patch_size:
            raise ValueError("crop_size must be a multiple of patch_size")
        if self.grid <= 2 * self.overlap_margin:
            raise ValueError("overlap margins leave no window inside a crop")

    @property
    def grid(self) -> int:
        """Patches per crop side (27)."""
        return self.crop_size // self.patch_size

    @property
    def margin_px(self) -> int:
        """Overlap margin per side in pixels (56)."""
        return self.overlap_margin * self.patch_size

    @property
    def window(self) -> int:
        """Stride between local crops, the part a tile owns alone (266)."""
        return (self.grid - 2 * self.overlap_margin) * self.patch_size

    @property
    def window_patches(self) -> int:
        """Window in patches (19)."""
        return self.grid - 2 * self.overlap_margin

    def tiling_for(self, height: int, width: int) -> Tiling:
        """Tiling ``(h_t, w_t)`` for an image of ``height x width`` pixels."""
        margins = 2 * self.margin_px
        return select_tiling(height - margins, width - margins, self.window, self.max_crops)

    def canvas_size(self, tiling: Tiling) -> tuple[int, int]:
        """``(height, width)`` the image is resized to before local crops are cut."""
        h_t, w_t = tiling
        margins = 2 * self.margin_px
        return h_t * self.window + margins, w_t * self.window + margins

    def feature_grid(self, tiling: Tiling) -> tuple[int, int]:
        """Size in patches of the stitched local feature map (for 3x3: 65x65)."""
        h_t, w_t = tiling
        margins = 2 * self.overlap_margin
        return h_t * self.window_patches + margins, w_t * self.window_patches + margins

    def num_crops(self, tiling: Tiling) -> int:
        """Global crop plus local crops."""
        return 1 + tiling[0] * tiling[1]


DEFAULT_TILING = TilingSpec()


def select_tiling(height: int, width: int, patch_window: int = 266, max_crops: int = 12) -> Tiling:
    """Choose ``(h_tiles, w_tiles)`` for a content area of ``height x width`` pixels.

    The arguments are the image size *minus both margins* (see
    :meth:`TilingSpec.tiling_for`). Follows the spec step by step, including its
    float arithmetic, so results match the reference for every size.

    Note: when an extremely elongated image needs more than ``max_crops`` windows,
    the short side is clamped up to 1 tile and the long side can then exceed the
    budget (e.g. 288 x 7888 gives (1, 13)). This is the reference behaviour.
    """
    if height <= patch_window or width <= patch_window:
        return 1, 1

    min_h = math.ceil(height / patch_window)
    min_w = math.ceil(width / patch_window)

    if min_h * min_w > max_crops:
        ratio = math.sqrt(max_crops / (min_h * min_w))
        return max(1, math.floor(min_h * ratio)), max(1, math.floor(min_w * ratio))

    h_tiles = math.floor(math.sqrt(max_crops * height / width))
    w_tiles = math.floor(math.sqrt(max_crops * width / height))
    h_tiles = max(h_tiles, min_h)
    w_tiles = max(w_tiles, min_w)

    if h_tiles * w_tiles > max_crops:
        if w_tiles > h_tiles:
            w_tiles = math.floor(max_crops / h_tiles)
        else:
            h_tiles = math.floor(max_crops / w_tiles)

    return max(1, h_tiles), max(1, w_tiles)


def cut_local_crops(canvas: np.ndarray, tiling: Tiling, spec: TilingSpec) -> np.ndarray:
    """Cut ``h_t * w_t`` crops in row-major order from a ``[H, W, 3]`` uint8 canvas.

    Windows that run past the canvas are zero-padded (only possible when the
    canvas is smaller than :meth:`TilingSpec.canvas_size`).
    """
    h_t, w_t = tiling
    size, step = spec.crop_size, spec.window
    out = np.zeros((h_t * w_t, size, size, canvas.shape[2]), dtype=np.uint8)
    for i in range(h_t):
        for j in range(w_t):
            window = canvas[i * step : i * step + size, j * step : j * step + size]
            out[i * w_t + j, : window.shape[0], : window.shape[1]] = window
    return out


def overlap_crop(
    image: Image.Image | np.ndarray,
    spec: TilingSpec = DEFAULT_TILING,
    tiling: Tiling | None = None,
) -> tuple[np.ndarray, Tiling]:
    """Make the global + local crops of an RGB image.

    Args:
        image: RGB PIL image or ``[H, W, 3]`` uint8 array.
        spec: crop geometry.
        tiling: tiling to use; by default chosen from the image size. Pass it when
            ``image`` is a reduced-size decode of a larger original, so the tiling
            stays the one of the original.

    Returns:
        ``(crops, tiling)`` with crops a C-contiguous uint8 array
        ``[1 + h_t*w_t, crop, crop, 3]``; index 0 is the global crop (squashed,
        aspect ratio not kept), index ``1 + i*w_t + j`` the local crop at row i,
        column j.
    """
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise ValueError("expected a [H, W, 3] uint8 array")
        image = Image.fromarray(image)
    if image.mode != "RGB":
        raise ValueError(f"expected an RGB image, got mode {image.mode!r}")
    if tiling is None:
        tiling = spec.tiling_for(image.height, image.width)

    size = spec.crop_size
    canvas_h, canvas_w = spec.canvas_size(tiling)
    crops = np.empty((spec.num_crops(tiling), size, size, 3), dtype=np.uint8)
    crops[0] = np.asarray(image.resize((size, size), RESAMPLE))
    canvas = np.asarray(image.resize((canvas_w, canvas_h), RESAMPLE))
    crops[1:] = cut_local_crops(canvas, tiling, spec)
    return crops, tiling
