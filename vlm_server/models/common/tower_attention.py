"""The vision tower's self-attention as one Triton kernel (CUDA; the CPU tests interpret it).

The towers' heads are 72 wide (1152 / 16): attention libraries round such a head up to their
next supported width (128), so a third or more of their matrix work multiplies zeros. Here a
head is a power-of-two part and a narrow rest (72 = 64 + 16, the rest's 8 padding columns
masked): scores are two products summed, the output two accumulators. Online softmax over key
blocks in fp32 (exp2, the scale folded into it), probabilities in the values' dtype for the
second product, as flash attention runs it; no mask (every patch sees every patch).

It reads the QKV projection as the tower writes it ([n, t, 3 * heads * hd], Q | K | V, heads
inside each) and writes [n, t, heads * hd], the layout the output projection takes: no
transposes or copies around it.
"""

from __future__ import annotations

import math
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path needs no Triton
    triton = None
    tl = None

BLOCK_M = 128  # queries per program
BLOCK_N = 64  # keys per step
WARPS = 8
STAGES = 2
# Triton's interpreter (the CPU tests) multiplies bf16 operands as raw bits: fp32 there.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_LOG2E = 1.4426950408889634


def available(x: torch.Tensor) -> bool:
    """Whether the kernel can run on ``x`` (CUDA and Triton)."""
    return triton is not None and x.is_cuda


def split_head(hd: int) -> tuple[int, int]:
    """A head's width as (power-of-two part, rest padded to a product's smallest width, 0 when
    none): 72 -> (64, 16), 64 -> (64, 0), 40 -> (32, 16)."""
    if hd < 16:
        raise ValueError(f"head width {hd} is below 16")
    main = 1 << (hd.bit_length() - 1)
    rest = hd - main
    return main, 0 if rest == 0 else max(16, 1 << (rest - 1).bit_length())


if triton is not None:
    # Reductions with the standard library's combine functions, not tl.max / tl.sum: the CPU
    # tests' interpreted copy can call neither (jitted where Triton was imported).
    _SUM = tl.standard._sum_combine
    _MAX = tl.standard._elementwise_max

    @triton.jit
    def _mma(a, b, acc, IEEE: tl.constexpr):
        """``acc + a @ b``: fp32 products in full precision (IEEE), else the matrix units'."""
        if IEEE:
            return tl.dot(a, b, acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc)

    @triton.jit
    def _attention_kernel(
        qkv_ptr, out_ptr, T, stride_row, qk_scale,
        H: tl.constexpr, HD: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
        HAS_B: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        """One block of BM queries of one (picture, head) against all T keys; a head's
        columns are [0, DA) and, with HAS_B, [DA, HD) in a block of DB."""
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        dt = out_ptr.dtype.element_ty
        width = H * HD
        base = qkv_ptr + b.to(tl.int64) * T * stride_row
        rows = pid_m * BM + tl.arange(0, BM)
        rmask = rows < T
        da = tl.arange(0, DA)
        db = DA + tl.arange(0, DB)
        dbm = db < HD
        q_at = base + rows[:, None].to(tl.int64) * stride_row + h * HD
        q_a = tl.load(q_at + da[None, :], mask=rmask[:, None], other=0.0)
        if HAS_B:
            q_b = tl.load(q_at + db[None, :], mask=rmask[:, None] & dbm[None, :], other=0.0)
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.full([BM], 0.0, tl.float32)
        acc_a = tl.full([BM, DA], 0.0, tl.float32)
        acc_b = tl.full([BM, DB], 0.0, tl.float32)
        for start in range(0, T, BN):
            cols = start + tl.arange(0, BN)
            cmask = cols < T
            k_at = base + cols[None, :].to(tl.int64) * stride_row + width + h * HD
            k_a = tl.load(k_at + da[:, None], mask=cmask[None, :], other=0.0)  # [DA, BN]
            s = _mma(q_a, k_a, tl.full([BM, BN], 0.0, tl.float32), IEEE)
            if HAS_B:
                k_b = tl.load(k_at + db[:, None], mask=cmask[None, :] & dbm[:, None], other=0.0)
                s = _mma(q_b, k_b, s, IEEE)
            s = tl.where(cmask[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
            v_at = base + cols[:, None].to(tl.int64) * stride_row + 2 * width + h * HD
            v_a = tl.load(v_at + da[None, :], mask=cmask[:, None], other=0.0)  # [BN, DA]
            pv = p.to(v_a.dtype)
            acc_a = _mma(pv, v_a, acc_a * alpha[:, None], IEEE)
            if HAS_B:
                v_b = tl.load(v_at + db[None, :], mask=cmask[:, None] & dbm[None, :], other=0.0)
                acc_b = _mma(pv, v_b, acc_b * alpha[:, None], IEEE)
            m_i = m_new
        o_at = out_ptr + (b.to(tl.int64) * T + rows[:, None]) * width + h * HD
        tl.store(o_at + da[None, :], (acc_a / l_i[:, None]).to(dt), mask=rmask[:, None])
        if HAS_B:
            o_b = (acc_b / l_i[:, None]).to(dt)
            tl.store(o_at + db[None, :], o_b, mask=rmask[:, None] & dbm[None, :])


def attention(qkv: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Self-attention of each picture's tokens: ``qkv`` [n, t, 3 * n_heads * hd] (Q | K | V,
    head-major inside each; rows may be strided) -> [n, t, n_heads * hd], softmax scaled by
    ``hd ** -0.5`` as `F.scaled_dot_product_attention`."""
    if triton is None:
        raise RuntimeError("the tower attention kernel needs Triton")
    n, t, three_d = qkv.shape
    d = three_d // 3
    hd = d // n_heads
    if qkv.stride(2) != 1 or qkv.stride(0) != t * qkv.stride(1):
        qkv = qkv.contiguous()
    da, db = split_head(hd)
    out = torch.empty((n, t, d), dtype=qkv.dtype, device=qkv.device)
    if n and t:
        ieee = qkv.dtype == torch.float32 or _INTERPRETED
        grid = (triton.cdiv(t, BLOCK_M), n * n_heads)
        _attention_kernel[grid](
            qkv, out, t, qkv.stride(1), _LOG2E / math.sqrt(hd), H=n_heads, HD=hd, DA=da,
            DB=db or 16, HAS_B=db > 0, BM=BLOCK_M, BN=BLOCK_N, IEEE=ieee, num_warps=WARPS,
            num_stages=STAGES,
        )  # fmt: skip
    return out
