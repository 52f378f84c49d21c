"""A function of fixed-shape tensors, captured once in a CUDA graph and replayed per call.

For a model's side work that runs outside the engine's steps (the segment refiner's tower
pass and head rounds): dozens of small kernels whose launches cost more host time than the
device spends on them. The function must be capturable: no host synchronization, no
data-dependent shapes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vlm_server.gc_pauses import collector_paused

Outputs = torch.Tensor | tuple[torch.Tensor, ...]


class GraphedCall:
    """``fn`` over static copies of its inputs: each call copies the inputs in, replays the
    graph on the current stream and returns the captured outputs. The outputs are the same
    tensors on every call (read them before the next call): one caller at a time."""

    def __init__(self, fn: Callable[..., Outputs], *example: torch.Tensor) -> None:
        """Captures ``fn(*example)`` (shapes, dtypes and device fixed from ``example``)
        after two warm-up calls on a side stream (kernels compiled and tuned outside the
        capture). Synchronizes the device: a start-up cost, not a per-call one."""
        if not example or any(t.device.type != "cuda" for t in example):
            raise ValueError("GraphedCall: needs CUDA tensors as inputs")
        device = example[0].device
        self._inputs = tuple(t.detach().clone() for t in example)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):
                fn(*self._inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        self._graph = torch.cuda.CUDAGraph()
        # thread_local: other threads' launches on their own streams stay legal meanwhile.
        capture = torch.cuda.graph(self._graph, capture_error_mode="thread_local")
        with collector_paused(), torch.inference_mode(), capture:
            self._outputs = fn(*self._inputs)
        torch.cuda.synchronize(device)  # start-up only: the capture's warm-up is done

    def __call__(self, *inputs: torch.Tensor) -> Outputs:
        if len(inputs) != len(self._inputs):
            raise ValueError(f"GraphedCall: {len(inputs)} inputs, captured {len(self._inputs)}")
        for i, (dst, src) in enumerate(zip(self._inputs, inputs, strict=True)):
            if src.shape != dst.shape:
                raise ValueError(
                    f"GraphedCall: input {i} has shape {list(src.shape)}, "
                    f"captured {list(dst.shape)}"
                )
            dst.copy_(src)
        self._graph.replay()
        return self._outputs
