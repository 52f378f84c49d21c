"""An adapter's deltas on a parallel block's fused decode products (models/common/
fused_products.py), with the shrinks riding the products and the expand.

The product over the normed input computes, beside QKV and fc1, that input times every
resident slot's stacked A of qkv, proj and fc1 (models/common/skinny_gemm.py's extra columns):
the input is read once, the A's stream at the product's bandwidth and the shrink's launch is
gone. Each token's expand then reads its own slot's columns (models/common/lora_kernel.py;
in a decode step models/common/lora_step.py). Where fc2's shrink runs is `FC2_SHRINK`'s; by
default (`OVERLAP`) a decode step computes qkv's delta first, for the attention, and the rest
of the adapter work on a second stream beside the attention and the branch product.

Every slot's columns are computed, used or not: a slot being written meanwhile yields garbage
only in its own columns, which no token of this batch reads (a token's slot is never written
while it runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from vlm_server.models.common import side_stream
from vlm_server.models.common.fused_products import BlockProducts, with_extra
from vlm_server.models.lora.bank import LoraBatch, Shrunk

SHARED = ("qkv", "proj", "fc1")  # the targets reading the block's normed input
# Where fc2's shrink runs: "apart", a grouped shrink of its own (also the fallback where the
# expand cannot fold it: no fc1 delta to fuse the GELU with); "expand", in the expand that
# finishes the hidden layer (no launch, but longer fc1 programs); "branch", in the branch
# product over every slot's A's (its extra programs push the split-K launch past one wave).
# "apart" by measurement: 8 rank-32 adapters at 32 rows, the decode period 1.209x that without
# adapters against 1.273x "expand" (H100).
FC2_SHRINK: Literal["expand", "branch", "apart"] = "apart"
# Every resident slot's A is read, used or not: beyond this fraction of the product's weight
# bytes (a bank of many slots of high rank) the grouped shrink, which reads only the slots
# the batch holds, runs instead.
MAX_EXTRA = 0.25


# With the decode step's kernels (models/common/lora_step.py) fc1's delta with its GELU, then
# fc2's shrink and proj's and fc2's deltas (into a buffer of their own, which the next norm
# adds) run on a second stream beside the attention and the branch product: the attention
# needs only qkv's delta, the branch product only the hidden layer. 32 rows over 8 rank-32
# adapters, H100: the period 1.119x that without adapters, 1.198x in one stream.
OVERLAP = True


@dataclass(frozen=True)
class Shrinks:
    """A block's shrinks after `block_inputs`: qkv's, proj's and fc1's over the normed input;
    fc2's over the hidden layer where the expand computed it (None: `branch` computes it).
    ``side``: the stream still computing the hidden layer, fc2's shrink and ``delta``
    (`branch_and_delta` waits for it)."""

    shared: Shrunk
    fc2: Shrunk | None = None
    side: torch.cuda.Stream | None = None
    hidden_ready: torch.cuda.Event | None = None  # on ``side``: the hidden layer is done
    delta: torch.Tensor | None = None  # proj's and fc2's deltas summed [rows, D] fp32


def worth_folding(a: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether every slot's A (``a`` [slots, R, K_a]) adds at most `MAX_EXTRA` of ``weight``'s
    bytes to a product."""
    return a.numel() <= MAX_EXTRA * weight.numel()


