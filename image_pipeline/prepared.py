"""The main entry point: bytes in, uint8 crops + metadata out.

Per image: header checks -> decode to uint8 pixels on the host -> the pixels go to the
device once (pinned memory and a side stream on CUDA) -> resize, crop there
(:mod:`.crops`); the content hash of the pixels is computed on the host meanwhile. The
crops stay on that device; normalization happens where the encoder runs
(:meth:`PreparedImage.normalized`).

Optionally, large JPEGs skip the host decode: the same header checks, then nvJPEG decodes
on the device (:mod:`.gpu_jpeg`) and the content hash is one of the encoded bytes.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import blake3
import numpy as np
import torch
from PIL import Image

from .budget import DecodeBudget, reserve
from .crops import ResizeMode, make_crops
from .decode import DecodedImage, Header, check_size, decode, read_header, upright_rgb
from .errors import ImageError, ImageErrorReason
from .gpu_jpeg import (
    GpuDecodeError,
    GpuDecoder,
    decode_upright,
    encoded_digest,
    gpu_decodable,
)
from .gpu_jpeg import gpu_decoder as default_gpu_decoder
from .limits import DEFAULT_LIMITS, ImageLimits, check_int
from .normalize import normalize_crops
from .resample import Resampler
from .tiling import DEFAULT_TILING, Tiling, TilingSpec

__all__ = [
    "HostImage",
    "ImagePreparer",
    "PreparedImage",
    "content_hash",
    "prepare_decoded",
    "prepare_image",
    "prepare_pil",
]


# Pixel buffers at least this large are hashed on several threads. Waking BLAKE3's thread pool
# costs more than it saves below a few MB (on a 16-core host, 800x600 pixels: 0.37 ms on one
# thread, 0.85 with the pool; a 12 MP decode's: 9.0 against 1.2).
_THREADED_HASH_BYTES = 4 << 20


@dataclass(frozen=True, slots=True, eq=False)
class PreparedImage:
    """Crops of one image, ready for the vision encoder.

    Attributes:
        crops: uint8 ``[1 + h_t*w_t, crop, crop, 3]``, C-contiguous, on the device the
            image was prepared for (the CPU by default). Index 0 is the global crop,
            then local crops in row-major order. Treat it as read-only: it may be
            shared through a cache. CUDA crops are complete when the image is returned.
        tiling: ``(h_t, w_t)``.
        content_hash: BLAKE3 hex of the pixels the crops were made from (see
            :func:`content_hash`), or of the encoded bytes of a JPEG decoded on the GPU
            (see :func:`.gpu_jpeg.encoded_digest`); usable as a cache key together with
            the tiling spec and resize mode.
        width, height: size of the upright original image.
        decoded_size: ``(height, width)`` of the pixels actually resized; smaller
            than the original when a large JPEG was decoded at reduced scale (never
            on the GPU path, which decodes at full size).
        source: what the crops were made from, kept only by a preparer told to
            (``keep_source``: Moondream 3's segment refiner reads the picture again): the
            decoded upright pixels ``[h, w, 3]`` on the host, or the encoded bytes of a
            picture decoded on the GPU; None otherwise.
    """

    crops: torch.Tensor
    tiling: Tiling
    content_hash: str
    width: int
    height: int
    decoded_size: tuple[int, int]
    source: np.ndarray | bytes | None = None

    @property
    def num_crops(self) -> int:
        """``1 + h_t * w_t``."""
        return self.crops.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes a cache holding it keeps alive."""
        source = self.source
        kept = source.nbytes if isinstance(source, np.ndarray) else len(source or b"")
        return self.crops.nbytes + kept

    def normalized(
        self, dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """Crops as ``[N, 3, H, W]`` in [-1, 1]; see :func:`normalize_crops`."""
        return normalize_crops(self.crops, dtype=dtype, device=device)


@dataclass(frozen=True, slots=True, eq=False)
class HostImage:
    """A decoded image whose crops are still to be made, by :meth:`ImagePreparer.crops_of`
    on the device that runs the encoder (the engine's process, where the server's does
    not touch the GPU). Same metadata as :class:`PreparedImage`.

    Attributes:
        pixels: uint8 ``[h, w, 3]`` upright pixels on the host; read-only.
        num_crops: ``1 + h_t * w_t``.
    """

    pixels: np.ndarray
    tiling: Tiling
    content_hash: str
    width: int
    height: int
    decoded_size: tuple[int, int]
    num_crops: int

    @property
    def nbytes(self) -> int:
        """Bytes a cache holding it keeps alive."""
        return self.pixels.nbytes


@dataclass(frozen=True, slots=True, eq=False)
class EncodedImage:
    """A JPEG whose header passed the checks, left encoded for the process that runs the
    encoder to decode on its GPU (:meth:`ImagePreparer.prepare_encoded`): the server's
    process then spends no decode, and the pixels are made where they are used. Same
    metadata as :class:`PreparedImage`; keyed by its encoded bytes
    (:func:`.gpu_jpeg.encoded_digest`), as a picture decoded on the GPU always is.

    Attributes:
        data: the encoded bytes, or a read-only uint8 array holding them (in shared memory,
            on its way to an engine process).
        num_crops: ``1 + h_t * w_t``.
    """

    data: bytes | np.ndarray
    tiling: Tiling
    content_hash: str
    width: int
    height: int
    num_crops: int

    @property
    def decoded_size(self) -> tuple[int, int]:
        """``(height, width)``: a GPU decode is always at full size."""
        return self.height, self.width

    @property
    def nbytes(self) -> int:
        """Bytes a cache holding it keeps alive."""
        return len(self.data)


def content_hash(
    image: Image.Image | np.ndarray, original_size: tuple[int, int] | None = None
) -> str:
    """BLAKE3 hex of an RGB image's pixels and shape.

    BLAKE3 rather than SHA-256: a cryptographic hash (the digest keys a cache shared by
    clients, so collisions must be infeasible) at a quarter of SHA-256's CPU time (0.25
    against 1.03 ms for 800x600 pixels on a Xeon host).

    The shape is hashed with the pixels, so a different size never gives the same
    digest, and the container the pixels came in plays no part: the same pixels sent in
    another container (PNG, BMP, ...) share cache entries and the image prefix. JPEGs
    decoded on the GPU are hashed by their encoded bytes instead (their pixels
    stay on the device), so that sharing does not reach them. ``original_size``
    ``(height, width)`` marks a reduced-scale decode: its digest then differs from
    any full-size image's, since the same picture decoded at full size would give
    other pixels. ``image`` is a Pillow RGB image or uint8 ``[h, w, 3]`` array.
    """
    if isinstance(image, Image.Image):
        if image.mode != "RGB":
            raise ValueError(f"expected an RGB image, got mode {image.mode!r}")
        height, width = image.height, image.width
        data: bytes | memoryview = image.tobytes()
    else:
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise ValueError("expected a uint8 [h, w, 3] array")
        height, width = image.shape[:2]
        data = memoryview(np.ascontiguousarray(image)).cast("B")
    header = f"rgb8 {height}x{width}"
    if original_size is not None and original_size != (height, width):
        header += f" reduced-from {original_size[0]}x{original_size[1]}"
    # Large pictures are hashed on several cores (the digest is the same: BLAKE3 is a tree);
    # it is on every new image's path to the device.
    threads = blake3.blake3.AUTO if len(data) >= _THREADED_HASH_BYTES else 1
    digest = blake3.blake3(header.encode("ascii") + b"\n", max_threads=threads)
    digest.update(data)
    return digest.hexdigest()


class ImagePreparer:
    """Turns encoded images into :class:`PreparedImage` on one device, one way.

    Holds what is worth keeping between images: the device, the resize weights (per
    size pair), the side streams of the calling threads (CUDA), the decode budget.
    Thread-safe; meant to be called from a pool of decode threads.

    Args:
        limits: input limits (header checks before decoding).
        tiling: crop geometry.
        resize: resizer to replicate (see :class:`ResizeMode`).
        device: where the crops are made and kept (``cpu``, ``cuda``, ``cuda:1``).
        reduced_decode: decode large JPEGs at 1/2, 1/4 or 1/8 scale when the result
            still covers the canvas; faster, but the pixels differ from a full decode.
        gpu_decode_min_pixels: JPEGs of at least this many pixels (stored width x
            height) are decoded on the device by ``gpu_decoder``, at full size; their
            pixels differ slightly from the host decoders'. 0: off.
        gpu_decoder: the device decoder (default: :func:`.gpu_jpeg.gpu_decoder`'s choice on a
            CUDA device where one works; none elsewhere, and every picture decodes on the host).
            Anything it fails on goes to the host decoders, which decide as always.
        budget: shared bound on decoded bytes in flight, or None.
        on_device_time: called with the device milliseconds of each image's upload (or
            GPU decode), resize and crop (CUDA only; for benchmarks).
        on_source_time: called with the part of those until the pixels are on the device:
            the upload, or the GPU decode (a hardware decoder's time is its JPEG engines',
            not the SMs'), before the resize and crop (CUDA only; for benchmarks).
    """

    def __init__(
        self,
        limits: ImageLimits = DEFAULT_LIMITS,
        tiling: TilingSpec = DEFAULT_TILING,
        resize: ResizeMode | str = ResizeMode.VIPS,
        device: torch.device | str = "cpu",
        *,
        reduced_decode: bool = True,
        gpu_decode_min_pixels: int = 0,
        gpu_decoder: GpuDecoder | None = None,
        budget: DecodeBudget | None = None,
        on_device_time: Callable[[float], None] | None = None,
        on_source_time: Callable[[float], None] | None = None,
        keep_source: bool = False,
    ) -> None:
        """``keep_source``: every prepared image keeps what its crops were made from
        (`PreparedImage.source`)."""
        check_int("gpu_decode_min_pixels", gpu_decode_min_pixels, 0)
        self.keep_source = keep_source
        self.limits = limits
        self.tiling = tiling
        self.resize = ResizeMode(resize)
        self.device = torch.device(device)
        self.reduced_decode = reduced_decode
        self.gpu_decode_min_pixels = gpu_decode_min_pixels
        if gpu_decoder is None and gpu_decode_min_pixels > 0 and self.device.type == "cuda":
            # Unavailable (no torchvision, no nvJPEG): the host path as without the option.
            # The server checks this itself at start, to say so instead.
            with contextlib.suppress(RuntimeError):
                gpu_decoder = default_gpu_decoder(self.device)
        # None: every picture is decoded on the host.
        self.gpu_decoder = gpu_decoder if gpu_decode_min_pixels > 0 else None
        self.budget = budget
        self.on_device_time = on_device_time
        self.on_source_time = on_source_time
        self.resampler = Resampler(self.device)
        # GPU-decoded pictures: full size, and their resize is queued while the decoder
        # works, so its large stages run in small blocks (see `Resampler._block_for`).
        self._decoded_resampler = (
            Resampler(self.device, large_block=256) if self.device.type == "cuda" else None
        )
        self._local = threading.local()

    def prepare(self, data: bytes) -> PreparedImage:
        """Decode untrusted bytes and cut the encoder crops (``ImageError`` on bad data)."""
        header = read_header(data, self.limits)
        decoder = self.gpu_decoder
        if decoder is not None and self.decodes_on_gpu(header):
            try:
                return self._prepare_on_gpu(data, header, decoder)
            except GpuDecodeError:
                pass  # the host decoders accept or refuse it, exactly as without this path
        target = self._canvas_for if self.reduced_decode else None
        # On CUDA the JPEG decoder writes straight into pinned memory: no staging copy.
        alloc = _pinned if self.device.type == "cuda" else None
        decoded = decode(
            data, self.limits, target=target, budget=self.budget, alloc=alloc, header=header
        )
        return self.prepare_decoded(decoded)

    def decode_host(
        self, data: bytes, alloc: Callable[[tuple[int, int, int]], np.ndarray] | None = None
    ) -> HostImage:
        """Decode untrusted bytes on the host only (``ImageError`` on bad data): the header
        checks, limits, budget and reduced-scale decode of :meth:`prepare`, no device work.
        ``alloc`` gives the array a JPEG is decoded into (other formats are decoded where
        their decoder puts them)."""
        header = read_header(data, self.limits)
        target = self._canvas_for if self.reduced_decode else None
        decoded = decode(
            data, self.limits, target=target, budget=self.budget, alloc=alloc, header=header
        )
        tiles = self.tiling.tiling_for(decoded.height, decoded.width)
        return HostImage(
            pixels=decoded.pixels,
            tiling=tiles,
            content_hash=content_hash(decoded.pixels, (decoded.height, decoded.width)),
            width=decoded.width,
            height=decoded.height,
            decoded_size=decoded.decoded_size,
            num_crops=self.tiling.num_crops(tiles),
        )

    def crops_of(self, image: HostImage) -> torch.Tensor:
        """The crops of a host-decoded image on this preparer's device, queued on the current
        stream without waiting for them (CUDA): the pixels go up through pinned memory,
        which the caching host allocator keeps until the copy is done."""
        return make_crops(
            self._upload(image.pixels)(), image.tiling, self.tiling, self.resize, self.resampler
        )

    def decodes_on_gpu(self, header: Header) -> bool:
        """Whether a picture with this (checked) header is decoded by ``gpu_decoder``."""
        return self.gpu_decoder is not None and device_decodes(
            header, self.gpu_decode_min_pixels, self.budget
        )

    def encoded(
        self, data: bytes, min_pixels: int, data_digest: bytes | None = None
    ) -> EncodedImage | None:
        """For a process that leaves GPU decoding to the engine's: ``data`` checked (header,
        limits, orientation) and kept encoded when it is a JPEG of at least ``min_pixels``
        stored pixels that a GPU decoder may take; None for the host decoders
        (``ImageError`` on bad data). ``data_digest``: the BLAKE3 of ``data``, if known."""
        header = read_header(data, self.limits)
        if min_pixels <= 0 or not device_decodes(header, min_pixels, self.budget):
            return None
        height, width = header.size
        tiles = self.tiling.tiling_for(height, width)
        return EncodedImage(
            data=data,
            tiling=tiles,
            content_hash=encoded_digest(data, (height, width), data_digest),
            width=width,
            height=height,
            num_crops=self.tiling.num_crops(tiles),
        )

    def prepare_encoded(self, image: EncodedImage) -> PreparedImage:
        """The crops of a JPEG left encoded (:meth:`encoded`), on this preparer's device:
        decoded by ``gpu_decoder``, else (none, or it fails on the picture) by the host
        decoders (at reduced scale where the preparer allows it). Keyed as it came
        (``ImageError`` on bad data)."""
        data = image.data if isinstance(image.data, bytes) else image.data.tobytes()
        header = read_header(data, self.limits)
        if self.gpu_decoder is not None and gpu_decodable(header):
            try:
                return self._prepare_on_gpu(data, header, self.gpu_decoder, image.content_hash)
            except GpuDecodeError:
                pass  # the host decoders accept or refuse it, as for any picture
        alloc = _pinned if self.device.type == "cuda" else None
        target = self._canvas_for if self.reduced_decode else None
        decoded = decode(
            data, self.limits, target=target, budget=self.budget, alloc=alloc, header=header
        )
        return self.prepare_decoded(decoded, image.content_hash)

    def prepare_decoded(self, decoded: DecodedImage, key: str | None = None) -> PreparedImage:
        """Crop an already decoded image. The tiling follows the original size. ``key``: its
        content hash when it has one already (else its pixels are hashed)."""
        tiles = self.tiling.tiling_for(decoded.height, decoded.width)
        size = (decoded.height, decoded.width)
        crops, digest = self._crops(
            self._upload(decoded.pixels),
            tiles,
            functools.partial(content_hash, decoded.pixels, size) if key is None else lambda: key,
        )
        return PreparedImage(
            crops=crops,
            tiling=tiles,
            content_hash=digest,
            width=decoded.width,
            height=decoded.height,
            decoded_size=decoded.decoded_size,
            source=decoded.pixels if self.keep_source else None,
        )

    def _canvas_for(self, height: int, width: int) -> tuple[int, int]:
        spec = self.tiling
        canvas_h, canvas_w = spec.canvas_size(spec.tiling_for(height, width))
        return max(canvas_h, spec.crop_size), max(canvas_w, spec.crop_size)

    def _prepare_on_gpu(
        self, data: bytes, header: Header, decoder: GpuDecoder, key: str | None = None
    ) -> PreparedImage:
        """Decode on the device at full size, then crop there (``GpuDecodeError``: the
        decoder failed, nothing is kept and the budget share is given back). ``key``: its
        content hash when it has one already (else its bytes are hashed)."""
        height, width = header.size
        tiles = self.tiling.tiling_for(height, width)
        size = (height, width)
        # Held until the crops are done: the decoded pixels live on the device until then.
        with reserve(self.budget, header.decode_cost()):
            crops, digest = self._crops(
                functools.partial(decode_upright, decoder, data, self.device, header),
                tiles,
                functools.partial(encoded_digest, data, size) if key is None else lambda: key,
                self._decoded_resampler,
            )
        return PreparedImage(
            crops=crops,
            tiling=tiles,
            content_hash=digest,
            width=width,
            height=height,
            decoded_size=(height, width),
            source=data if self.keep_source else None,
        )

    def _upload(self, pixels: np.ndarray) -> Callable[[], torch.Tensor]:
        """What gives host ``pixels`` on the device (called on the side stream on CUDA)."""
        if self.device.type != "cuda":
            # Pixels mapped read-only (shared memory) are copied: torch has no read-only tensors.
            host = torch.from_numpy(pixels if pixels.flags.writeable else pixels.copy())
            return lambda: host
        pinned = pinned_copy(pixels)
        return lambda: pinned.to(self.device, non_blocking=True)

    def _crops(
        self,
        source: Callable[[], torch.Tensor],
        tiles: Tiling,
        digest: Callable[[], str],
        resampler: Resampler | None = None,
    ) -> tuple[torch.Tensor, str]:
        """The crops of the pixels ``source()`` gives on the device (an upload or a GPU
        decode), and ``digest()``: on CUDA computed while the device works (it only reads
        host data that nothing writes meanwhile). ``resampler``: other than the preparer's."""
        resampler = resampler or self.resampler
        if self.device.type != "cuda":
            pixels = source()
            key = digest()
            return make_crops(pixels, tiles, self.tiling, self.resize, resampler), key
        # On this thread's own stream, so it overlaps the engine's work; finished before
        # return, so the engine may use the crops on any stream.
        stream = self._stream()
        timed = self.on_device_time is not None or self.on_source_time is not None
        start = torch.cuda.Event(enable_timing=True) if timed else None
        sourced = torch.cuda.Event(enable_timing=True) if timed else None
        # A blocking event: the decode thread sleeps until the crops are done instead of
        # spinning on a core.
        done = torch.cuda.Event(enable_timing=timed, blocking=True)
        with torch.cuda.stream(stream):
            if start is not None:
                start.record(stream)
            pixels = source()
            if sourced is not None:
                sourced.record(stream)
            crops = make_crops(pixels, tiles, self.tiling, self.resize, resampler)
            done.record(stream)
        key = digest()  # the host hashes while the device uploads, resizes and crops
        done.synchronize()
        if start is not None and sourced is not None:
            if self.on_device_time is not None:
                self.on_device_time(start.elapsed_time(done))
            if self.on_source_time is not None:
                self.on_source_time(start.elapsed_time(sourced))
        return crops, key

    def _stream(self) -> torch.cuda.Stream:
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(self.device)
        return stream


def device_decodes(header: Header, min_pixels: int, budget: DecodeBudget | None) -> bool:
    """Whether a picture with this (checked) header goes to a GPU decoder: a JPEG it may
    take (:func:`.gpu_jpeg.gpu_decodable`) of at least ``min_pixels`` stored pixels, whose
    full-size decode fits the whole ``budget`` (a larger one takes the host path, which may
    decode it at reduced scale within the budget, or refuses it as it always did)."""
    if min_pixels <= 0 or not gpu_decodable(header):
        return False
    height, width = header.stored_size
    if height * width < min_pixels:
        return False
    return budget is None or header.decode_cost() <= budget.capacity


def pinned_copy(pixels: np.ndarray) -> torch.Tensor:
    """``pixels`` in page-locked host memory (itself when it already is), so an upload from
    it is a real async DMA; the caching host allocator keeps it until that copy is done."""
    host = torch.from_numpy(pixels)
    if host.is_pinned():
        return host
    pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    pinned.copy_(host)
    return pinned


def _pinned(shape: tuple[int, int, int]) -> np.ndarray:
    """A page-locked host array (the numpy view keeps its tensor alive)."""
    return torch.empty(shape, dtype=torch.uint8, pin_memory=True).numpy()


@functools.lru_cache(maxsize=32)
def _default_preparer(
    limits: ImageLimits, tiling: TilingSpec, resize: ResizeMode, device: str, reduced: bool
) -> ImagePreparer:
    return ImagePreparer(limits, tiling, resize, device, reduced_decode=reduced)


def prepare_decoded(
    decoded: DecodedImage,
    tiling: TilingSpec = DEFAULT_TILING,
    *,
    resize: ResizeMode | str = ResizeMode.VIPS,
    device: torch.device | str = "cpu",
) -> PreparedImage:
    """Crop an already decoded image. The tiling follows the original size."""
    preparer = _default_preparer(DEFAULT_LIMITS, tiling, ResizeMode(resize), str(device), True)
    return preparer.prepare_decoded(decoded)


def prepare_image(
    data: bytes,
    limits: ImageLimits = DEFAULT_LIMITS,
    tiling: TilingSpec = DEFAULT_TILING,
    *,
    reduced_decode: bool = True,
    resize: ResizeMode | str = ResizeMode.VIPS,
    device: torch.device | str = "cpu",
) -> PreparedImage:
    """Decode untrusted image bytes and cut the encoder crops.

    Large JPEGs are decoded at a reduced DCT scale (1/2, 1/4, 1/8) when the
    result still covers the local canvas (and the global crop) in both
    dimensions; the tiling is always chosen from the original size. Set
    ``reduced_decode=False`` to always decode at full size. ``resize`` picks the
    resizer the crops replicate; ``device`` where they are made and kept.

    Thread-safe: no shared mutable state.

    Raises:
        ImageError: for any problem with the data itself.
    """
    preparer = _default_preparer(
        limits, tiling, ResizeMode(resize), str(torch.device(device)), reduced_decode
    )
    return preparer.prepare(data)


def prepare_pil(
    image: Image.Image,
    limits: ImageLimits = DEFAULT_LIMITS,
    tiling: TilingSpec = DEFAULT_TILING,
    *,
    resize: ResizeMode | str = ResizeMode.VIPS,
    device: torch.device | str = "cpu",
) -> PreparedImage:
    """Like :func:`prepare_image` for an image that is already a Pillow object.

    The EXIF orientation, if the image still has one, is applied and every mode
    is converted as in :func:`decode_image`; the caller's image is not modified.
    Size limits apply (the byte limit cannot). Not safe to call concurrently on
    the same lazily loaded image object.
    """
    if not isinstance(image, Image.Image):
        raise TypeError(f"expected a PIL image, got {type(image).__name__}")
    check_size(image.width, image.height, limits)
    try:
        image.load()
        rgb = upright_rgb(image)
    except ImageError:
        raise
    except Exception as exc:
        raise ImageError(ImageErrorReason.CORRUPT, f"cannot read image: {exc}") from exc
    decoded = DecodedImage(pixels=np.array(rgb), width=rgb.width, height=rgb.height)
    return prepare_decoded(decoded, tiling, resize=resize, device=device)
