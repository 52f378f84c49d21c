"""Image input of a request: decode bytes off the event loop, or look up an uploaded id."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Protocol

import blake3
import numpy as np
import torch

from image_pipeline import (
    DecodeBudget,
    EncodedImage,
    HostImage,
    ImageError,
    ImageLimits,
    ImagePreparer,
    PreparedImage,
)
from image_pipeline.gpu_jpeg import GpuDecoder, gpu_decoder
from vlm_server.engine.process.shared_pixels import pixel_pool, share
from vlm_server.frontend import received
from vlm_server.frontend.refusals import invalid
from vlm_server.options.table import ServerConfig

log = logging.getLogger(__name__)

# A request's image: cropped already, decoded for an engine process to crop, or a JPEG left
# encoded for an engine process to decode on its GPU.
Image = PreparedImage | HostImage | EncodedImage


@dataclass
class _Entry:
    image: Image
    owner: str | None  # who uploaded it; None: cached from an inline image_bytes request


class ImageCache:
    """Least-recently-used map from content hash to prepared image, bounded by the bytes of
    the crops it holds (the most recent image is always kept).

    ``owner_bytes`` bounds each owner's share: past it, an owner's own least recently used
    images go first, so one client uploading many pictures cannot flush everyone else's
    ids. Images cached from inline requests (no owner) share one such share.
    Used from the event loop only, so it needs no lock.
    """

    def __init__(self, capacity_bytes: int, owner_bytes: int | None = None) -> None:
        if capacity_bytes < 1:
            raise ValueError("capacity_bytes must be >= 1")
        if owner_bytes is not None and owner_bytes < 1:
            raise ValueError("owner_bytes must be >= 1")
        self.capacity_bytes = capacity_bytes
        self.owner_bytes = capacity_bytes if owner_bytes is None else owner_bytes
        self.nbytes = 0
        self._items: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        self._held: collections.Counter[str | None] = collections.Counter()

    def __len__(self) -> int:
        return len(self._items)

    def held_by(self, owner: str | None) -> int:
        """Bytes of the images ``owner`` holds."""
        return self._held[owner]

    def get(self, image_id: str) -> Image | None:
        entry = self._items.get(image_id)
        if entry is None:
            return None
        self._items.move_to_end(image_id)
        return entry.image

    def put(self, image: Image, owner: str | None = None) -> tuple[str, bool]:
        """Store ``image`` for ``owner``; returns (its id, whether an upload, a put with an
        owner, already held it). An owned image stays owned when put again without one."""
        key = image.content_hash
        old = self._items.pop(key, None)
        uploaded = old is not None and old.owner is not None
        if old is not None:
            self._release(old)
            if owner is None:
                owner = old.owner
        entry = _Entry(image, owner)
        self._items[key] = entry
        self._held[owner] += image.nbytes
        self.nbytes += image.nbytes
        self._evict_own(key, owner)
        while self.nbytes > self.capacity_bytes and len(self._items) > 1:
            _, evicted = self._items.popitem(last=False)
            self._release(evicted)
        return key, uploaded

    def _evict_own(self, keep: str, owner: str | None) -> None:
        """Drop ``owner``'s oldest images (never ``keep``) until it is within its share."""
        if self._held[owner] <= self.owner_bytes:
            return
        for key in [k for k, e in self._items.items() if e.owner == owner and k != keep]:
            self._release(self._items.pop(key))
            if self._held[owner] <= self.owner_bytes:
                return

    def _release(self, entry: _Entry) -> None:
        size = entry.image.nbytes
        self.nbytes -= size
        self._held[entry.owner] -= size
        if not self._held[entry.owner]:
            del self._held[entry.owner]


_HASH_ON_LOOP_BYTES = 1 << 20


def _digest(data: bytes) -> bytes:
    return blake3.blake3(data).digest()


class _HasImage(Protocol):
    def WhichOneof(self, name: str) -> str | None: ...


def image_device(config: ServerConfig) -> torch.device:
    """Where crops are made: ``--image-device``, auto following the model (``--device``,
    else CUDA when present)."""
    return torch.device(
        config.image_device
        if config.image_device != "auto"
        else config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    )


