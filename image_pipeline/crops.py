"""Global crop and overlap crops in torch, on the device the pixels are on.

The same code runs on the CPU and on a GPU: the global crop and the local canvas are
resized with a resampling plan (:mod:`.resample`), the local crops are windows of the
canvas, all as uint8 ``[N, crop, crop, 3]`` like :func:`.tiling.overlap_crop`.
"""

from __future__ import annotations

from enum import StrEnum

import torch

from .pillow_plan import pillow_resize_plan
from .resample import Resampler
from .resample_plan import Plan
from .tiling import Tiling, TilingSpec
from .vips_plan import vips_resize_plan

__all__ = ["ResizeMode", "make_crops", "resize_plan"]


class ResizeMode(StrEnum):
    """Which resizer the crops replicate bit for bit."""

    VIPS = "vips"  # libvips resize: what the moondream reference runs with pyvips installed
    PILLOW = "pillow"  # Pillow LANCZOS: the reference's fallback, and this project before


def resize_plan(mode: ResizeMode, in_size: tuple[int, int], out_size: tuple[int, int]) -> Plan:
    """The plan resizing ``in_size`` to ``out_size`` (``(height, width)``) the way ``mode`` does.

    libvips is given scale factors, as the reference calls it, and may round the output
    size differently; the caller fits the result to ``out_size``.
    """
    if mode is ResizeMode.VIPS:
        return vips_resize_plan(in_size, (out_size[0] / in_size[0], out_size[1] / in_size[1]))
    return pillow_resize_plan(in_size, out_size)


def _fit(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Cut or zero-pad ``[h, w, 3]`` to ``[height, width, 3]`` (top-left aligned)."""
    h, w = image.shape[:2]
    if (h, w) == (height, width):
        return image
    out = image.new_zeros((height, width, image.shape[2]))
    out[: min(h, height), : min(w, width)] = image[:height, :width]
    return out


def make_crops(
    pixels: torch.Tensor,
    tiling: Tiling,
    spec: TilingSpec,
    mode: ResizeMode,
    resampler: Resampler,
    keep: list | None = None,
) -> torch.Tensor:
    """uint8 ``[H, W, 3]`` pixels -> uint8 ``[1 + h_t*w_t, crop, crop, 3]`` crops.

    Runs where ``resampler`` runs. Index 0 is the global crop (aspect ratio not kept),
    then the local crops in row-major order, cut from the canvas at a stride of
    ``spec.window``. ``keep`` collects the resize weights the work reads (see
    :meth:`.Resampler.run`).
    """
    in_size = (pixels.shape[0], pixels.shape[1])
    size = spec.crop_size
    canvas_h, canvas_w = spec.canvas_size(tiling)
    h_t, w_t = tiling
    out = torch.empty(
        (spec.num_crops(tiling), size, size, 3), dtype=torch.uint8, device=resampler.device
    )
    out[0] = _fit(resampler.run(pixels, resize_plan(mode, in_size, (size, size)), keep), size, size)
    canvas = resampler.run(pixels, resize_plan(mode, in_size, (canvas_h, canvas_w)), keep)
    canvas = _fit(canvas, canvas_h, canvas_w).contiguous()
    # Windows (i, j) of the canvas as one strided view: [h_t, w_t, size, size, 3].
    row, col = canvas.stride(0), canvas.stride(1)
    step = spec.window
    windows = canvas.as_strided((h_t, w_t, size, size, 3), (step * row, step * col, row, col, 1))
    out[1:].view(h_t, w_t, size, size, 3).copy_(windows)  # one strided copy, cast included
    return out
