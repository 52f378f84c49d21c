"""Weights held in 8 or 4 bits, laid side by side for the fused decode products.

A parallel block's QKV and fc1 stack by rows and its proj and fc2 by columns
(models/common/fused_products.py). Quantized, the stored values stack as the 16-bit weights
do, and so do their scales: INT8's per-channel scales by rows; INT4's group scales by rows,
and by columns along K (a column stack keeps whole groups: the first part's width is a
multiple of the group). INT8 stacked by columns has two scales per output row, one for each
part (``scale`` [N, 2]), since each layer quantized its rows alone: the columns before
``boundary`` take the first, the rest the second. The skinny kernel (models/common/
skinny_gemm.py) widens each weight tile in registers as quant_gemm does, so a fused product
equals "dequantize, then the 16-bit fused product" up to the order of its fp32 sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlm_server.models.quant.formats import GROUP_SIZE


@dataclass(frozen=True)
class QuantWeight:
    """A weight [N, K] in quant_gemm's layouts: INT8 ``qweight`` int8 [N, K] with ``scale``
    [N] (or [N, 2] split at ``boundary``); INT4 ``qweight`` uint8 [N, K / 2] (two a byte,
    column 2j in the low nibble) with ``scale`` [N, K / GROUP_SIZE]."""

    qweight: torch.Tensor
    scale: torch.Tensor
    boundary: int = 0  # INT8 with two scale columns: the first column of the second part

    def __post_init__(self) -> None:
        q, s = self.qweight, self.scale
        if q.dtype not in (torch.int8, torch.uint8) or q.dim() != 2 or q.stride(1) != 1:
            raise ValueError(f"qweight must be int8/uint8 [N, K], unit column stride, not {q}")
        n, k = self.shape
        if self.bits == 8:
            two = s.dim() == 2 and s.shape == (n, 2) and 0 < self.boundary < k
            if s.shape != (n,) and not two:
                raise ValueError(f"INT8 scale must be [{n}] or [{n}, 2] with a boundary")
        elif s.shape != (n, k // GROUP_SIZE) or s.stride(1) != 1 or k % GROUP_SIZE:
            raise ValueError(f"INT4 scale must be [{n}, {k // GROUP_SIZE}], not {tuple(s.shape)}")

    @property
    def bits(self) -> int:
        return 8 if self.qweight.dtype == torch.int8 else 4

    @property
    def shape(self) -> tuple[int, int]:
        """The dequantized weight's [N, K]."""
        n, stored = self.qweight.shape
        return n, stored if self.bits == 8 else 2 * stored

    def rows(self, lo: int, hi: int) -> QuantWeight:
        """Output rows lo .. hi (views)."""
        return QuantWeight(self.qweight[lo:hi], self.scale[lo:hi], self.boundary)

    def cols(self, lo: int, hi: int) -> QuantWeight:
        """Input columns lo .. hi (views): for INT8 with two scales, one whole part; for INT4,
        whole groups."""
        if self.bits == 4:
            if lo % GROUP_SIZE or hi % GROUP_SIZE:
                raise ValueError(f"INT4 columns {lo}..{hi} do not keep whole groups")
            g = GROUP_SIZE
            return QuantWeight(self.qweight[:, lo // 2 : hi // 2], self.scale[:, lo // g : hi // g])
        if self.scale.dim() == 1:
            return QuantWeight(self.qweight[:, lo:hi], self.scale)
        k = self.shape[1]
        if (lo, hi) not in ((0, self.boundary), (self.boundary, k)):
            raise ValueError(f"INT8 columns {lo}..{hi} are not one part (split at {self.boundary})")
        return QuantWeight(self.qweight[:, lo:hi], self.scale[:, int(lo > 0)])


def stack_rows(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> QuantWeight:
    """Layers' (qweight, scale) of one format stacked by output rows (QKV over fc1)."""
    return QuantWeight(torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts]))


def stack_cols(
    first: tuple[torch.Tensor, torch.Tensor], second: tuple[torch.Tensor, torch.Tensor]
) -> QuantWeight:
    """Two layers' (qweight, scale) of one format side by side along K (proj beside fc2)."""
    (q1, s1), (q2, s2) = first, second
    q = torch.cat([q1, q2], dim=1)
    if q1.dtype == torch.int8:
        return QuantWeight(q, torch.stack([s1, s2], dim=1), boundary=q1.shape[1])
    if (2 * q1.shape[1]) % GROUP_SIZE:
        raise ValueError(f"INT4 parts must be whole groups of {GROUP_SIZE} columns")
    return QuantWeight(q, torch.cat([s1, s2], dim=1))
