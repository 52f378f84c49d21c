"""Residual adds fused with the LayerNorm that follows them (a Triton kernel on CUDA).

A pre-norm block ends with ``x = x + branch`` and the next block (or the final norm) starts
with ``LayerNorm(x)``: one kernel can read ``x`` and the branch outputs once and write both the
new residual stream and its normalized copy. The sums are rounded to the activation dtype in
the order the unfused code adds them (``(x + a) + b``), so the residual stream is bit-for-bit
the same; the norm's statistics are computed in fp32 as PyTorch's kernel does, though not in
the same summation order (last-bit differences). Elsewhere (the CPU, or no Triton) the plain
PyTorch ops run.
"""

from __future__ import annotations

import torch

from vlm_server.models.common import launch_overlap
from vlm_server.models.common.layers import LN_EPS, LayerNorm

try:
    import triton
    import triton.language as tl

    from vlm_server.models.common.launch_overlap import gdc_launch_dependents, gdc_wait
except ImportError:  # the CPU path needs no Triton
    triton = None
    tl = None


if triton is not None:

    @triton.jit
    def _normalize(s, cols, mask, offs, dim, eps, weight, bias, out):
        # One row's LayerNorm of the sum s, statistics in fp32 (pointers named without
        # "_ptr": a helper inlined into the kernels, not launched).
        v = s.to(tl.float32)
        mean = tl.sum(v, axis=0) / dim
        centred = tl.where(mask, v - mean, 0.0)
        var = tl.sum(centred * centred, axis=0) / dim
        w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(bias + cols, mask=mask, other=0.0).to(tl.float32)
        y = centred * tl.rsqrt(var + eps) * w + b
        tl.store(out + offs, y.to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _add_layernorm_kernel(
        x_ptr,
        a_ptr,
        b_ptr,
        w_ptr,
        bias_ptr,
        sum_ptr,
        out_ptr,
        dim,
        eps,
        HAS_B: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        if PDL:  # launched early (launch_overlap.py): wait for the predecessor first
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < dim
        offs = row.to(tl.int64) * dim + cols
        s = tl.load(x_ptr + offs, mask=mask, other=0.0) + tl.load(
            a_ptr + offs, mask=mask, other=0.0
        )
        if HAS_B:
            s = s + tl.load(b_ptr + offs, mask=mask, other=0.0)
        tl.store(sum_ptr + offs, s, mask=mask)
        _normalize(s, cols, mask, offs, dim, eps, w_ptr, bias_ptr, out_ptr)


if triton is not None:

    @triton.jit
    def _add_partials_layernorm_kernel(
        x_ptr,
        part_ptr,
        bias_ptr,
        extra_ptr,
        w_ptr,
        nb_ptr,
        sum_ptr,
        out_ptr,
        rows,
        dim,
        eps,
        SPLITS: tl.constexpr,
        HAS_EXTRA: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        if PDL:  # launched early (launch_overlap.py): wait for the predecessor first
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < dim
        offs = row.to(tl.int64) * dim + cols
        # The branch: split sums in split order plus the bias, rounded as a branch output is.
        br = tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        for sp in tl.static_range(SPLITS):
            br += tl.load(part_ptr + sp * rows * dim + offs, mask=mask, other=0.0)
        if HAS_EXTRA:  # one more fp32 term [rows, dim] (an adapter's deltas)
            br += tl.load(extra_ptr + offs, mask=mask, other=0.0)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        s = x + br.to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + offs, s, mask=mask)
        _normalize(s, cols, mask, offs, dim, eps, w_ptr, nb_ptr, out_ptr)


# Warps of the split-sum norm's one program per row (a decode step has one to 32 rows: its
# loads of every split sum are spread over this many warps). H100, moondream2, 8 split sums:
# the decode period at one stream 1.407 ms at 16 warps against 1.453 at 4.
PARTIALS_WARPS = 16


def add_partials_layernorm(
    x: torch.Tensor,
    parts: torch.Tensor,
    bias: torch.Tensor,
    norm: LayerNorm,
    extra: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + (sum(parts) + bias (+ extra))`` (the branch rounded to x's dtype) and
    ``norm(s)``: the split sums of a skinny product (models/common/skinny_gemm.py, [splits,
    rows, dim] fp32) finished inside the norm's kernel; ``extra`` [rows, dim] fp32 contiguous,
    added last. CUDA with Triton only."""
    dim = x.shape[-1]
    x = x.contiguous()
    rows = x.numel() // dim
    s, out = torch.empty_like(x), torch.empty_like(x)
    _add_partials_layernorm_kernel[(rows,)](
        x,
        parts,
        bias,
        extra if extra is not None else parts,
        norm.weight,
        norm.bias,
        s,
        out,
        rows,
        dim,
        LN_EPS,
        SPLITS=parts.shape[0],
        HAS_EXTRA=extra is not None,
        BLOCK=triton.next_power_of_2(dim),
        num_warps=PARTIALS_WARPS,
        **launch_overlap.kernel_args(),
    )
    return s, out


def add_layernorm(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None, norm: LayerNorm
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + a (+ b)`` and ``norm(s)``; returns (s, norm(s))."""
    if triton is None or not x.is_cuda or x.dtype != a.dtype:
        s = x + a if b is None else x + a + b
        return s, norm(s)
    dim = x.shape[-1]
    x, a = x.contiguous(), a.contiguous()
    b = b.contiguous() if b is not None else a
    s, out = torch.empty_like(x), torch.empty_like(x)
    _add_layernorm_kernel[(x.numel() // dim,)](
        x,
        a,
        b,
        norm.weight,
        norm.bias,
        s,
        out,
        dim,
        LN_EPS,
        HAS_B=b is not a,
        BLOCK=triton.next_power_of_2(dim),
        **launch_overlap.kernel_args(),
    )
    return s, out
