"""Draw results on the image: points, boxes, polygons and masks (normalized coordinates)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageOps

from vlm_server.client.types import Box, Point, RleMask

COLOR = (255, 40, 120)
MASK_ALPHA = 0.45


def rle_decode(mask: RleMask) -> np.ndarray:
    """COCO RLE -> bool array [height, width] (runs are column-major, background first)."""
    total = mask.height * mask.width
    values = np.zeros(len(mask.counts), dtype=bool)
    values[1::2] = True
    flat = np.repeat(values, mask.counts)
    if flat.size != total:
        raise ValueError(f"RLE counts cover {flat.size} pixels, the mask has {total}")
    return flat.reshape(mask.width, mask.height).T


def upright(image: Image.Image) -> Image.Image:
    """The image as the server saw it: EXIF orientation applied, RGB."""
    return ImageOps.exif_transpose(image).convert("RGB")


def render(
    image: Image.Image,
    *,
    points: Sequence[Point] = (),
    boxes: Sequence[Box] = (),
    polygons: Sequence[Sequence[Point]] = (),
    mask: RleMask | None = None,
    color: tuple[int, int, int] = COLOR,
) -> Image.Image:
    """A copy of ``image`` (upright) with the results drawn on it."""
    out = upright(image)
    w, h = out.size
    if mask is not None and mask.counts:
        pixels = rle_decode(mask)
        if pixels.shape != (h, w):
            # A mask at another resolution still lines up: both span the whole image.
            pixels = np.asarray(Image.fromarray(pixels).resize((w, h), Image.Resampling.NEAREST))
        tint = Image.new("RGB", out.size, color)
        blended = Image.blend(out, tint, MASK_ALPHA)
        out.paste(blended, mask=Image.fromarray(pixels.astype(np.uint8) * 255))
    draw = ImageDraw.Draw(out)
    line = max(2, round(min(w, h) / 200))
    for polygon in polygons:
        xy = [(p.x * w, p.y * h) for p in polygon]
        if len(xy) >= 2:
            draw.line([*xy, xy[0]], fill=color, width=line)
    for b in boxes:
        x0, x1 = sorted((b.x_min * w, b.x_max * w))
        y0, y1 = sorted((b.y_min * h, b.y_max * h))
        draw.rectangle([x0, y0, x1, y1], outline=color, width=line)
    radius = max(3, round(min(w, h) / 80))
    for p in points:
        x, y = p.x * w, p.y * h
        draw.ellipse(
            [x - radius, y - radius, x + radius, y + radius],
            fill=color,
            outline=(255, 255, 255),
            width=max(1, line // 2),
        )
    return out
