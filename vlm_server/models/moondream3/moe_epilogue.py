"""The grouped expert kernels' epilogues (moe_triton.py): each tile's fp32 sums -> FP8 row
scales where the weights are FP8 (and FP8 activations' row scales), an adapter's delta, then
fc1's activation or fc2's output row. Helpers only, inlined into the launched kernels."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path needs no Triton
    triton = None
    tl = None

if triton is not None:

    @triton.jit
    def _up_epilogue(acc_a, acc_b, e, rows, pair, valid, cols, col_ok, scales, deltas, out,
                     width, HAS_SCALE: tl.constexpr, HAS_DELTA: tl.constexpr,
                     act_scale=None):  # fmt: skip
        """fc1's fp32 sums of a tile -> scales, adapter delta, ``gelu_erf(a) * (b + 1)``;
        ``act_scale`` [BM]: the rows' FP8 activation scales, where the inputs were FP8."""
        if act_scale is not None:
            acc_a *= act_scale[:, None]
            acc_b *= act_scale[:, None]
        if HAS_SCALE:
            s_base = scales + e * (2 * width)
            acc_a *= tl.load(s_base + cols, mask=col_ok, other=0.0)[None, :]
            acc_b *= tl.load(s_base + width + cols, mask=col_ok, other=0.0)[None, :]
        if HAS_DELTA:  # the adapter's fc1 delta of each row's pair [pairs, 2 x width]
            d_rows = deltas + tl.where(valid, pair, 0).to(tl.int64)[:, None] * (2 * width)
            d_mask = valid[:, None] & col_ok[None, :]
            acc_a += tl.load(d_rows + cols[None, :], mask=d_mask, other=0.0).to(tl.float32)
            acc_b += tl.load(d_rows + width + cols[None, :], mask=d_mask, other=0.0).to(tl.float32)
        gelu = 0.5 * acc_a * (1.0 + tl.math.erf(acc_a * 0.7071067811865476))
        h = gelu * (acc_b + 1.0)
        tl.store(
            out + rows[:, None].to(tl.int64) * width + cols[None, :],
            h.to(out.dtype.element_ty),
            mask=valid[:, None] & col_ok[None, :],
        )

    @triton.jit
    def _down_epilogue(acc, e, pair, valid, cols, col_ok, scales, deltas, out, dim,
                       HAS_SCALE: tl.constexpr, HAS_DELTA: tl.constexpr,
                       act_scale=None):  # fmt: skip
        """fc2's fp32 sums of a tile -> scales, adapter delta, each pair's output row."""
        if act_scale is not None:
            acc *= act_scale[:, None]
        if HAS_SCALE:
            acc *= tl.load(scales + e * dim + cols, mask=col_ok, other=0.0)[None, :]
        if HAS_DELTA:  # the adapter's fc2 delta of each row's pair [pairs, dim]
            d_rows = deltas + tl.where(valid, pair, 0).to(tl.int64)[:, None] * dim
            d_mask = valid[:, None] & col_ok[None, :]
            acc += tl.load(d_rows + cols[None, :], mask=d_mask, other=0.0).to(tl.float32)
        at = out + tl.where(valid, pair, 0).to(tl.int64)[:, None] * dim + cols[None, :]
        tl.store(at, acc.to(out.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])
