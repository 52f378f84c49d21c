"""One CUDA graph manager for every captured forward (decode buckets, vision crop counts).

Model-agnostic: the caller gives the keys, a ``prepare(key)`` that fills static inputs and a
``run(key)`` that enqueues the work and returns its output tensor. Keys are captured largest
first into one shared memory pool, so smaller graphs reuse the larger ones' memory.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Generic, TypeVar

import torch

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic collector paused inside: a collection during a capture may destroy an
    unreachable graph or event of an earlier engine, a call CUDA refuses while a stream
    captures (the capture is then lost). Garbage made before is collected first, once: a
    full collection costs tens of milliseconds in a large process."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


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
