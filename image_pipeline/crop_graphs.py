"""CUDA graphs of the crop path, per source size.

Making the crops of an 800x600 picture is some forty small kernels (resize passes, casts,
slices): well under a millisecond of GPU work, but a few milliseconds of launches on the host
thread that issues them, ahead of the vision tower. Pictures of one size (a camera's, a
client's) take the same kernels every time, so a size seen a second time is captured once
as a graph (the upload from pinned memory into a fixed input, then the crops into a fixed
output) and replayed from then on: one copy and one launch.

A size seen once runs eagerly (capturing costs more than one eager run), and only sizes
up to ``max_pixels`` are kept (a graph holds its intermediates: tens of MiB per size).
The replays are queued on the caller's stream; what `CropGraphs.crops` returns is valid
until the next call, which may overwrite it (the caller consumes it in stream order).
"""

from __future__ import annotations

import collections
import gc
from dataclasses import dataclass, field

import numpy as np
import torch

from .crops import make_crops
from .prepared import HostImage, ImagePreparer, pinned_copy

__all__ = ["CropGraphs"]

# Sizes remembered as seen once (a few dozen bytes each).
_SEEN = 256


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    pixels: torch.Tensor  # the fixed input, uint8 [h, w, 3] on the device
    crops: torch.Tensor  # the fixed output
    keep: list = field(default_factory=list)  # weights the graph reads, kept alive
    last_replay: torch.cuda.Event | None = None


class CropGraphs:
    """Crops of host-decoded images, through a graph per (height, width, tiling) seen twice.

    Not thread-safe: one thread (an engine's scheduler) owns it.

    Args:
        preparer: whose tiling, resize mode, resampler and device the crops follow (CUDA).
        sizes: graphs kept (least recently used go first); 0 captures none.
        max_pixels: largest source (height x width) captured.
        capture_stream: where graphs are captured (default: a stream of its own); a graph
            keeps the SM partition of the stream it was captured on.
    """

    def __init__(
        self,
        preparer: ImagePreparer,
        sizes: int = 4,
        max_pixels: int = 2_100_000,
        capture_stream: torch.cuda.Stream | None = None,
    ):
        if preparer.device.type != "cuda":
            raise ValueError("crop graphs need a CUDA preparer")
        if sizes < 0 or max_pixels < 0:
            raise ValueError("sizes and max_pixels must be >= 0")
        self.preparer = preparer
        self.sizes = sizes
        self.max_pixels = max_pixels
        self._graphs: collections.OrderedDict[tuple, _Graph] = collections.OrderedDict()
        self._seen: collections.OrderedDict[tuple, None] = collections.OrderedDict()
        # Evicted graphs whose last replay may still run: freed once it has.
        self._retired: list[_Graph] = []
        self._capture_stream: torch.cuda.Stream | None = capture_stream
        self.captures = 0
        self.replays = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def crops(self, image: HostImage) -> torch.Tensor:
        """The crops of ``image``, queued on the current stream (valid until the next call)."""
        pixels = image.pixels
        key = (pixels.shape[0], pixels.shape[1], image.tiling)
        self._free_retired()
        entry = self._graphs.get(key)
        if entry is None:
            if not self._worth_capturing(key, pixels):
                return self.preparer.crops_of(image)
            entry = self._capture(key, pixels, image)
        else:
            self._graphs.move_to_end(key)
            entry.pixels.copy_(pinned_copy(pixels), non_blocking=True)
        entry.graph.replay()
        self.replays += 1
        if entry.last_replay is None:
            entry.last_replay = torch.cuda.Event()
        entry.last_replay.record()
        return entry.crops

    def _worth_capturing(self, key: tuple, pixels: np.ndarray) -> bool:
        if self.sizes == 0 or pixels.shape[0] * pixels.shape[1] > self.max_pixels:
            return False
        if key in self._seen:
            del self._seen[key]
            return True
        self._seen[key] = None
        if len(self._seen) > _SEEN:
            self._seen.popitem(last=False)
        return False

    def _capture(self, key: tuple, pixels: np.ndarray, image: HostImage) -> _Graph:
        p = self.preparer
        stream = torch.cuda.current_stream(p.device)
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(p.device)
        side = self._capture_stream
        fixed = torch.empty(pixels.shape, dtype=torch.uint8, device=p.device)
        fixed.copy_(pinned_copy(pixels), non_blocking=True)
        side.wait_stream(stream)
        keep: list = []
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            # Eager once on the capture stream first: prepares (and uploads) the resize
            # weights outside the capture, where a pageable copy would be refused.
            make_crops(fixed, image.tiling, p.tiling, p.resize, p.resampler)
            # A collection in this thread mid-capture could destroy an unreachable graph or
            # event, which CUDA refuses while capturing (serving time: no gc.collect first).
            collector_was_on = gc.isenabled()
            gc.disable()
            # Only this thread's calls are checked: other threads may use the device.
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                out = make_crops(fixed, image.tiling, p.tiling, p.resize, p.resampler, keep)
            finally:
                graph.capture_end()
                if collector_was_on:
                    gc.enable()
        stream.wait_stream(side)
        entry = _Graph(graph, fixed, out, keep)
        self._graphs[key] = entry
        self.captures += 1
        while len(self._graphs) > self.sizes:
            _, old = self._graphs.popitem(last=False)
            self._retired.append(old)
        return entry

    def _free_retired(self) -> None:
        if self._retired:
            self._retired = [
                g for g in self._retired if g.last_replay is not None and not g.last_replay.query()
            ]
