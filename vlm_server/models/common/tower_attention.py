"""Bidirectional attention of the vision tower in Triton, straight from the QKV product.

The tower's heads are 72 wide. cuDNN and FlashAttention round a head up to a supported width
(128 and 96), so a third or a quarter of their matrix work multiplies zeros; and SDPA wants
``[n, heads, t, head_dim]`` views of the QKV product, which its kernels read with strides
they were not tuned for. Here each head is two power-of-two slices, 64 + 16 columns (the
second masked to the 8 real ones), read in place from the ``[n, t, 3d]`` product (Q | K | V
columns, head-major within each), and the output is written as ``[n, t, d]``: the projection's
input, with no transpose between. One program holds ``BLOCK_M`` queries of one (crop, head)
and walks the keys ``BLOCK_N`` at a time with an online softmax in base 2; only the last,
partial key block is masked.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path needs no Triton
    triton = None
    tl = None

AVAILABLE = triton is not None
LOG2E = 1.4426950408889634
BACKENDS = ("triton", "sdpa")
_backend = "triton"


@dataclass(frozen=True)
class TowerAttentionConfig:
    """Launch shape: queries and keys per block, warps, pipeline stages."""

    block_m: int = 128
    block_n: int = 64
    warps: int = 4
    stages: int = 3


DEFAULT_CONFIG = TowerAttentionConfig()


def head_slices(head_dim: int) -> tuple[int, int]:
    """The two power-of-two slice widths a head is computed in: the largest power of two not
    above ``head_dim``, and the rest rounded up to a power of two of at least 16 (0 if none)."""
    first = 1 << (head_dim.bit_length() - 1)
    rest = head_dim - first
    return first, (0 if rest == 0 else max(16, 1 << (rest - 1).bit_length()))


if AVAILABLE:

    @triton.jit
    def _attend(
        q0,
        q1,
        m_i,
        l_i,
        acc0,
        acc1,
        k_base,
        v_base,
        n,
        t,
        stride_t,
        qk_scale,
        c0,
        c1,
        tail_ok,
        HD1: tl.constexpr,
        MASKED: tl.constexpr,
    ):
        """The online softmax's update by one block of keys ``n``."""
        key_ok = n < t
        k_cols = k_base + n[None, :] * stride_t
        v_rows = v_base + n[:, None] * stride_t
        if MASKED:
            k0 = tl.load(k_cols + c0[:, None], mask=key_ok[None, :], other=0.0)
        else:
            k0 = tl.load(k_cols + c0[:, None])
        s = tl.dot(q0, k0)
        if HD1 > 0:
            k1 = tl.load(k_cols + c1[:, None], mask=tail_ok[:, None] & key_ok[None, :], other=0.0)
            s = tl.dot(q1, k1, s)
        s = s * qk_scale
        if MASKED:
            s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        p16 = p.to(q0.dtype)
        if MASKED:
            v0 = tl.load(v_rows + c0[None, :], mask=key_ok[:, None], other=0.0)
        else:
            v0 = tl.load(v_rows + c0[None, :])
        acc0 = tl.dot(p16, v0, acc0 * alpha[:, None])
        if HD1 > 0:
            v1 = tl.load(v_rows + c1[None, :], mask=key_ok[:, None] & tail_ok[None, :], other=0.0)
            acc1 = tl.dot(p16, v1, acc1 * alpha[:, None])
        return m_new, l_i, acc0, acc1

    @triton.jit
    def _tower_attention_kernel(
        qkv_ptr,
        out_ptr,
        t,
        n_heads,
        qkv_stride_n,
        qkv_stride_t,
        out_stride_n,
        out_stride_t,
        qk_scale,
        D: tl.constexpr,
        HD: tl.constexpr,
        HD0: tl.constexpr,
        HD1: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """One block of queries of one (crop, head) against all of its keys."""
        TAIL: tl.constexpr = HD1 if HD1 > 0 else 16  # shapes of the unused tail, if none
        pid_m = tl.program_id(0)
        crop = tl.program_id(1) // n_heads
        head = tl.program_id(1) % n_heads
        base = qkv_ptr + crop.to(tl.int64) * qkv_stride_n + head * HD
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < t
        c0 = tl.arange(0, HD0)
        c1 = HD0 + tl.arange(0, TAIL)
        tail_ok = c1 < HD
        q_rows = base + rows[:, None] * qkv_stride_t
        q0 = tl.load(q_rows + c0[None, :], mask=row_ok[:, None], other=0.0)
        q1 = tl.load(q_rows + c1[None, :], mask=row_ok[:, None] & tail_ok[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc0 = tl.zeros([BLOCK_M, HD0], tl.float32)
        acc1 = tl.zeros([BLOCK_M, TAIL], tl.float32)
        keys = tl.arange(0, BLOCK_N)
        k_base = base + D
        v_base = base + 2 * D
        full = (t // BLOCK_N) * BLOCK_N
        for start in range(0, full, BLOCK_N):
            m_i, l_i, acc0, acc1 = _attend(
                q0, q1, m_i, l_i, acc0, acc1, k_base, v_base, start + keys, t, qkv_stride_t,
                qk_scale, c0, c1, tail_ok, HD1, False,
            )  # fmt: skip
        if full < t:
            m_i, l_i, acc0, acc1 = _attend(
                q0, q1, m_i, l_i, acc0, acc1, k_base, v_base, full + keys, t, qkv_stride_t,
                qk_scale, c0, c1, tail_ok, HD1, True,
            )  # fmt: skip
        inv = 1.0 / l_i
        out_ty = out_ptr.dtype.element_ty
        o_rows = (
            out_ptr + crop.to(tl.int64) * out_stride_n + rows[:, None] * out_stride_t + head * HD
        )
        tl.store(o_rows + c0[None, :], (acc0 * inv[:, None]).to(out_ty), mask=row_ok[:, None])
        if HD1 > 0:
            o1 = (acc1 * inv[:, None]).to(out_ty)
            tl.store(o_rows + c1[None, :], o1, mask=row_ok[:, None] & tail_ok[None, :])


def tower_attention_sdpa(qkv: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The same attention through PyTorch's SDPA: the CPU path and the reference."""
    n, t, d3 = qkv.shape
    d = d3 // 3
    q, k, v = (c.view(n, t, n_heads, d // n_heads).transpose(1, 2) for c in qkv.chunk(3, dim=-1))
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, t, d)


@contextmanager
def backend(name: str) -> Iterator[None]:
    """`tower_attention` through ``name`` ("triton" where it can, or "sdpa") inside the block,
    for A/B measurements (process-wide; a captured graph keeps the kernels it captured)."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"tower attention backend must be one of {BACKENDS}, got {name!r}")
    before, _backend = _backend, name
    try:
        yield
    finally:
        _backend = before


def uses_triton(qkv: torch.Tensor) -> bool:
    """Whether `tower_attention` takes the Triton kernel for this input."""
    return (
        _backend == "triton"
        and AVAILABLE
        and qkv.is_cuda
        and qkv.dtype in (torch.bfloat16, torch.float16)
    )


def tower_attention(
    qkv: torch.Tensor, n_heads: int, config: TowerAttentionConfig = DEFAULT_CONFIG
) -> torch.Tensor:
    """softmax(Q K^T / sqrt(head_dim)) V per crop and head, all keys visible.

    ``qkv`` is the QKV product ``[n, t, 3d]``; the result is ``[n, t, d]`` with each head's
    columns where the projection expects them. Triton on CUDA in 16 bits, SDPA otherwise.
    """
    if uses_triton(qkv):
        return tower_attention_triton(qkv, n_heads, config)
    return tower_attention_sdpa(qkv, n_heads)


def tower_attention_triton(
    qkv: torch.Tensor, n_heads: int, config: TowerAttentionConfig = DEFAULT_CONFIG
) -> torch.Tensor:
    """`tower_attention` through the Triton kernel, on whatever device Triton runs it."""
    n, t, d3 = qkv.shape
    d = d3 // 3
    if d3 != 3 * d or d % n_heads:
        raise ValueError(f"qkv width {d3} is not 3 x a multiple of {n_heads} heads")
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    hd = d // n_heads
    hd0, hd1 = head_slices(hd)
    out = torch.empty(n, t, d, device=qkv.device, dtype=qkv.dtype)
    grid = (triton.cdiv(t, config.block_m), n * n_heads)
    _tower_attention_kernel[grid](
        qkv,
        out,
        t,
        n_heads,
        qkv.stride(0),
        qkv.stride(1),
        out.stride(0),
        out.stride(1),
        LOG2E / math.sqrt(hd),
        D=d,
        HD=hd,
        HD0=hd0,
        HD1=hd1,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        num_warps=config.warps,
        num_stages=config.stages,
    )
    return out
