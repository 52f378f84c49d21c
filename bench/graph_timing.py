"""The probes' GPU clock: the median replay time of a function captured as one CUDA graph."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def graph_ms(
    fn: Callable[[], object],
    reps: int = 20,
    stream: torch.cuda.Stream | None = None,
    calls: int = 1,
) -> float:
    """Median device ms of one ``fn()`` call, from ``reps`` replays of a CUDA graph of
    ``calls`` calls captured on ``stream`` (a new side stream by default), after three eager
    calls that compile and warm its kernels."""
    side = stream or torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    side.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        for _ in range(calls):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    times = []
    with torch.cuda.stream(side):
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            graph.replay()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / calls)
    return statistics.median(times)
