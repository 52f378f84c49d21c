"""Grouped LoRA for one decode step (at most 64 tokens, Triton, CUDA): the same deltas as
models/common/lora_kernel.py's per-slot `shrink` and `expand` (the shrink's sums bit for bit, the
for few rows.

* `expand`: one program per block of output columns, looping over the slots. Each slot's B
  tile is read once (not at all for a slot no token holds: its loads are masked off) and its
  product with the rows of that slot added; rows without an adapter take the GELU alone. The
  per-slot form's grid of (slots + 1) x column blocks, most programs waiting on one token
  index each, took twice as long at 32 rows over 8 slots (H100, bench/lora_block_probe.py).
* `shrink`: the per-slot form's programs over splits of K, and the last program of a slot to
  finish (an atomic count per slot) sums the slot's splits in split order into one partial
  product: the expands read one split instead of summing sixteen, which they did for every
  one of their programs.

Both read the slots on the device and launch grids that depend only on the shapes, so a CUDA
graph captures them. Kept apart from lora_kernel.py (its own small helpers included): Triton's
interpreter runs each module as its own copy in the CPU tests, and a copy cannot call another
module's jitted helpers.
"""

from __future__ import annotations

import torch

from vlm_server.models.common.lora_kernel import Partials, Target, shrink_shape

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path needs no Triton
    triton = None
    tl = None

AVAILABLE = triton is not None
MAX_TOKENS = 64  # one block of tokens: every program sees the whole step
# The shrink's pipeline stages (lora_kernel's two waited on each K block in turn), within
# this many bytes of operand tiles (64 KiB: fits sm_86/89).
STAGES = 4
STAGE_BYTES = 64 << 10
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
    def _step_shrink_kernel(
        x_ptr,
        a_ptr,
        idx_ptr,
        parts_ptr,
        v_ptr,
        count_ptr,
        T,
        K,
        stride_xt,
        stride_as,
        stride_ar,
        R: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_K: tl.constexpr,
        ITERS: tl.constexpr,
        SPLITS: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        slot = tl.program_id(0)
        split = tl.program_id(1)
        ts = tl.arange(0, BLOCK_T)
        mine = tl.load(idx_ptr + ts, mask=ts < T, other=-1) == slot
        if _any(mine):
            rows = ts.to(tl.int64)
            rs = tl.arange(0, BLOCK_R)
            a_slot = a_ptr + slot.to(tl.int64) * stride_as
            acc = tl.full((BLOCK_T, BLOCK_R), 0.0, tl.float32)
            for i in range(ITERS):
                ks = (split * ITERS + i) * BLOCK_K + tl.arange(0, BLOCK_K)
                kmask = ks < K
                x = tl.load(
                    x_ptr + rows[:, None] * stride_xt + ks[None, :],
                    mask=mine[:, None] & kmask[None, :],
                    other=0.0,
                )
                a = tl.load(
                    a_slot + rs[:, None] * stride_ar + ks[None, :],
                    mask=(rs[:, None] < R) & kmask[None, :],
                    other=0.0,
                )
                acc = tl.dot(x, tl.trans(a), acc, input_precision=PRECISION)
            at = parts_ptr + (rows[:, None] * SPLITS + split) * BLOCK_R + rs[None, :]
            tl.store(at, acc, mask=mine[:, None])
            # Every thread's split stored before the count (the release below covers them).
            tl.debug_barrier()
            done = tl.atomic_add(count_ptr + slot, 1, sem="acq_rel")
            tl.debug_barrier()
            if done == SPLITS - 1:  # the slot's last program: the splits in order
                v = tl.full((BLOCK_T, BLOCK_R), 0.0, tl.float32)
                for s in range(SPLITS):
                    at = parts_ptr + (rows[:, None] * SPLITS + s) * BLOCK_R + rs[None, :]
                    v += tl.load(at, mask=mine[:, None], other=0.0, cache_modifier=".cg")
                tl.store(v_ptr + rows[:, None] * BLOCK_R + rs[None, :], v, mask=mine[:, None])
                tl.atomic_xchg(count_ptr + slot, 0)  # ready for the next launch

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


def shrink(x: torch.Tensor, a: torch.Tensor, index: torch.Tensor, count: torch.Tensor) -> Partials:
    """``x`` [T, K] (T <= `MAX_TOKENS`); ``a`` [S, R, K] (K contiguous); ``index`` [T] int32
    slots (-1: none); ``count`` [>= S] int32 zeros, left zeros (one per slot: two launches
    must not share it at once) -> the partial products [T, 1, block_r] fp32, summed over K
    in the per-slot form's order (rows without an adapter left unwritten)."""
    t, k = x.shape
    r = a.shape[1]
    assert 0 < t <= MAX_TOKENS and a.stride(2) == 1 and a.dtype == x.dtype
    assert count.numel() >= a.shape[0] and count.dtype == torch.int32
    x = x if x.stride(1) == 1 else x.contiguous()
    # lora_kernel's shape: the same sums in the same order.
    block_t, block_r, block_k, iters, splits = shrink_shape(t, k, r, x.element_size())
    stage = (block_t + block_r) * block_k * x.element_size()
    stages = max(1, min(STAGES, STAGE_BYTES // stage))
    parts = torch.empty(t, splits, block_r, dtype=torch.float32, device=x.device)
    v = torch.empty(t, 1, block_r, dtype=torch.float32, device=x.device)
    _step_shrink_kernel[(a.shape[0], splits)](
        x, a, index, parts, v, count, t, k, x.stride(0), a.stride(0), a.stride(1),
        R=r, BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_K=block_k, ITERS=iters, SPLITS=splits,
        PRECISION=_precision(a.dtype), num_stages=stages,
    )  # fmt: skip
    return Partials(v)


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
