"""Segments finished off the scheduler's thread: their geometry, then their refinement.

A segment's answer ends in a mask at the picture's size (core/outputs.py: `later`), 4 ms at
800x600 and 40 at 12 MP on one core, which the scheduler's thread would otherwise spend while
every other stream waits for its next step. So a segment request's final event waits here:
one worker thread builds the segmentation from the finished grammar, and, with a segmentation
refiner (``--segment-refiner``, a model family's; the engine only calls it), reads the
picture's pixels again and runs it (a vision-tower pass and its head, on a CUDA stream of its
own where the model is on CUDA). The streamed box and path deltas stay the decoded ones. The
scheduler's loop delivers the final events (`take`), so events still leave from one thread. A
refiner that fails, or that keeps nothing, leaves the decoded segmentation as the answer; the
failure is logged. Geometry that fails ends its request with INTERNAL, naming the cause.

Pixels come from the request's image: a host-decoded picture's own pixels, what a prepared
picture kept (`PreparedImage.source`: the pixels, or the encoded bytes of a GPU decode, decoded
again on the host), or the bytes of a JPEG the engine was to decode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
from collections.abc import Callable

import numpy as np
import torch

from decoding.segment_output import SegmentResult
from image_pipeline import EncodedImage, HostImage, ImagePreparer, PreparedImage
from vlm_server.engine.api import (
    Emitted,
    EngineError,
    ErrorCode,
    Finished,
    GenerationRequest,
    Segmentation,
)
from vlm_server.engine.core.outputs import Output, segmentation
from vlm_server.models.interface import SegmentRefine

log = logging.getLogger(__name__)

_Job = tuple[GenerationRequest, Finished, Callable[[Emitted], None], Output | None]


def pixels_of(image: object, preparer: ImagePreparer) -> np.ndarray:
    """The upright pixels of a request's image (see the module docstring); ValueError where
    none were kept."""
    if isinstance(image, HostImage):
        return image.pixels
    if isinstance(image, PreparedImage):
        if isinstance(image.source, np.ndarray):
            return image.source
        if image.source is None:
            raise ValueError("the picture's pixels were not kept (a preparer without keep_source)")
        data: bytes = image.source
    elif isinstance(image, EncodedImage):
        data = image.data if isinstance(image.data, bytes) else image.data.tobytes()
    else:
        raise ValueError(f"no pixels in a {type(image).__name__}")
    return preparer.decode_host(data).pixels


def decoded_segment(seg: Segmentation) -> SegmentResult:
    """The refiner's input from the API's segmentation (its box, path, polygons, mask)."""
    return SegmentResult(
        box=(seg.box.x_min, seg.box.y_min, seg.box.x_max, seg.box.y_max),
        path=seg.svg_path,
        polygons=[[(p.x, p.y) for p in poly] for poly in seg.polygons],
        mask_size=(seg.mask_height, seg.mask_width),
        mask_counts=list(seg.mask_rle),
        box_path=seg.box_path,
    )


class SegmentFinisher:
    """The worker and its queues: `submit` on the scheduler's thread, `take` there too."""

    def __init__(
        self,
        refine: SegmentRefine | None,
        preparer: ImagePreparer,
        wake: Callable[[], None],
        device: torch.device,
    ) -> None:
        self._refine, self._preparer, self._wake = refine, preparer, wake
        cuda = refine is not None and device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if cuda else None
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._done: list[tuple[Callable[[Emitted], None], Emitted]] = []
        self._pending = 0  # submitted, not yet taken
        self._thread = threading.Thread(target=self._run, name="segment-finisher", daemon=True)
        self._thread.start()

    def submit(
        self,
        request: GenerationRequest,
        result: Finished,
        emit: Callable[[Emitted], None],
        output: Output | None = None,
    ) -> None:
        """Complete ``result`` (``output``'s `complete_later`, where given), refine its
        segmentation where a refiner is set, then hand it to ``emit`` (via `take`)."""
        with self._lock:
            self._pending += 1
        self._jobs.put((request, result, emit, output))

    def pending(self) -> int:
        """Final events submitted and not yet taken."""
        with self._lock:
            return self._pending

    def take(self) -> list[tuple[Callable[[Emitted], None], Emitted]]:
        """The final events ready to deliver, in the order they were finished."""
        with self._lock:
            done, self._done = self._done, []
            self._pending -= len(done)
        return done

    def close(self) -> None:
        """Finish every submitted job, then stop the worker."""
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            request, result, emit, output = job
            event: Emitted = result
            try:
                if output is not None:
                    output.complete_later(result, request)
            except Exception as err:
                log.exception("a segment's geometry failed")
                event = EngineError(ErrorCode.INTERNAL, f"the segment's geometry failed: {err}")
            else:
                if self._refine is not None:
                    event = self._refined(request, result)
            with self._lock:
                self._done.append((emit, event))
            self._wake()

    def _refined(self, request: GenerationRequest, result: Finished) -> Finished:
        seg = result.segmentation
        if seg is None or self._refine is None:
            return result
        try:
            pixels = pixels_of(request.image, self._preparer)
            stream = torch.cuda.stream(self._stream) if self._stream else contextlib.nullcontext()
            with torch.inference_mode(), stream:
                refined = self._refine(pixels, decoded_segment(seg))
        except Exception:
            log.exception("segment refinement failed: the decoded segment is the answer")
            return result
        if refined is None:
            return result
        return dataclasses.replace(result, segmentation=segmentation(refined))
