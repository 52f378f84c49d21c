"""An adapter's deltas on a parallel block's fused decode products (models/common/
fused_products.py), with the shrinks riding the products.

The product over the normed input computes, beside QKV and fc1, that input times every
resident slot's stacked A of qkv, proj and fc1 (models/common/skinny_gemm.py's extra columns):
the input is read once, the A's stream at the product's bandwidth and the shrink's launch is
gone. Each token's expand then reads its own slot's columns (models/common/lora_kernel.py).
Likewise the branch product, whose second input is the hidden layer, can compute fc2's shrink.
Per block the adapters then add two launches (the two expands) instead of four.

Every slot's columns are computed, used or not: a slot being written meanwhile yields garbage
only in its own columns, which no token of this batch reads (a token's slot is never written
while it runs).
"""

from __future__ import annotations

import torch

from vlm_server.models.common.fused_products import BlockProducts
from vlm_server.models.lora.bank import LoraBatch, Shrunk

SHARED = ("qkv", "proj", "fc1")  # the targets reading the block's normed input
# fc2's shrink in the branch product (else a launch of its own). Off by measurement: its
# extra programs push the split-K launch past one wave (144 programs on 132 SMs), and the
# period with 8 rank-32 adapters at 32 rows was 1.237x without adapters folded, 1.206x with
# a launch of its own (H200, bench.lora_bench, one machine start).
FOLD_BRANCH = False
# Every resident slot's A is read, used or not: beyond this fraction of the product's weight
# bytes (a bank of many slots of high rank) the grouped shrink, which reads only the slots
# the batch holds, runs instead.
MAX_EXTRA = 0.25


def worth_folding(a: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether every slot's A (``a`` [slots, R, K_a]) adds at most `MAX_EXTRA` of ``weight``'s
    bytes to a product."""
    return a.numel() <= MAX_EXTRA * weight.numel()


def block_inputs(
    prod: BlockProducts, lora: LoraBatch, layer: int, h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, Shrunk]:
    """Normed input [..., D] -> (qkv with its delta, GELU(fc1 + its delta), the shared
    shrink for proj's delta): one product (with the shrink), one expand."""
    fold = lora.shrink_weights(layer, SHARED)
    if fold is None or not worth_folding(fold[1], prod.w_in):
        qkv, fc1 = prod.qkv_and_fc1(h)
        shared = lora.shrink(layer, h, SHARED)
    else:
        group, a = fold
        qkv, fc1, sums = prod.qkv_and_fc1_shrunk(h, a)
        shared = lora.shrunk(h, group, sums)
    qkv, hidden = lora.expand(layer, [(shared, "qkv", qkv), (shared, "fc1", fc1)], True)
    return qkv, hidden, shared


def branch(
    prod: BlockProducts,
    lora: LoraBatch,
    layer: int,
    attn: torch.Tensor,
    hidden: torch.Tensor,
    shared: Shrunk,
    partials: bool = True,
) -> torch.Tensor:
    """`BlockProducts.branch_parts` (``partials``; else the finished `BlockProducts.branch`)
    with proj's and fc2's deltas added (into split 0 where the product splits K)."""
    fold = lora.shrink_weights(layer, ("fc2",))
    if fold is not None and FOLD_BRANCH and worth_folding(fold[1], prod.w_out):
        parts, sums = prod.branch_parts_shrunk(attn, hidden, fold[1], partials)
        fc2 = lora.shrunk(hidden, fold[0], sums)
    else:
        fc2 = lora.shrink(layer, hidden, ("fc2",))
        parts = prod.branch_parts(attn, hidden) if partials else prod.branch(attn, hidden)
    # Split sums [splits, rows, D] take the deltas into split 0; a finished branch, itself.
    into = parts[0] if partials and parts.dim() == 3 else parts
    lora.expand_sum(layer, [(shared, "proj"), (fc2, "fc2")], into)
    return parts
