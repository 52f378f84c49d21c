"""Synthetic test pictures for the benchmarks, generated locally (no downloads).

A picture is a smooth colour field with a few shapes and mild sensor-like noise, so JPEG and
PNG sizes and decode costs resemble photographs more than a flat image would. `unique_images`
stamps a request index into each copy as large black/white blocks: the blocks survive the
server's reduced-scale JPEG decode (down to 1/8), so every request has different pixels and
never hits a prefix or image cache.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from PIL import Image, ImageDraw
from tqdm import tqdm

FORMATS = {"jpeg": "JPEG", "jpg": "JPEG", "png": "PNG"}
INDEX_BITS = 24  # enough distinct stamps for any benchmark run


def parse_size(text: str) -> tuple[int, int]:
    """``"800x600"`` -> ``(800, 600)`` (width, height)."""
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"image size must look like 800x600, not {text!r}") from None
    if w < 1 or h < 1:
        raise ValueError(f"image size must be positive, not {text!r}")
    return w, h


def base_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """A deterministic photo-like RGB picture of the given size."""
    rng = np.random.default_rng(seed)
    y = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None]
    x = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :]
    phase = rng.uniform(0, 2 * np.pi, size=3).astype(np.float32)
    channels = [
        127 + 100 * np.sin(3.0 * x + 2.0 * y + phase[c]) * np.cos(2.0 * y - x + phase[c])
        for c in range(3)
    ]
    pixels = np.stack(channels, axis=-1)
    # Mild noise: without it encoders compress far better than on real photographs.
    noise = rng.standard_normal((height, width, 1), dtype=np.float32) * 6.0
    pixels = np.clip(pixels + noise, 0, 255).astype(np.uint8)
    img = Image.fromarray(pixels, "RGB")
    draw = ImageDraw.Draw(img)
    for _ in range(6):
        x0, x1 = sorted(rng.integers(0, width, size=2).tolist())
        y0, y1 = sorted(rng.integers(0, height, size=2).tolist())
        colour = tuple(int(v) for v in rng.integers(0, 256, size=3))
        if rng.random() < 0.5:
            draw.rectangle((x0, y0, x1, y1), fill=colour)
        else:
            draw.ellipse((x0, y0, x1, y1), fill=colour)
    return img


def stamp_index(img: Image.Image, index: int) -> Image.Image:
    """A copy of ``img`` with ``index`` drawn as a row of large black/white blocks."""
    out = img.copy()
    draw = ImageDraw.Draw(out)
    block = max(2, out.width // (INDEX_BITS + 2))
    top = max(0, out.height - 2 * block)
    for bit in range(INDEX_BITS):
        on = (index >> bit) & 1
        x0 = block + bit * block
        draw.rectangle(
            (x0, top, x0 + block - 1, top + block - 1), fill=(255, 255, 255) if on else (0, 0, 0)
        )
    draw.text((block, max(0, top - 12)), str(index), fill=(255, 255, 255))
    return out


def encode(img: Image.Image, fmt: str = "jpeg", quality: int = 90) -> bytes:
    """Encoded bytes of ``img`` (``fmt``: jpeg or png)."""
    kind = FORMATS[fmt.lower()]
    buf = io.BytesIO()
    if kind == "JPEG":
        img.save(buf, format=kind, quality=quality)
    else:
        img.save(buf, format=kind, compress_level=6)
    return buf.getvalue()


def with_orientation(data: bytes, orientation: int) -> bytes:
    """A JPEG with an EXIF orientation tag (1..8) put in front of its segments; the stored
    pixels stay as they are, so decoders turn them (6: a phone's portrait photo)."""
    if data[:2] != b"\xff\xd8":
        raise ValueError("not a JPEG")
    exif = Image.Exif()
    exif[0x0112] = orientation
    payload = exif.tobytes()
    return data[:2] + b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload + data[2:]


def unique_images(
    width: int,
    height: int,
    indices: Sequence[int],
    fmt: str = "jpeg",
    seed: int = 0,
    threads: int = 8,
    desc: str | None = None,
) -> list[bytes]:
    """One encoded picture per index, all with different pixels; encoded on ``threads``
    threads (Pillow releases the GIL while encoding), with a progress bar when ``desc``."""
    base = base_image(width, height, seed)
    with ThreadPoolExecutor(max(1, threads)) as pool:
        jobs = pool.map(lambda i: encode(stamp_index(base, i), fmt), indices)
        return list(
            tqdm(jobs, total=len(indices), desc=desc, unit="img", leave=False, disable=desc is None)
        )
