"""Grouped LoRA's expand for one decode step (at most 64 tokens, Triton, CUDA): the deltas of
models/common/lora_kernel.py's per-slot `expand` (the same sums; a product's terms may be
ordered by the tile's width, the last bit may differ) in a launch shaped for few rows.

One program per block of output columns loops over the slots: each slot's B tile is read once
(not at all for a slot no token holds: its loads are masked off) and its product with the
rows of that slot added; rows without an adapter take the GELU alone. The per-slot form's grid
of (slots + 1) x column blocks, most programs waiting on one token index each, took 8.5 us
for qkv's and fc1's deltas at 32 rows over 8 slots against 7.5 here (H100). The expand reads
each shrink as one split: lora_kernel's `shrink` with a count sums its own splits in a decode
step.

The grid depends only on the shapes, so a CUDA graph captures it. Kept apart from
lora_kernel.py (its own small helpers included): Triton's interpreter runs each module as its
own copy in the CPU tests, and a copy cannot call another module's jitted helpers.
"""

from __future__ import annotations

import torch

from vlm_server.models.common.lora_kernel import Partials, Target

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path needs no Triton
    triton = None
    tl = None

AVAILABLE = triton is not None
MAX_TOKENS = 64  # one block of tokens: every program sees the whole step
# The expand's columns per program: about this many programs over both outputs (a wave or
# two of an H100's 132 SMs), 16 to 128 columns each.
PROGRAMS = 256
WARPS = 4


