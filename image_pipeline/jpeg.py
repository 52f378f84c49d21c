"""JPEG decoding with simplejpeg (libjpeg-turbo), bit-identical to Pillow's decoder.

simplejpeg runs libjpeg-turbo with the settings Pillow uses (accurate integer DCT,
fancy upsampling) and releases the GIL once for the whole image, where Pillow's decoder
takes and releases it per chunk. Reduced-size decoding uses the same 1/2, 1/4, 1/8 DCT
scaling Pillow's ``draft`` picks. Anything simplejpeg will not decode cleanly (CMYK,
warnings such as extraneous bytes, truncation) goes back to the Pillow path, which then
accepts or refuses it exactly as before.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import simplejpeg

__all__ = ["Allocator", "draft_scale", "orient", "try_decode_jpeg"]


def draft_scale(width: int, height: int, need_w: int, need_h: int) -> int:
    """The DCT scale denominator (1, 2, 4 or 8) Pillow's ``draft`` picks for a target size."""
    scale = min(width // max(need_w, 1), height // max(need_h, 1))
    for s in (8, 4, 2):
        if scale >= s:
            return s
    return 1


Allocator = Callable[[tuple[int, int, int]], np.ndarray]


def try_decode_jpeg(
    data: bytes, width: int, height: int, scale: int, alloc: Allocator | None = None
) -> np.ndarray | None:
    """RGB ``[h, w, 3]`` uint8 of a JPEG decoded at ``1/scale``; None if simplejpeg balks.

    ``width``/``height`` are the header's (stored) size; the result is
    ``ceil(height / scale) x ceil(width / scale)`` as libjpeg scales it. ``alloc``
    gives the output array (e.g. pinned memory for a GPU upload without a copy).
    """
    out_h, out_w = -(-height // scale), -(-width // scale)
    buffer = alloc((out_h, out_w, 3)) if alloc is not None else None
    try:
        if scale > 1:
            # simplejpeg takes the smallest M/8 factor keeping both sides >= these; for
            # sides of 16 px and more that is exactly 1/scale (checked below).
            pixels = simplejpeg.decode_jpeg(
                data, colorspace="RGB", min_height=out_h, min_width=out_w, buffer=buffer
            )
        else:
            pixels = simplejpeg.decode_jpeg(data, colorspace="RGB", buffer=buffer)
    except ValueError:
        return None
    if buffer is not None and pixels.shape == buffer.shape:
        pixels = buffer  # the caller's array itself, not a view that hides where it lives
    if pixels.shape != (out_h, out_w, 3):
        return None
    return pixels


def orient(pixels: np.ndarray, orientation: int, alloc: Allocator | None = None) -> np.ndarray:
    """Apply an EXIF orientation (1..8) like ``ImageOps.exif_transpose``; C-contiguous result.

    ``alloc`` gives the output array when one is made (orientations 2..8). Orientation 1
    returns ``pixels`` itself.
    """
    if orientation == 2:
        view = pixels[:, ::-1]
    elif orientation == 3:
        view = pixels[::-1, ::-1]
    elif orientation == 4:
        view = pixels[::-1]
    elif orientation == 5:
        view = pixels.transpose(1, 0, 2)
    elif orientation == 6:
        view = pixels.transpose(1, 0, 2)[:, ::-1]
    elif orientation == 7:
        view = pixels.transpose(1, 0, 2)[::-1, ::-1]
    elif orientation == 8:
        view = pixels.transpose(1, 0, 2)[::-1]
    else:
        return np.ascontiguousarray(pixels)
    shape = (view.shape[0], view.shape[1], view.shape[2])
    out = alloc(shape) if alloc is not None else np.empty(shape, dtype=np.uint8)
    if orientation == 4:
        out[...] = view  # whole rows in reverse order: row copies
    else:
        # One plane at a time: numpy copies a whole [h, w, 3] view 3 bytes per inner loop,
        # a plane with inner loops as long as a row (3 to 4 times faster, same bytes).
        for c in range(view.shape[2]):
            out[:, :, c] = view[:, :, c]
    return out
