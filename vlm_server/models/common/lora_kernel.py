"""Grouped LoRA for a batch whose tokens use different adapters (Triton, CUDA).

Punica / S-LoRA style, per token: each token carries a slot of the stacked adapter weights
(-1: none). ``shrink`` computes ``v = x @ A[slot]^T`` ([T, R], fp32) as partial products over
blocks of K, one program each (a single program per token walking all of K was the step's
bottleneck: fc2's K is 8192), ``expand`` sums them in a fixed order and computes ``y = v @
B[slot]^T`` in the activation dtype. Both read the slot index on the device and launch a grid
that depends only on the shapes, so a CUDA graph captures them; the weights are read from the
fixed-address stacked buffers at replay. Rank is the bank's largest (lower ranks are
zero-padded there).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path needs no Triton
    triton = None
    tl = None

AVAILABLE = triton is not None


if triton is not None:

    @triton.jit
    def _shrink_kernel(
        x_ptr,
        a_ptr,
        idx_ptr,
        v_ptr,
        K,
        stride_xt,
        stride_as,
        stride_ar,
        R: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLITS: tl.constexpr,
    ):
        # One program per (token, block of K): the partial products land apart and the
        # expand sums them in a fixed order (deterministic, unlike atomics).
        t = tl.program_id(0)
        kb = tl.program_id(1)
        slot = tl.load(idx_ptr + t)
        valid = slot >= 0
        safe = tl.maximum(slot, 0).to(tl.int64)
        rs = tl.arange(0, BLOCK_R)
        ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        kmask = (ks < K) & valid
        x = tl.load(x_ptr + t.to(tl.int64) * stride_xt + ks, mask=kmask, other=0.0)
        a = tl.load(
            a_ptr + safe * stride_as + rs[:, None] * stride_ar + ks[None, :],
            mask=(rs[:, None] < R) & kmask[None, :],
            other=0.0,
        )
        part = tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        tl.store(v_ptr + (t.to(tl.int64) * SPLITS + kb) * BLOCK_R + rs, part)

    @triton.jit
    def _expand_kernel(
        v_ptr,
        b_ptr,
        idx_ptr,
        y_ptr,
        N,
        stride_bs,
        stride_bn,
        R: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ADD: tl.constexpr,
        SPLITS: tl.constexpr,
    ):
        t = tl.program_id(0)
        nb = tl.program_id(1)
        slot = tl.load(idx_ptr + t)
        valid = slot >= 0
        safe = tl.maximum(slot, 0).to(tl.int64)
        rs = tl.arange(0, BLOCK_R)
        ns = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = ns < N
        splits = tl.arange(0, SPLITS)
        parts = tl.load(v_ptr + (t.to(tl.int64) * SPLITS + splits[:, None]) * BLOCK_R + rs[None, :])
        v = tl.sum(parts, axis=0)
        b = tl.load(
            b_ptr + safe * stride_bs + ns[:, None] * stride_bn + rs[None, :],
            mask=nmask[:, None] & (rs[None, :] < R) & valid,
            other=0.0,
        )
        y = tl.sum(b.to(tl.float32) * v[None, :], axis=1)
        at = y_ptr + t.to(tl.int64) * N + ns
        if ADD:  # into the layer's output: rows without an adapter keep theirs exactly
            y += tl.load(at, mask=nmask, other=0.0).to(tl.float32)
        tl.store(at, y.to(y_ptr.dtype.element_ty), mask=nmask)


BLOCK_K = 256  # the shrink's K per program: K / BLOCK_K programs per token run in parallel


def grouped_lora(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    index: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` [T, K]; ``a`` [S, R, K] and ``b`` [S, N, R] (one layer's slice of the stacked
    weights: the last dim contiguous); ``index`` [T] int32 slots (-1: none) -> the delta
    [T, N], or with ``out`` (contiguous [T, N]) ``out`` plus the delta, in place."""
    t, k = x.shape
    _, r, _ = a.shape
    n = b.shape[1]
    assert a.stride(2) == 1 and b.stride(2) == 1, "the stacked weights' last dim is contiguous"
    x = x.contiguous()
    block_r = max(16, triton.next_power_of_2(r))
    splits = triton.next_power_of_2(triton.cdiv(k, BLOCK_K))  # padding splits store zeros
    # Every split is written (padding ones with zeros): no memset needed.
    v = torch.empty(t, splits, block_r, dtype=torch.float32, device=x.device)
    add = out is not None
    if out is not None:
        assert out.shape == (t, n) and out.is_contiguous(), "adds into a contiguous [T, N]"
        y = out
    else:
        y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t == 0:
        return y
    _shrink_kernel[(t, splits)](
        x, a, index, v, k, x.stride(0), a.stride(0), a.stride(1),
        R=r, BLOCK_R=block_r, BLOCK_K=BLOCK_K, SPLITS=splits,
    )  # fmt: skip
    block_n = 64
    _expand_kernel[(t, triton.cdiv(n, block_n))](
        v, b, index, y, n, b.stride(0), b.stride(1),
        R=r, BLOCK_R=block_r, BLOCK_N=block_n, ADD=add, SPLITS=splits,
    )  # fmt: skip
    return y