if triton is not None:

    @triton.jit
    def _gelu(u):
        # As lora_kernel's: GELU (tanh) as u * sigmoid(2 z), the exponent clamped.
        z = 0.7978845608028654 * (u + 0.044715 * u * u * u)
        return u / (1.0 + tl.exp(tl.minimum(-2.0 * z, 80.0)))

    @triton.jit
    def _larger(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def _any(mask):
        """Whether any lane of the 1-d ``mask`` is set (a scalar)."""
        return tl.reduce(mask.to(tl.int32), 0, _larger) > 0

    @triton.jit
    def _lowrank(
        v_at, b_at, rows, ns, rs, idx, s, stride_v, col, stride_bs, stride_bn, nmask,
        R: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        """Slot ``s``'s ``v @ B^T`` on its rows (others exact zeros): ``v`` at columns ``col``
        of the rows' partial products ``v_at``, B^T's [BLOCK_R, BLOCK_N] tile of columns ``ns``
        (B at ``b_at``). Pointers not named ``_ptr``: a helper, inlined, not launched."""
        mine = idx == s
        rmask = rs < R
        v = tl.load(
            v_at + rows[:, None] * stride_v + col + rs[None, :],
            mask=mine[:, None] & rmask[None, :],
            other=0.0,
        )
        # A slot no row holds reads nothing. (A block & a scalar is int32 in Triton 3.6's
        # interpreter, which then refuses it as a mask: tl.where instead.)
        bmask = rmask[:, None] & nmask[None, :]
        b = tl.load(
            b_at + tl.cast(s, tl.int64) * stride_bs + ns[None, :] * stride_bn + rs[:, None],
            mask=tl.where(_any(mine), bmask, False),
            other=0.0,
        )
        return tl.dot(v.to(b.dtype), b, input_precision=PRECISION)

    @triton.jit
    def _step_expand_kernel(
        v1_ptr,
        b1_ptr,
        y1_ptr,
        v2_ptr,
        b2_ptr,
        y2_ptr,
        idx_ptr,
        T,
        n_slots,
        N1,
        N2,
        NB1,
        col1,
        col2,
        slot_cols1,
        slot_cols2,
        stride_v1,
        stride_v2,
        stride_b1s,
        stride_b1n,
        stride_b2s,
        stride_b2n,
        stride_y1,
        stride_y2,
        R: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_N: tl.constexpr,
        GELU: tl.constexpr,
        SUM: tl.constexpr,
        ADD: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        # Programs over output 1's blocks of columns, then output 2's (SUM: output 1's only,
        # both deltas into it). GELU: output 2 then goes through GELU, every row of it. ADD:
        # into the outputs; else the deltas alone are written (every row: zeros for a row
        # without an adapter).
        nb = tl.program_id(0)
        ts = tl.arange(0, BLOCK_T)
        idx = tl.load(idx_ptr + ts, mask=ts < T, other=-2)
        rows = ts.to(tl.int64)
        rs = tl.arange(0, BLOCK_R)
        act = nb >= NB1 if GELU else nb < 0
        if nb < NB1:
            v_ptr, b_ptr, y_ptr, n, col, slot_cols = v1_ptr, b1_ptr, y1_ptr, N1, col1, slot_cols1
            stride_v, stride_bs, stride_bn, stride_y = stride_v1, stride_b1s, stride_b1n, stride_y1
        else:
            v_ptr, b_ptr, y_ptr, n, col, slot_cols = v2_ptr, b2_ptr, y2_ptr, N2, col2, slot_cols2
            stride_v, stride_bs, stride_bn, stride_y = stride_v2, stride_b2s, stride_b2n, stride_y2
            nb -= NB1
        ns = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = ns < n
        # Per slot a fresh product added to zeros: each row's sum is its slot's product
        # exactly, as the per-slot form's (SUM: the second delta added after the first).
        acc = tl.full((BLOCK_T, BLOCK_N), 0.0, tl.float32)
        acc2 = tl.full((BLOCK_T, BLOCK_N), 0.0, tl.float32)
        for s in range(n_slots):
            acc += _lowrank(
                v_ptr, b_ptr, rows, ns, rs, idx, s, stride_v, col + s * slot_cols, stride_bs,
                stride_bn, nmask, R, PRECISION,
            )  # fmt: skip
            if SUM:
                acc2 += _lowrank(
                    v2_ptr, b2_ptr, rows, ns, rs, idx, s, stride_v2, col2 + s * slot_cols2,
                    stride_b2s, stride_b2n, nmask, R, PRECISION,
                )  # fmt: skip
        keep = (idx >= -1)[:, None] & nmask[None, :]
        at = y_ptr + rows[:, None] * stride_y + ns[None, :]
        y = acc
        if ADD:
            y += tl.load(at, mask=keep, other=0.0).to(tl.float32)
        if SUM:
            y += acc2
        y = y.to(y_ptr.dtype.element_ty)  # out + delta rounded once, as the per-slot form
        if act:
            y = _gelu(y.to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(at, y, mask=keep)


def fits(t: int, *partials: Partials) -> bool:
    """Whether a step of ``t`` tokens with these shrinks' results takes this module's
    kernels (one block of tokens, each shrink finished in one split)."""
    return AVAILABLE and 0 < t <= MAX_TOKENS and all(p.splits == 1 for p in partials)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_t(t: int) -> int:
    return min(MAX_TOKENS, max(16, triton.next_power_of_2(t)))


def expand(
    index: torch.Tensor,
    first: Target,
    second: Target | None = None,
    gelu: bool = False,
    same_out: bool = False,
    add: bool = True,
) -> None:
    """lora_kernel's `expand` (without its ``shrink_after``) for a step that `fits`: each
    target's delta added into its ``out`` in place, one launch. ``gelu`` without ``second``:
    ``first``'s output goes through GELU (lora_kernel's takes a second target for it).
    ``add=False``: the deltas written over the outputs instead (each row; their sum where
    ``same_out``; not with ``gelu``)."""
    assert add or not gelu
    assert second is not None or not same_out, "sums take a second target"
    assert not (gelu and same_out)
    alone = second is None and gelu  # the GELU'd output only: the kernel's second
    one = first.out
    two = second if second is not None else first
    t, r = one.shape[0], first.b.shape[2]
    assert fits(t, first.partials, two.partials) and two.b.shape[2] == r
    for target in (first, two):
        assert target.b.stride(2) == 1 and target.out.stride(1) == 1, "contiguous last dims"
    if same_out:
        assert second is not None and second.out.data_ptr() == one.data_ptr()
    n1 = 0 if alone else one.shape[1]
    n2 = two.out.shape[1] if (second is not None and not same_out) or alone else 0
    block_n = max(16, min(128, triton.next_power_of_2(triton.cdiv(n1 + n2, PROGRAMS))))
    nb1, nb2 = triton.cdiv(n1, block_n), triton.cdiv(n2, block_n)
    p1, p2 = first.partials.parts, two.partials.parts
    _step_expand_kernel[(nb1 + nb2,)](
        p1, first.b, one, p2, two.b, two.out, index, t, first.b.shape[0], n1,
        two.out.shape[1], nb1, first.col, two.col, first.partials.slot_cols,
        two.partials.slot_cols, p1.stride(0), p2.stride(0), first.b.stride(0),
        first.b.stride(1), two.b.stride(0), two.b.stride(1), one.stride(0), two.out.stride(0),
        R=r, BLOCK_T=_block_t(t), BLOCK_R=max(16, triton.next_power_of_2(r)), BLOCK_N=block_n,
        GELU=gelu, SUM=same_out, ADD=add, PRECISION=_precision(first.b.dtype),
        num_warps=WARPS,
    )  # fmt: skip
