"""One CUDA graph manager for every captured forward (decode buckets, vision crop counts),
and the bucket sizes the runtime's parts capture graphs for.

Model-agnostic: the caller gives the keys, a ``prepare(key)`` that fills static inputs and a
``run(key)`` that enqueues the work and returns its output tensor. Keys are captured largest
first into one shared memory pool, so smaller graphs reuse the larger ones' memory.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Generic, TypeVar

import torch

from vlm_server.gc_pauses import collector_paused

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)

# Within `warm_ups_only`: `GraphSet.capture` runs its warm-ups and captures nothing (a pass
# that only makes Triton meet its kernels, precompile.py).
_warm_ups_only = False


@contextlib.contextmanager
def warm_ups_only() -> Iterator[None]:
    """Within: every `GraphSet.capture` runs each key's warm-up only, keeping nothing."""
    global _warm_ups_only
    _warm_ups_only = True
    try:
        yield
    finally:
        _warm_ups_only = False


def graph_buckets(max_batch: int) -> list[int]:
    """Batch sizes with a captured graph: 1, 2, 4, 8, then multiples of 8, up to max_batch."""
    sizes = [n for n in (1, 2, 4) if n < max_batch]
    sizes += list(range(8, max_batch, 8))
    return [*sizes, max_batch]


def token_buckets(max_tokens: int, smallest: int = 16) -> list[int]:
    """Token counts with a captured mixed-step graph: about 1.5x apart (16, 24, 32, 48, ...),
    so padding wastes at most a third of a step, up to and including ``max_tokens``."""
    sizes, n = [], smallest
    while n < max_tokens:
        sizes.append(n)
        n = n * 3 // 2 if n & (n - 1) == 0 else n * 4 // 3
    return [*sizes, max_tokens]


def prompt_buckets(max_tokens: int) -> list[int]:
    """Riding-prompt token counts with a captured prefix graph: powers of two from 32, up to
    and including ``max_tokens`` (none when 0)."""
    sizes, n = [], 32
    while n < max_tokens:
        sizes.append(n)
        n *= 2
    return [*sizes, max_tokens] if max_tokens else []


def image_tilings(max_crops: int) -> list[tuple[int, int]]:
    """Every (h, w) tiling of at most ``max_crops`` local crops, most crops first."""
    tilings = [
        (h, w)
        for h in range(1, max_crops + 1)
        for w in range(1, max_crops + 1)
        if h * w <= max_crops
    ]
    return sorted(tilings, key=lambda hw: (-hw[0] * hw[1], hw))


def bucket(sizes: list[int], n: int) -> int | None:
    """The smallest of ``sizes`` (ascending) that holds ``n``; None when none does."""
    for size in sizes:
        if size >= n:
            return size
    return None


class GraphSet(Generic[K]):
    """CUDA graphs by key; each replays its capture and returns the captured output."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._graphs: dict[K, tuple[torch.cuda.CUDAGraph, object]] = {}
        self.pool_bytes = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def __bool__(self) -> bool:
        return bool(self._graphs)

    def __contains__(self, key: K) -> bool:
        return key in self._graphs

    def capture(
        self,
        keys: Iterable[K],
        prepare: Callable[[K], None],
        run: Callable[[K], object],
        stream: torch.cuda.Stream,
        progress: bool = True,
    ) -> None:
        """Capture ``run(key)`` for each key, in the order given (largest first)."""
        from tqdm import tqdm

        todo = list(keys)
        device = stream.device
        if _warm_ups_only:
            with torch.cuda.stream(stream):
                for key in todo:
                    prepare(key)
                    run(key)
            stream.synchronize()  # start-up only: the pass ends before anything compiles
            return
        pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize(device)  # start-up only: inputs were made on other streams
        before = torch.cuda.memory_reserved(device)
        started = time.perf_counter()
        with collector_paused():
            for key in tqdm(todo, desc=f"capturing {self.name} graphs", disable=not progress):
                with torch.cuda.stream(stream):
                    prepare(key)
                    run(key)  # warm-up: kernels compiled and autotuned outside the capture
                stream.synchronize()  # start-up only: capture needs a quiet stream
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = run(key)
                self._graphs[key] = (graph, out)
        torch.cuda.synchronize(device)  # start-up only
        self.pool_bytes = torch.cuda.memory_reserved(device) - before
        log.info(
            "captured %d %s graphs in %.1f s (%.0f MiB reserved)",
            len(todo),
            self.name,
            time.perf_counter() - started,
            self.pool_bytes / 2**20,
        )

    def replay(self, key: K) -> object:
        """Replay the graph of ``key`` on the current stream; returns what its capture
        returned (the same tensor every time). KeyError when ``key`` has no graph."""
        graph, out = self._graphs[key]
        graph.replay()
        return out


@contextlib.contextmanager
def sm_carveout(sms: int) -> Iterator[None]:
    """Matmuls launched (or captured) inside leave ``sms`` SMs free (cuBLAS's SM count
    target; 0: no change). A captured graph keeps the setting of its capture."""
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if sms <= 0 or setter is None:
        yield
        return
    before = torch._C._get_sm_carveout_experimental()
    setter(sms)
    try:
        yield
    finally:
        setter(before)
