"""JPEG pictures and a stand-in GPU decoder, for the tests of the GPU JPEG paths."""

from __future__ import annotations

import io
import threading

import numpy as np
import simplejpeg
import torch
from PIL import Image


def photo(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    rows = np.arange(height)[:, None, None]
    cols = np.arange(width)[None, :, None]
    base = 120 + 80 * np.sin(rows / 9.0 + cols / 13.0) + rng.normal(0, 25, (height, width, 3))
    return Image.fromarray(np.clip(base, 0, 255).astype(np.uint8)).convert(mode)


def encode(image: Image.Image, fmt: str = "JPEG", **params: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **params)
    return buffer.getvalue()


def oriented_jpeg(orientation: int, width: int = 160, height: int = 90) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(photo(width, height, seed=orientation), quality=90, exif=exif.tobytes())


class HostDecoder:
    """Stands in for nvJPEG: simplejpeg's pixels as ``[C, H, W]`` on the CPU; counts calls."""

    def __init__(self, fail: bool = False, grey_as_one_plane: bool = True) -> None:
        self.calls = 0
        self.fail = fail
        self.grey_as_one_plane = grey_as_one_plane
        self._lock = threading.Lock()

    def __call__(self, data: bytes, device: torch.device) -> torch.Tensor:
        with self._lock:
            self.calls += 1
        if self.fail:
            raise RuntimeError("nvjpeg: unsupported JPEG")
        grey = self.grey_as_one_plane and Image.open(io.BytesIO(data)).mode == "L"
        pixels = simplejpeg.decode_jpeg(data, colorspace="GRAY" if grey else "RGB")
        return torch.from_numpy(pixels).permute(2, 0, 1)  # a view, as a decoder may give
