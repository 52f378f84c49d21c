"""JPEG decoding on a CUDA device (nvJPEG through torchvision), for large pictures.

Opt-in, because nvJPEG's IDCT and chroma upsampling are not libjpeg-turbo's: its pixels
differ slightly from the host path's, which is bit-identical to Pillow (measured on a
12 MP photo: 0.05 per channel value on average, 65 at most). What it buys is host CPU: the
decode call of a 12 MP JPEG costs about 9 ms of a host core, the host decode about 60.

Everything the host path checks from the header (limits, budget, EXIF orientation) is
checked before this decoder sees the bytes (:func:`.decode.read_header`). The decoder is a
plain function (:data:`GpuDecoder`), so tests can put a host decoder in its place and run
the rest of the path on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import blake3
import numpy as np
import simplejpeg
import torch

from .decode import Header

__all__ = [
    "GpuDecodeError",
    "GpuDecoder",
    "decode_upright",
    "encoded_digest",
    "gpu_decodable",
    "orient_tensor",
    "torchvision_decoder",
]

# (encoded JPEG, device) -> uint8 [C, H, W] on that device, C 3 (or 1 for grey), stored
# orientation. Any exception means "not this way": the host path decides about the picture.
GpuDecoder = Callable[[bytes, torch.device], torch.Tensor]

_EOI = b"\xff\xd9"  # JPEG end-of-image marker

# EXIF orientation -> (swap axes, then flip rows, flip columns): the moves that display the
# stored picture upright, the same as jpeg.orient's numpy views (exif_transpose semantics).
_MOVES: dict[int, tuple[bool, bool, bool]] = {
    1: (False, False, False),
    2: (False, False, True),
    3: (False, True, True),
    4: (False, True, False),
    5: (True, False, False),
    6: (True, False, True),
    7: (True, True, True),
    8: (True, True, False),
}


class GpuDecodeError(Exception):
    """The GPU decoder refused a picture or gave other pixels than its header describes."""


def torchvision_decoder(device: torch.device) -> GpuDecoder:
    """torchvision's nvJPEG decode onto ``device``, tried once on a tiny JPEG.

    Raises:
        RuntimeError: saying why it is unavailable: torchvision missing or built for
            another torch, built without nvJPEG, no usable CUDA device.
    """
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except Exception as exc:  # ImportError, or a torchvision whose ops do not load
        raise RuntimeError(f"torchvision cannot be imported ({exc})") from exc

    def decode(data: bytes, device: torch.device) -> torch.Tensor:
        # A writable copy (torch warns about read-only buffers); a few MB, well under a ms.
        encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        # RGB: grey pictures come out as three equal planes, as on the host path.
        return decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)

    probe = simplejpeg.encode_jpeg(np.full((16, 16, 3), 128, dtype=np.uint8))
    try:
        out = decode(probe, device)
    except Exception as exc:
        raise RuntimeError(f"torchvision cannot decode JPEG on {device} ({exc})") from exc
    if out.device.type != "cuda" or tuple(out.shape) != (3, 16, 16):
        raise RuntimeError(f"torchvision's JPEG decode on {device} gave {tuple(out.shape)}")
    return decode


# Component ids "R", "G", "B": without a JFIF or Adobe marker, libjpeg reads such a JPEG's
# three channels as plain RGB, not YCbCr.
_RGB_COMPONENT_IDS = [ord("R"), ord("G"), ord("B")]


def gpu_decodable(header: Header) -> bool:
    """Whether the GPU path may take the picture: a YCbCr or grey JPEG (or MPO).

    CMYK and other modes stay on the host. So do JPEGs whose three channels are plain RGB,
    as libjpeg (the host decoders) tells: an Adobe marker with transform 0, or, with neither
    a JFIF nor an Adobe marker, components named R, G and B. nvJPEG reading those as YCbCr
    would give wrong colours without an error to fall back on.
    """
    if not header.plain_jpeg:
        return False
    info = header.image.info
    if info.get("adobe_transform") == 0:
        return False
    layers = getattr(header.image, "layer", None) or []
    ids = [ord(c[0]) if isinstance(c[0], str) else c[0] for c in layers]
    return not ("jfif" not in info and "adobe" not in info and ids == _RGB_COMPONENT_IDS)


def orient_tensor(pixels: torch.Tensor, orientation: int) -> torch.Tensor:
    """Apply an EXIF orientation (1..8) to ``[H, W, C]`` like :func:`.jpeg.orient`.

    Runs where ``pixels`` are; the result is C-contiguous (a copy unless ``pixels``
    already was contiguous and upright). Other orientation values count as 1.
    """
    swap, rows, cols = _MOVES.get(orientation, _MOVES[1])
    view = pixels.transpose(0, 1) if swap else pixels
    dims = [dim for dim, flip in ((0, rows), (1, cols)) if flip]
    if dims:
        view = view.flip(dims)  # torch has no negative strides: flip copies
    return view.contiguous()


def decode_upright(
    decoder: GpuDecoder, data: bytes, device: torch.device, header: Header
) -> torch.Tensor:
    """Decode with ``decoder`` and turn upright: uint8 ``[h, w, 3]``, C-contiguous.

    Raises:
        GpuDecodeError: the data does not end with the JPEG end marker, the decoder raised,
            or its output is not the ``[1 or 3, H, W]`` uint8 picture of the header's
            stored size (then the host path decides).
    """
    if bytes(data[-2:]) != _EOI:
        # Truncated, or bytes after the picture: the host path refuses a truncated file,
        # and nvJPEG may decode one without an error (the missing part grey).
        raise GpuDecodeError("no JPEG end marker at the end of the data")
    try:
        planes = decoder(data, device)
    except Exception as exc:  # nvJPEG reports unsupported and corrupt data alike
        raise GpuDecodeError(f"GPU JPEG decode failed: {exc}") from exc
    shape = tuple(planes.shape)
    if planes.dtype != torch.uint8 or len(shape) != 3 or shape[0] not in (1, 3):
        raise GpuDecodeError(f"GPU JPEG decode gave {planes.dtype} {shape}")
    if shape[1:] != header.stored_size:
        raise GpuDecodeError(f"GPU JPEG decode gave {shape[1:]}, the header {header.stored_size}")
    if shape[0] == 1:
        planes = planes.expand(3, -1, -1)  # grey to RGB: three equal channels
    return orient_tensor(planes.permute(1, 2, 0), header.orientation)


def encoded_digest(data: bytes, size: tuple[int, int]) -> str:
    """BLAKE3 hex of a GPU-decoded picture: its encoded bytes under their own header.

    The pixels never come to the host, so the bytes stand for them (one decoder gives the
    same pixels for the same bytes; the digest keys a process's own cache). The header
    (``jpeg-gpu HxW``, the upright size) differs from every pixel digest's (``rgb8 ...``,
    see :func:`.prepared.content_hash`), so the two never meet: a GPU-decoded picture
    shares no cache entry or image prefix with the same picture decoded on the host or
    encoded otherwise.
    """
    digest = blake3.blake3(f"jpeg-gpu {size[0]}x{size[1]}\n".encode("ascii"))
    digest.update(data)
    return digest.hexdigest()
