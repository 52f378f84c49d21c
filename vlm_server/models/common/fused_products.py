"""A parallel block's four matrix products as two, over weights laid side by side.

In a parallel block (``x + attn(LN(x)) + mlp(LN(x))``) the QKV projection and fc1 read the
same normed input, and the output projection and fc2 both add to the residual stream. With
``[W_qkv; W_fc1]`` stacked by rows and ``[W_proj | W_fc2]`` by columns, one skinny product
gives QKV and the GELU'd hidden layer, and one gives the whole branch (models/common/
skinny_gemm.py). The modules keep their weights as views into the stacked tensors, so the
model's memory does not grow and every other path (prompt chunks, the reference, adapters)
reads the same numbers through cuBLAS. Weights held in 8 or 4 bits (`QuantLinear`) stack the
same way, their stored values and scales (models/common/quant_stack.py), and the skinny
kernel widens them in registers: the same products, epilogues and forks, but no LoRA shrink
riding them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vlm_server.models.common import quant_stack, side_stream, skinny_gemm
from vlm_server.models.common.fused_norm import add_layernorm, add_partials_layernorm
from vlm_server.models.common.layers import LayerNorm
from vlm_server.models.common.quant_linear import QuantLinear
from vlm_server.models.common.quant_stack import QuantWeight

# A block's stacked weight: 16-bit, or its stored values and scales.
Stacked = torch.Tensor | QuantWeight

# fc2's share of the branch product starts on a second stream as soon as the hidden layer is
# there, beside the attention (a parallel block's MLP does not wait for it); proj's share
# follows the attention, and the next norm adds both shares' split sums. H100, moondream2:
# the decode period at one stream 1.460 ms against 1.505 in one stream (the same at 32).
PARALLEL_BRANCH = True
# Up to this many rows the whole MLP forks off instead (`start_mlp`): fc1 + GELU and fc2's
# share on the side stream as soon as the normed input is there, QKV alone before the
# attention, so the attention's chain of small kernels no longer waits for fc1's columns
# and the MLP's weights stream while it runs.
EARLY_MLP_MAX_ROWS = 32


@dataclass(frozen=True)
class PendingBranch:
    """A branch whose fc2 share is under way (`BlockProducts.start_branch`): ``sums`` [proj's
    splits + fc2's, rows, D] fp32, fc2's written on ``side`` (None: already done)."""

    sums: torch.Tensor
    n_proj: int
    side: torch.cuda.Stream | None


@dataclass(frozen=True)
class BlockProducts:
    """One block's stacked weights: ``w_in`` [qkv + ff, D], ``w_out`` [D, D + ff] (16-bit, or
    in 8 or 4 bits)."""

    w_in: Stacked
    b_in: torch.Tensor
    n_qkv: int
    w_out: Stacked
    b_out: torch.Tensor

    @property
    def takes_shrinks(self) -> bool:
        """Whether a LoRA shrink may ride the products (16-bit weights only)."""
        return not isinstance(self.w_in, QuantWeight)

    def qkv_and_hidden(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normed input [..., D] -> (qkv [..., qkv], gelu(fc1) [..., ff]), views of one
        product."""
        both = skinny_gemm.skinny_linear(h, self.w_in, self.b_in, gelu_from=self.n_qkv)
        return both[..., : self.n_qkv], both[..., self.n_qkv :]

    def qkv_and_fc1(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`qkv_and_hidden` without the GELU (an adapter's fc1 delta goes in before it): views
        (column slices) of one product."""
        both = skinny_gemm.skinny_linear(h, self.w_in, self.b_in)
        return both[..., : self.n_qkv], both[..., self.n_qkv :]

    def qkv_and_fc1_shrunk(
        self, h: torch.Tensor, a: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`qkv_and_fc1` and, in the same launch, ``h`` times every slot's A (``a`` [slots,
        R, D]): (qkv, fc1, the shrink's split sums [splits, rows, slots * R] fp32)."""
        both, sums = skinny_gemm.skinny_linear_shrink(h, self.w_in, self.b_in, a)
        return both[..., : self.n_qkv], both[..., self.n_qkv :], sums

    def branch_parts_shrunk(
        self, attn: torch.Tensor, hidden: torch.Tensor, a: torch.Tensor, partials: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`branch_parts` (``partials``; else the finished `branch`) and, in the same
        launch, ``hidden`` times every slot's A (``a`` [slots, R, ff]): (the branch as
        those return it, the shrink's split sums [splits, rows, slots * R] fp32)."""
        return skinny_gemm.skinny_linear_shrink(
            attn, self.w_out, self.b_out, a, x2=hidden, partials=partials
        )

    def branch(self, attn: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """proj(attn) + fc2(hidden), biases included: the block's whole residual update."""
        return skinny_gemm.skinny_linear(attn, self.w_out, self.b_out, x2=hidden)

    def add_branch_and_norm(
        self, x: torch.Tensor, attn: torch.Tensor, hidden: torch.Tensor, norm: LayerNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + branch, norm(x + branch)): where the product splits K, its split sums are
        finished inside the norm's kernel (one launch less per block)."""
        return self.add_parts_and_norm(x, self.branch_parts(attn, hidden), norm)

    def branch_parts(self, attn: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The branch's split sums [splits, rows, D] (fp32, no bias) where the product splits
        K, else the finished branch [rows, D]; for `add_parts_and_norm`. Either may take more
        terms first (an adapter's deltas: into split 0, or into the finished branch)."""
        return skinny_gemm.skinny_linear(attn, self.w_out, self.b_out, x2=hidden, partials=True)

    def qkv(self, h: torch.Tensor) -> torch.Tensor:
        """Normed input [..., D] -> qkv [..., qkv] alone (the MLP `start_mlp`ed)."""
        w_qkv = _rows(self.w_in, 0, self.n_qkv)
        return skinny_gemm.skinny_linear(h, w_qkv, self.b_in[: self.n_qkv])

    def start_branch(self, hidden: torch.Tensor) -> PendingBranch:
        """fc2(hidden)'s split sums, on the side stream where there is one (CUDA), into the
        buffer `add_branch_and_norm_after` finishes."""
        return self._fork(hidden, with_fc1=False)

    def start_mlp(self, h: torch.Tensor) -> PendingBranch:
        """`start_branch` from the normed input: gelu(fc1(h)), then fc2's split sums, both
        on the side stream (the same columns `qkv_and_hidden` gives, launched apart)."""
        return self._fork(h, with_fc1=True)

    def _fork(self, src: torch.Tensor, with_fc1: bool) -> PendingBranch:
        # src: the hidden layer, or (with_fc1) the normed input fc1 reads first.
        rows, (dim, k_out) = src.numel() // src.shape[-1], self.w_out.shape
        w_proj, w_fc2 = _cols(self.w_out, 0, dim), _cols(self.w_out, dim, k_out)
        n_proj = skinny_gemm.split_count(rows, w_proj, itemsize=src.element_size())
        n_fc2 = skinny_gemm.split_count(rows, w_fc2, itemsize=src.element_size())
        sums = torch.empty(n_proj + n_fc2, rows, dim, dtype=torch.float32, device=src.device)
        side = side_stream.beside(src.device) if src.is_cuda else None
        with side_stream.on(side):
            hidden = src
            if with_fc1:
                w_fc1 = _rows(self.w_in, self.n_qkv, self.w_in.shape[0])
                b_fc1 = self.b_in[self.n_qkv :]
                hidden = skinny_gemm.skinny_linear(src, w_fc1, b_fc1, gelu_from=0)
            skinny_gemm.skinny_linear(hidden, w_fc2, sums_out=sums[n_proj:])
        return PendingBranch(sums, n_proj, side)

    def add_branch_and_norm_after(
        self, x: torch.Tensor, attn: torch.Tensor, pending: PendingBranch, norm: LayerNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`add_branch_and_norm` of a `start_branch`ed branch: proj(attn)'s split sums, then
        the norm over both shares (after the side stream's)."""
        dim = self.w_out.shape[0]
        proj_sums = pending.sums[: pending.n_proj]
        skinny_gemm.skinny_linear(attn, _cols(self.w_out, 0, dim), sums_out=proj_sums)
        if pending.side is not None:
            torch.cuda.current_stream().wait_stream(pending.side)
        return add_partials_layernorm(x, pending.sums, self.b_out, norm)

    def add_parts_and_norm(
        self,
        x: torch.Tensor,
        parts: torch.Tensor,
        norm: LayerNorm,
        extra: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + branch, norm(x + branch)) from `branch_parts`; ``extra`` [rows, D] fp32: one
        more term of the branch (an adapter's deltas)."""
        if parts.dim() == 3:
            return add_partials_layernorm(x, parts, self.b_out, norm, extra)
        if extra is not None:
            parts = with_extra(parts, extra)
        return add_layernorm(x, parts.view_as(x), None, norm)


def with_extra(branch: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """A finished branch plus ``extra`` ([rows, D] fp32: an adapter's deltas), rounded once."""
    return (branch.view(extra.shape).float() + extra).to(branch.dtype).view_as(branch)


def _rows(w: Stacked, lo: int, hi: int) -> Stacked:
    return w.rows(lo, hi) if isinstance(w, QuantWeight) else w[lo:hi]


def _cols(w: Stacked, lo: int, hi: int) -> Stacked:
    return w.cols(lo, hi) if isinstance(w, QuantWeight) else w[:, lo:hi]


def stack_block(
    qkv: nn.Linear | QuantLinear,
    fc1: nn.Linear | QuantLinear,
    proj: nn.Linear | QuantLinear,
    fc2: nn.Linear | QuantLinear,
) -> BlockProducts:
    """Stack one block's weights and re-point the four modules at views of the stacks (all
    four 16-bit, or all four `QuantLinear`s of one format)."""
    if isinstance(qkv, QuantLinear):
        return _stack_quantized(qkv, fc1, proj, fc2)
    n_qkv = qkv.weight.shape[0]
    dim = proj.weight.shape[1]
    with torch.no_grad():
        w_in = torch.cat([qkv.weight, fc1.weight], dim=0)
        b_in = torch.cat([qkv.bias, fc1.bias], dim=0)
        w_out = torch.cat([proj.weight, fc2.weight], dim=1)
        # The two biases as one, summed in fp32 and rounded once.
        b_out = (proj.bias.float() + fc2.bias.float()).to(proj.bias.dtype)
        qkv.weight.data, fc1.weight.data = w_in[:n_qkv], w_in[n_qkv:]
        qkv.bias.data, fc1.bias.data = b_in[:n_qkv], b_in[n_qkv:]
        proj.weight.data, fc2.weight.data = w_out[:, :dim], w_out[:, dim:]
    return BlockProducts(w_in, b_in, n_qkv, w_out, b_out)


def stackable(qkv: nn.Module, fc1: nn.Module, proj: nn.Module, fc2: nn.Module) -> bool:
    """Whether `stack_block` takes these four: all 16-bit `nn.Linear`s, or all `QuantLinear`s
    of one format the kernel reads (INT8, or INT4 in its groups), biases included."""
    layers = (qkv, fc1, proj, fc2)
    if all(isinstance(m, nn.Linear) for m in layers):
        return True
    if not all(isinstance(m, QuantLinear) and m.bias is not None for m in layers):
        return False
    fmt = qkv.fmt
    same = all(m.fmt == fmt for m in layers)
    return same and fmt.group_size in (0, quant_stack.GROUP_SIZE)


def _stack_quantized(
    qkv: QuantLinear, fc1: nn.Module, proj: nn.Module, fc2: nn.Module
) -> BlockProducts:
    """`stack_block` over `QuantLinear`s: stored values and scales stacked (quant_stack.py),
    the modules' buffers re-pointed at views, so the model holds no second copy."""
    if not stackable(qkv, fc1, proj, fc2):
        raise ValueError("a block's four linears must share one format the kernel reads")
    assert isinstance(fc1, QuantLinear) and isinstance(proj, QuantLinear)
    assert isinstance(fc2, QuantLinear)
    assert qkv.bias is not None and fc1.bias is not None
    assert proj.bias is not None and fc2.bias is not None
    n_qkv, dim, n_in = qkv.out_features, proj.in_features, qkv.out_features + fc1.out_features
    with torch.no_grad():
        w_in = quant_stack.stack_rows([(qkv.qweight, qkv.scale), (fc1.qweight, fc1.scale)])
        w_out = quant_stack.stack_cols((proj.qweight, proj.scale), (fc2.qweight, fc2.scale))
        b_in = torch.cat([qkv.bias, fc1.bias], dim=0)
        b_out = (proj.bias.float() + fc2.bias.float()).to(proj.bias.dtype)
        for layer, part in ((qkv, w_in.rows(0, n_qkv)), (fc1, w_in.rows(n_qkv, n_in))):
            layer.qweight, layer.scale = part.qweight, part.scale
        k_out = w_out.shape[1]
        for layer, part in ((proj, w_out.cols(0, dim)), (fc2, w_out.cols(dim, k_out))):
            layer.qweight, layer.scale = part.qweight, part.scale
        qkv.bias.data, fc1.bias.data = b_in[:n_qkv], b_in[n_qkv:]
    return BlockProducts(w_in, b_in, n_qkv, w_out, b_out)


def forks_mlp(h: torch.Tensor) -> bool:
    """Whether a block over normed input ``h`` forks its whole MLP (`start_mlp`)."""
    return PARALLEL_BRANCH and h.numel() // h.shape[-1] <= EARLY_MLP_MAX_ROWS


def usable(x: torch.Tensor) -> bool:
    """Whether the stacked products serve activations like ``x`` (few rows, on CUDA)."""
    return skinny_gemm.supported(x)