def host_image_preparer(config: ServerConfig) -> ImagePreparer:
    """The server's image path when the engine runs in its own process: header checks,
    limits, budget and decode here, into shared memory; the crops are made by the engine
    process (`crop_maker`), so this process never touches the GPU."""
    return ImagePreparer(
        config.image_limits,
        resize=config.image_resize,
        device="cpu",
        reduced_decode=config.image_reduced_decode,
        budget=DecodeBudget(config.image_decode_budget),
    )


def engine_decode_min_pixels(config: ServerConfig) -> int:
    """With an engine process: JPEGs of at least this many pixels are left encoded for it to
    decode on its GPU (``--image-gpu-decode-min-pixels`` where crops are made on CUDA); 0:
    the server decodes every picture."""
    if image_device(config).type != "cuda":
        return 0
    return config.image_gpu_decode_min_pixels


def crop_maker(config: ServerConfig) -> ImagePreparer:
    """What makes an engine's crops of host-decoded images, and decodes the JPEGs left
    encoded for it: the server's resize mode, on the image device, with the GPU decoder
    of :func:`image_preparer` (ValueError at start where it does not work)."""
    if engine_decode_min_pixels(config) > 0:
        return image_preparer(config)
    return ImagePreparer(
        config.image_limits,
        resize=config.image_resize,
        device=image_device(config),
        keep_source=bool(config.segment_refiner),
    )


def image_preparer(config: ServerConfig) -> ImagePreparer:
    """The server's image path: limits, resize mode, device, reduced decode, GPU JPEG decode,
    decode budget.

    ``image_device`` auto follows the model: ``--device``, else CUDA when present.

    Raises:
        ValueError: GPU JPEG decode is asked for on a CUDA image device where the chosen
            decoder does not work (nvImageCodec or torchvision missing, no JPEG engines, no
            nvJPEG): said at start, not found out later from the host CPU.
    """
    device = image_device(config)
    min_pixels = config.image_gpu_decode_min_pixels
    decoder: GpuDecoder | None = None
    if min_pixels > 0 and device.type != "cuda":
        log.warning("--image-gpu-decode-min-pixels has no effect: images are cropped on %s", device)
    elif min_pixels > 0:
        try:
            decoder = gpu_decoder(device, config.image_gpu_decoder)
        except RuntimeError as err:
            raise ValueError(
                f"--image-gpu-decode-min-pixels {min_pixels} with --image-gpu-decoder "
                f"{config.image_gpu_decoder}: {err}; install nvidia-nvimgcodec (the build for "
                "this CUDA) or the torchvision built for this torch, or set it to 0"
            ) from err
    return ImagePreparer(
        config.image_limits,
        resize=config.image_resize,
        device=device,
        reduced_decode=config.image_reduced_decode,
        gpu_decode_min_pixels=min_pixels,
        gpu_decoder=decoder,
        budget=DecodeBudget(config.image_decode_budget),
        # The segment refiner reads the picture again after the answer.
        keep_source=bool(config.segment_refiner),
    )


