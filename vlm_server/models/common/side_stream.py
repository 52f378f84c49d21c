"""A second CUDA stream beside the current one, for work of a block that the block's other
work does not wait for (an MLP's product beside the attention, an adapter's deltas).

One side stream per main stream, made once: forwards on two streams (the decode steps and a
prefill beside them) never wait for each other's side work. Every fork is joined within the
block that made it (``torch.cuda.current_stream().wait_stream(side)``), so a CUDA graph
capture sees a joined stream; tensors made on the side stream are freed into its own pool
(the caching allocator's per-stream blocks) and so are not reused by the main stream before
the join.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_SIDE: dict[int, torch.cuda.Stream] = {}


def beside(device: torch.device) -> torch.cuda.Stream:
    """The side stream of ``device``'s current stream."""
    main = torch.cuda.current_stream(device)
    side = _SIDE.get(main.cuda_stream)
    if side is None:
        side = _SIDE.setdefault(main.cuda_stream, torch.cuda.Stream(device=main.device))
    return side


@contextlib.contextmanager
def on(side: torch.cuda.Stream | None) -> Iterator[None]:
    """Run the block on ``side`` (after the current stream's work so far), or in place."""
    if side is None:
        yield
        return
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        yield
