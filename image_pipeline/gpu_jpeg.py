"""JPEG decoding on a CUDA device, for large pictures.

Two decoders (:func:`gpu_decoder` picks one):

* ``nvimgcodec``: nvImageCodec's hardware backend, the JPEG decode engines of A100, H100
  and later chips. Its pixels are within 1 of libjpeg-turbo's (measured on 800x600 and
  12 MP photos: mean difference below 0.001), and it leaves the SMs to the model: an H100
  decodes a 12 MP JPEG in about 8 ms, against 54-61 ms of a host core.
* ``torchvision``: nvJPEG on the SMs (torchvision's ``decode_jpeg``). Its IDCT and chroma
  upsampling are not libjpeg-turbo's: up to 65 off per channel value on a 12 MP photo
  (0.05 on average), and about 12 ms of GPU time for 12 MP.

Opt-in either way: the host path is bit-identical to Pillow, which the reference uses.

Everything the host path checks from the header (limits, budget, EXIF orientation) is
checked before this decoder sees the bytes (:func:`.decode.read_header`). The decoder is a
plain function (:data:`GpuDecoder`), so tests can put a host decoder in its place and run
the rest of the path on the CPU.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable

import blake3
import numpy as np
import simplejpeg
import torch

from .decode import Header

__all__ = [
    "GPU_DECODERS",
    "GpuDecodeError",
    "GpuDecoder",
    "decode_upright",
    "encoded_digest",
    "gpu_decodable",
    "gpu_decoder",
    "nvimgcodec_decoder",
    "orient_tensor",
    "torchvision_decoder",
]

log = logging.getLogger(__name__)

# Choices of `gpu_decoder`: auto takes the first of the others that works here.
GPU_DECODERS = ("auto", "nvimgcodec", "torchvision")

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

    _probe(decode, device, "torchvision")
    return decode


def nvimgcodec_decoder(device: torch.device) -> GpuDecoder:
    """nvImageCodec's hardware JPEG decoder onto ``device``, tried once on a tiny JPEG.

    Each thread gets its own decoder and keeps its last output buffer for the next picture
    (no allocation per picture once the largest size is seen); the pixels are copied out
    into a tensor of torch's allocator on the current stream, so their lifetime follows
    torch's stream rules. Pictures the engines cannot take (progressive JPEGs, for one)
    raise, and go to the host path; so do grey ones, which the engines got wrong.

    Raises:
        RuntimeError: saying why it is unavailable: nvImageCodec missing, no hardware JPEG
            decoder on this device, no usable CUDA device.
    """
    try:
        nvimgcodec = importlib.import_module("nvidia.nvimgcodec")
    except Exception as exc:  # ImportError, or a build for another CUDA
        raise RuntimeError(f"nvImageCodec cannot be imported ({exc})") from exc
    index = device.index if device.index is not None else torch.cuda.current_device()
    params = nvimgcodec.DecodeParams(
        apply_exif_orientation=False,  # the caller turns the picture upright
        color_spec=nvimgcodec.ColorSpec.SRGB,
    )
    local = threading.local()

    def decode(data: bytes, device: torch.device) -> torch.Tensor:
        state = getattr(local, "state", None)
        if state is None:
            hardware = nvimgcodec.Backend(nvimgcodec.BackendKind.HW_GPU_ONLY)
            state = local.state = [nvimgcodec.Decoder(device_id=index, backends=[hardware]), None]
        decoder, reused = state
        code = nvimgcodec.CodeStream(data)
        if code.num_channels != 3:
            # Measured on an H100: a grey JPEG of odd size came out up to 163 off.
            raise ValueError(f"{code.num_channels}-channel JPEGs stay on the host")
        stream = torch.cuda.current_stream(device)
        image = decoder.decode(code, image=reused, params=params, cuda_stream=stream.cuda_stream)
        if image is None:
            raise ValueError("the hardware JPEG decoder cannot decode this picture")
        state[1] = image
        decoded = torch.from_dlpack(image)  # [H, W, C] in the buffer the next call reuses
        out = torch.empty(decoded.shape, dtype=torch.uint8, device=device)
        out.copy_(decoded)  # queued before the next decode on this stream overwrites it
        return out.permute(2, 0, 1)

    _probe(decode, device, "nvImageCodec's hardware decoder")
    return decode


def gpu_decoder(device: torch.device, kind: str = "auto") -> GpuDecoder:
    """The GPU JPEG decoder ``kind`` (one of `GPU_DECODERS`) on ``device``; ``auto``: the
    hardware decoder where it works, else torchvision's nvJPEG.

    Raises:
        ValueError: ``kind`` is not one of `GPU_DECODERS`.
        RuntimeError: none of the asked-for decoders works here, saying why each does not.
    """
    if kind not in GPU_DECODERS:
        raise ValueError(f"GPU JPEG decoder must be one of {', '.join(GPU_DECODERS)}, got {kind!r}")
    makers = {"nvimgcodec": nvimgcodec_decoder, "torchvision": torchvision_decoder}
    names = list(makers) if kind == "auto" else [kind]
    reasons = []
    for name in names:
        try:
            decoder = makers[name](device)
        except RuntimeError as exc:
            reasons.append(str(exc))
            continue
        log.info("JPEGs are decoded on %s by %s", device, name)
        return decoder
    raise RuntimeError("; ".join(reasons))


def _probe(decode: GpuDecoder, device: torch.device, what: str) -> None:
    """Decode a 16x16 JPEG once, or raise RuntimeError saying why ``what`` does not work."""
    probe = simplejpeg.encode_jpeg(np.full((16, 16, 3), 128, dtype=np.uint8))
    try:
        out = decode(probe, device)
    except Exception as exc:
        raise RuntimeError(f"{what} cannot decode JPEG on {device} ({exc})") from exc
    if out.device.type != "cuda" or tuple(out.shape) != (3, 16, 16):
        raise RuntimeError(f"{what} on {device} gave {tuple(out.shape)} for a 16x16 JPEG")


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


def encoded_digest(data: bytes, size: tuple[int, int], data_digest: bytes | None = None) -> str:
    """BLAKE3 hex of a GPU-decoded picture: its own header, then the BLAKE3 of its encoded
    bytes (``data_digest`` when the caller has it already: the bytes are hashed once).

    The pixels never come to the host, so the bytes stand for them (one decoder gives the
    same pixels for the same bytes; the digest keys a process's own cache). The header
    (``jpeg-gpu HxW``, the upright size) differs from every pixel digest's (``rgb8 ...``,
    see :func:`.prepared.content_hash`), so the two never meet: a GPU-decoded picture
    shares no cache entry or image prefix with the same picture decoded on the host or
    encoded otherwise.
    """
    inner = data_digest if data_digest is not None else blake3.blake3(data).digest()
    digest = blake3.blake3(f"jpeg-gpu {size[0]}x{size[1]}\n".encode("ascii"))
    digest.update(inner)
    return digest.hexdigest()