def block_inputs(
    prod: BlockProducts, lora: LoraBatch, layer: int, h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, Shrinks]:
    """Normed input [..., D] -> (qkv with its delta, GELU(fc1 + its delta), the shrinks so
    far): one product (with the shared shrink), one expand (with fc2's, per `FC2_SHRINK`)."""
    fold = lora.shrink_weights(layer, SHARED)
    if fold is None or not worth_folding(fold[1], prod.w_in):
        qkv, fc1 = prod.qkv_and_fc1(h)
        shared = lora.shrink(layer, h, SHARED)
    else:
        group, a = fold
        qkv, fc1, sums = prod.qkv_and_fc1_shrunk(h, a)
        shared = lora.shrunk(h, group, sums)
    outs = [(shared, "qkv", qkv), (shared, "fc1", fc1)]
    if FC2_SHRINK == "apart" and OVERLAP and lora.step_fits(h, shared):
        # qkv's delta first, for the attention; then fc1's, its GELU and fc2's shrink (on a
        # second stream where there are streams).
        (qkv,) = lora.expand(layer, outs[:1])
        side = side_stream.beside(h.device) if h.is_cuda else None
        ready = None
        with side_stream.on(side):
            (hidden,) = lora.expand(layer, outs[1:], True)
            if side is not None:
                ready = torch.cuda.Event()
                ready.record(side)
            fc2 = lora.shrink(layer, hidden, ("fc2",))
            delta = lora.delta_sum(layer, [(shared, "proj"), (fc2, "fc2")], prod.w_out.shape[0])
        return qkv, hidden, Shrinks(shared, fc2, side, ready, delta)
    if FC2_SHRINK == "expand":
        (qkv, hidden), fc2 = lora.expand_then_shrink(layer, outs, "fc2")
    else:
        (qkv, hidden), fc2 = lora.expand(layer, outs, True), None
    return qkv, hidden, Shrinks(shared, fc2)


def branch(
    prod: BlockProducts,
    lora: LoraBatch,
    layer: int,
    attn: torch.Tensor,
    hidden: torch.Tensor,
    shrinks: Shrinks,
) -> torch.Tensor:
    """The finished `BlockProducts.branch` with proj's and fc2's deltas added: the last
    block's, which no next norm finishes."""
    out, delta = branch_and_delta(prod, lora, layer, attn, hidden, shrinks, partials=False)
    return out if delta is None else with_extra(out, delta)


def branch_and_delta(
    prod: BlockProducts,
    lora: LoraBatch,
    layer: int,
    attn: torch.Tensor,
    hidden: torch.Tensor,
    shrinks: Shrinks,
    partials: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`BlockProducts.branch_parts` (``partials``; else the finished `BlockProducts.branch`)
    with proj's and fc2's deltas added (into split 0 where the product splits K); or, where
    `block_inputs` computed those deltas apart, the branch without them and the deltas
    ([rows, D] fp32, ready on the current stream) for the next norm to add
    (`BlockProducts.add_parts_and_norm`'s ``extra``)."""
    main = torch.cuda.current_stream() if shrinks.side is not None else None
    if main is not None and shrinks.delta is not None and shrinks.hidden_ready is not None:
        main.wait_event(shrinks.hidden_ready)  # the branch needs the hidden layer only
    elif main is not None:
        main.wait_stream(shrinks.side)
    if shrinks.delta is not None:
        parts = prod.branch_parts(attn, hidden) if partials else prod.branch(attn, hidden)
        if main is not None:
            main.wait_stream(shrinks.side)  # the deltas, after the branch's own launch
        return parts, shrinks.delta
    fc2 = shrinks.fc2
    fold = None
    if fc2 is None and FC2_SHRINK == "branch":
        fold = lora.shrink_weights(layer, ("fc2",))
    if fold is not None and worth_folding(fold[1], prod.w_out):
        parts, sums = prod.branch_parts_shrunk(attn, hidden, fold[1], partials)
        fc2 = lora.shrunk(hidden, fold[0], sums)
    else:
        if fc2 is None:
            fc2 = lora.shrink(layer, hidden, ("fc2",))
        parts = prod.branch_parts(attn, hidden) if partials else prod.branch(attn, hidden)
    # Split sums [splits, rows, D] take the deltas into split 0; a finished branch, itself.
    into = parts[0] if partials and parts.dim() == 3 else parts
    lora.expand_sum(layer, [(shrinks.shared, "proj"), (fc2, "fc2")], into)
    return parts, None
