"""Activations to FP8, one scale per row (dynamic, per token): the inputs of the expert
products when they run on FP8 units (`moe_triton.experts_fused` with ``fp8_act``).

Each row's absolute maximum maps to 448 (float8_e4m3fn's largest value): ``q = x / s`` with
``s = amax / 448``, rounded to nearest. The products then read ``q`` and scale their fp32
sums by ``s`` per row, beside the weights' scales per column. An all-zero row gets the
smallest normal scale (its values stay zero). Rows whose grouping slot holds no (token,
expert) pair are skipped: the grouped kernels never read them.
"""

from __future__ import annotations

import torch

from vlm_server.models.moondream3.fp8_experts import FP8, FP8_MAX

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path needs no Triton
    triton = None
    tl = None

# The smallest scale: a row of zeros (or of values too small to matter) stays finite.
MIN_SCALE = torch.finfo(torch.float32).tiny


def quant_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (FP8 values [R, C], fp32 scales [R]) in PyTorch: what the kernel computes."""
    x32 = x.float()
    amax = x32.abs().amax(dim=-1)
    # A tensor divisor: PyTorch's CUDA kernels multiply by the reciprocal of a scalar one.
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=MIN_SCALE)
    q = (x32 / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


if triton is not None:

    @triton.jit
    def _quant_rows_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        pair_ptr,
        n_pairs,
        cols,
        min_scale,
        HAS_PAIRS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """One row: its absolute maximum, its scale, its FP8 values."""
        row = tl.program_id(0)
        if HAS_PAIRS:  # noqa: SIM102 (a compile-time switch, then a runtime test)
            if tl.load(pair_ptr + row) >= n_pairs:
                return  # a padding row of the grouping: no pair, never read
        offs = tl.arange(0, BLOCK)
        mask = offs < cols
        base = row.to(tl.int64) * cols
        v = tl.load(x_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(v), axis=0)
        scale = tl.maximum(tl.math.div_rn(amax, 448.0), min_scale)
        q = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -448.0), 448.0)
        tl.store(q_ptr + base + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row, scale)


def quant_rows(
    x: torch.Tensor, pairs: torch.Tensor | None = None, n_pairs: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] (contiguous) -> (FP8 values [R, C], fp32 scales [R]), one Triton launch.
    With ``pairs`` [R] (a grouping's pair index per row), rows whose index is ``n_pairs`` or
    more are left unwritten."""
    if triton is None:
        raise RuntimeError("the FP8 activation kernel needs Triton")
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=FP8, device=x.device)
    s = torch.empty(rows, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(cols)
    _quant_rows_kernel[(rows,)](
        x, q, s, s if pairs is None else pairs, n_pairs, cols, MIN_SCALE,
        HAS_PAIRS=pairs is not None, BLOCK=block, num_warps=4 if block <= 2048 else 8,
    )  # fmt: skip
    return q, s