class ImageResolver:
    """Turns a request's ``image`` oneof into an `Image`."""

    # Digests of encoded bytes remembered (a few hundred bytes each).
    MAX_KNOWN_ENCODINGS = 4096

    def __init__(
        self,
        limits: ImageLimits,
        cache: ImageCache,
        executor: Executor,
        preparer: ImagePreparer | None = None,
        host_only: bool = False,
        encoded_min_pixels: int = 0,
    ) -> None:
        self.limits = limits
        self.cache = cache
        self._executor = executor
        self.preparer = preparer if preparer is not None else ImagePreparer(limits)
        # host_only: images stop at decoded pixels in shared memory (`HostImage`), for an
        # engine process to crop, or, JPEGs of ``encoded_min_pixels`` or more, at their
        # checked header (`EncodedImage`), for it to decode on its GPU.
        self._encoded_min_pixels = encoded_min_pixels if host_only else 0
        self._prepare: Callable[[bytes, bytes], Image] = (
            self._decode_shared if host_only else self._prepare_here
        )
        # BLAKE3 of encoded bytes -> content hash in `cache`: the same upload sent again
        # skips decoding and tiling (tens of milliseconds of CPU per 800x600 picture).
        self._by_encoding: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        # Digest -> the decode in progress for it (requests racing with the same bytes).
        self._decoding: dict[bytes, asyncio.Future[Image]] = {}
        self.encoding_hits = 0

    async def decode(self, data: bytes, field: str = "image_bytes") -> Image:
        """Decode and tile in the thread pool; bad data -> INVALID_ARGUMENT naming ``field``.

        The digest of the encoded bytes comes first: bytes seen before (and still
        cached) cost no decoding, no header parse, nothing but the hash. Otherwise the
        header is checked (format, size, pixels per byte, orientation), the decode
        waits for its share of the decode budget, and the crops are made on the
        preparer's device."""
        loop = asyncio.get_running_loop()
        if len(data) > _HASH_ON_LOOP_BYTES:  # keep the event loop responsive for big uploads
            digest = await loop.run_in_executor(self._executor, _digest, data)
        else:
            digest = _digest(data)
        known = self._by_encoding.get(digest)
        if known is not None:
            image = self.cache.get(known)
            if image is not None:
                self._by_encoding.move_to_end(digest)
                self.encoding_hits += 1
                return image
        # The decode runs as its own future, shared by every request racing with the same
        # new bytes, and finishes (into the cache) even if they are all cancelled.
        pending = self._decoding.get(digest)
        if pending is None:
            pending = loop.run_in_executor(self._executor, self._prepare, data, digest)
            self._decoding[digest] = pending
            pending.add_done_callback(functools.partial(self._decoded, digest))
        else:
            self.encoding_hits += 1
        try:
            return await asyncio.shield(pending)
        except ImageError as err:
            raise invalid(field, f"{err.reason.value}: {err.message}") from None

    def _prepare_here(self, data: bytes, digest: bytes) -> PreparedImage:
        return self.preparer.prepare(data)

    def _decode_shared(self, data: bytes, digest: bytes) -> HostImage | EncodedImage:
        """``digest``: the BLAKE3 of ``data``, which an encoded image's key reuses."""
        pool = pixel_pool()
        if self._encoded_min_pixels > 0:
            encoded = self.preparer.encoded(data, self._encoded_min_pixels, digest)
            if encoded is not None:
                # Through shared memory like pixels: megabytes written down the command
                # pipe would hold the event loop until the engine process had read them.
                shared = share(np.frombuffer(data, np.uint8), pool)
                return dataclasses.replace(encoded, data=shared)
        image = self.preparer.decode_host(data, alloc=pool.array)
        pixels = share(image.pixels, pool)  # formats other than JPEG decode elsewhere: a copy
        return image if pixels is image.pixels else dataclasses.replace(image, pixels=pixels)

    def _decoded(self, digest: bytes, future: asyncio.Future[Image]) -> None:
        """Remember a finished decode (runs on the loop before its waiters resume)."""
        del self._decoding[digest]
        if future.cancelled() or future.exception() is not None:
            return
        image = future.result()
        self.cache.put(image)
        self._by_encoding[digest] = image.content_hash
        self._by_encoding.move_to_end(digest)
        while len(self._by_encoding) > self.MAX_KNOWN_ENCODINGS:
            self._by_encoding.popitem(last=False)

    async def resolve(self, request: _HasImage) -> Image | None:
        """The request's image, or None when it sets neither image_bytes nor image_id."""
        which = received.image_field(request)
        if which is None:
            return None
        if which == "image_id":
            image_id: str = request.image_id  # type: ignore[attr-defined]
            image = self.cache.get(image_id)
            if image is None:
                raise invalid(
                    "image_id",
                    f"unknown image id {image_id[:80]!r} (never uploaded "
                    "or evicted from the cache: call EncodeImage again)",
                )
            return image
        # Large pictures come attached (received.py): reading the field would copy it on the
        # loop. A picture the message holds itself is under a megabyte (rpc/intake.py).
        return await self.decode(received.image_bytes(request))
