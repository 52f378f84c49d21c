"""Tau scaling in two Triton launches (CUDA): `Tau.scale`'s ~15 PyTorch ops and two small
products per layer (GELU, the two head projections, tanh, the position term, the scalings, the
concatenation) as two kernels over the fused projection.

1. `_logits_kernel`, per (block of tokens, block of tau heads, split of the projection's
   columns): the heads' partial logits ``GELU(qkv) . w`` (fp32 sums of the rounded GELU, as
   ``F.linear`` takes it). The split count depends on the width and on which side of
   ``DECODE_M`` the step's token count falls only, so a token's sums are the same at every
   batch size of that side (an image prefix is always on the wide side); one program per block
   over the whole width ran at 157 us a layer for one token (H100), the splits spread the
   weights' read over the GPU, and wide steps take fewer: their partial sums are written and
   read back.
2. `_scale_kernel`, per (block of tokens, block of tau heads; query heads first, then value
   heads): the splits summed in order, ``tanh(logit) + position term``, the heads' columns
   scaled into a new tensor; the value programs also copy the key heads through. Every output
   element is written by exactly one program.

Each intermediate is rounded to the activations' dtype where the PyTorch path rounds it (GELU,
the products, tanh, the sums and the scalings), so bf16 results match `Tau.scale` up to the
products' summation order and the transcendental functions' last fp32 bits.
"""

from __future__ import annotations

import os

import torch

from vlm_server.models.common import launch_overlap

try:
    import triton
    import triton.language as tl

    from vlm_server.models.common.launch_overlap import gdc_launch_dependents, gdc_wait
except ImportError:  # the CPU path needs no Triton
    triton = None
    tl = None

BLOCK_M = 16  # tokens per program
BLOCK_H = 16  # tau heads per program (tl.dot's smallest N)
BLOCK_K = 128  # the projection's columns per step of the logits' sums
# Programs over the projection's columns per block of tokens and heads, and heads per program
# of the scaling (one for a decode step's few rows, four for a prefill). Moondream 3 on an
# H100, logits + scale at one token: 6.9 us a layer with 48 splits (one 128-column step each)
# and 1 head against 16.2 with 16 splits and 4 heads.
MAX_SPLITS = 48
SCALE_H = 1
# Wide steps (above DECODE_M tokens): splits, columns per step, heads per scaling program. At
# 730 / 2920 / 5840 tokens (a batch of 1 / 4 / 8 image prefixes): 48 splits of 128 columns
# 23.8 / 89.7 / 190.1 us a layer, 16 splits of 64 columns 22.2 / 64.3 / 123.7 (the partial
# sums at 5840 tokens: 72 MB with 48 splits).
MAX_SPLITS_WIDE = 16
BLOCK_K_WIDE = 64
SCALE_H_WIDE = 4
DECODE_M = 64  # up to this many tokens, BLOCK_M per program
WIDE_M = 64  # tokens per program above that (prefill: the GELU computed once per 64)
# Triton's interpreter (the CPU tests) multiplies bf16 operands as raw bits: there the products
# run in fp32 on the rounded values, which is exact too.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def available(x: torch.Tensor) -> bool:
    """Whether the kernel can run on ``x`` (CUDA and Triton)."""
    return triton is not None and x.is_cuda


if triton is not None:

    @triton.jit
    def _tanh(x):
        # tanh(x) = 1 - 2 / (e^(2x) + 1): exact limits at both ends (e^(2x) overflows to inf
        # for large x and gives 1; underflows to 0 for very negative x and gives -1).
        return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)

    # Only core builtins and this module's helpers in the kernel (no `tl.zeros`, `tl.sum`: the
    # standard library's are jitted where Triton was imported, so the CPU tests' interpreted
    # copy of this module could not call them).
    @triton.jit
    def _add(a, b):
        return a + b

    @triton.jit
    def _round(x, dtype: tl.constexpr):
        """fp32 ``x`` rounded to ``dtype``, as fp32. bf16 by its bits (nearest, ties to even):
        the GPU's conversion does the same, but Triton's interpreter (the CPU tests) does not."""
        if dtype == tl.bfloat16:
            b = x.to(tl.uint32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16
            return b.to(tl.float32, bitcast=True)
        elif dtype == tl.float32:
            return x
        else:
            return x.to(dtype).to(tl.float32)

    @triton.jit
    def _cast(x, dtype: tl.constexpr):
        # Exact: the value is representable after `_round`.
        return _round(x, dtype).to(dtype)

    @triton.jit
    def _heads(pid_h, H: tl.constexpr, KVH: tl.constexpr, BH: tl.constexpr):
        """A program's block of tau heads: (whether value heads, first head, mask, their rows
        in the stacked [wq; wv])."""
        q_blocks = (H + BH - 1) // BH
        is_v = pid_h >= q_blocks
        first = tl.where(is_v, pid_h - q_blocks, pid_h) * BH
        heads = first + tl.arange(0, BH)
        hmask = heads < tl.where(is_v, KVH, H)
        return is_v, first, hmask, heads + tl.where(is_v, H, 0)

    @triton.jit
    def _logits_kernel(
        qkv_ptr,
        w_ptr,
        part_ptr,
        M,
        stride_in,
        H: tl.constexpr,
        KVH: tl.constexpr,
        HD: tl.constexpr,
        BM: tl.constexpr,
        BH: tl.constexpr,
        BK: tl.constexpr,
        ITERS: tl.constexpr,
        GELU_ERF: tl.constexpr,
        TENSOR_CORES: tl.constexpr,
        ALL_HEADS: tl.constexpr = False,
        PDL: tl.constexpr = False,
    ):
        """Partial sums of GELU(qkv) . w over one split of the projection's columns, per (block
        of tokens, block of tau heads, split): [splits, M, H + KVH] fp32. With ``ALL_HEADS``
        one block holds every tau head (query and value), so each GELU is computed once."""
        if PDL:  # launched early (launch_overlap.py): wait for the predecessor first
            gdc_wait()
            gdc_launch_dependents()
        dtype = qkv_ptr.dtype.element_ty
        width = (H + 2 * KVH) * HD
        if ALL_HEADS:
            w_rows = tl.arange(0, BH)
            hmask = w_rows < H + KVH
        else:
            _, _, hmask, w_rows = _heads(tl.program_id(1), H, KVH, BH)
        split = tl.program_id(2)
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        rmask = rows < M
        rows64 = rows.to(tl.int64)
        acc = tl.full((BM, BH), 0.0, tl.float32)
        for i in range(ITERS):
            ks = (split * ITERS + i) * BK + tl.arange(0, BK)
            kmask = ks < width
            x = tl.load(
                qkv_ptr + rows64[:, None] * stride_in + ks[None, :],
                mask=rmask[:, None] & kmask[None, :],
                other=0.0,
            ).to(tl.float32)
            if GELU_ERF:
                g = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
            else:
                g = 0.5 * x * (1.0 + _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
            w = tl.load(
                w_ptr + w_rows[None, :].to(tl.int64) * width + ks[:, None],
                mask=hmask[None, :] & kmask[:, None],
                other=0.0,
            )
            if TENSOR_CORES:  # bf16 products, exact, summed in fp32
                acc += tl.dot(_cast(g, dtype), w)
            else:  # fp32 weights, or the interpreter: fp32 products of the rounded values
                acc += tl.dot(_round(g, dtype), w.to(tl.float32), input_precision="ieee")
        at = part_ptr + (split * M + rows64[:, None]) * (H + KVH) + w_rows[None, :]
        tl.store(at, acc, mask=rmask[:, None] & hmask[None, :])

    @triton.jit
    def _scale_kernel(
        qkv_ptr,
        out_ptr,
        part_ptr,
        alpha_ptr,
        pos_ptr,
        M,
        stride_in,
        stride_out,
        stride_pos,
        SPLITS: tl.constexpr,
        H: tl.constexpr,
        KVH: tl.constexpr,
        HD: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BM: tl.constexpr,
        BH: tl.constexpr,
        BF16_POS: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """The logits' splits summed in order, tanh, the position term, and the scaled heads
        (the value heads' programs also copy the key heads), per (block of tokens, block of
        tau heads)."""
        if PDL:  # launched early (launch_overlap.py): wait for the predecessor first
            gdc_wait()
            gdc_launch_dependents()
        dtype = out_ptr.dtype.element_ty
        is_v, first, hmask, w_rows = _heads(tl.program_id(1), H, KVH, BH)
        heads = w_rows - tl.where(is_v, H, 0)
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        rmask = rows < M
        rows64 = rows.to(tl.int64)
        acc = tl.full((BM, BH), 0.0, tl.float32)
        for s in range(SPLITS):  # in split order: the same sums at every batch size
            at = part_ptr + (s * M + rows64[:, None]) * (H + KVH) + w_rows[None, :]
            acc += tl.load(at, mask=rmask[:, None] & hmask[None, :], other=0.0)
        t = _round(_tanh(_round(acc, dtype)), dtype)

        # The position term, per token and head (the value heads take alpha's first KVH).
        p = tl.load(pos_ptr + rows64 * stride_pos, mask=rmask, other=0).to(tl.float32)
        alpha = tl.load(alpha_ptr + heads, mask=hmask, other=0.0).to(tl.float32)
        if BF16_POS:  # every step in bf16, as the Hugging Face code runs it
            pb = _round(p, tl.bfloat16)
            lg = _round(tl.log(_round(pb + 1.0, tl.bfloat16)), tl.bfloat16)
            z = _round(_round(alpha, tl.bfloat16)[None, :] * lg[:, None], tl.bfloat16)
            s = _round(1.0 / (1.0 + tl.exp(-z)), tl.bfloat16)
            pos = _round(_round(1.0 + _round(s - 0.5, tl.bfloat16), tl.bfloat16), dtype)
        else:
            lp = tl.log(1.0 + p)  # exact 1 + p: positions are below 2^24
            pos = _round(1.0 / (1.0 + tl.exp(-(alpha[None, :] * lp[:, None]))) + 0.5, dtype)
        tau = _round(t + pos, dtype)

        # Scale each head's columns (query heads at 0, value heads after the keys).
        n_heads = tl.where(is_v, KVH, H)
        ds = tl.arange(0, BLOCK_D)
        dmask = ds < HD
        base = tl.where(is_v, (H + KVH) * HD, 0)
        hs = tl.arange(0, BH)
        for j in tl.static_range(BH):
            head = first + j
            if head < n_heads:
                scale = tl.reduce(tl.where(hs[None, :] == j, tau, 0.0), 1, _add)  # [BM]
                cols = base + head * HD + ds
                m = rmask[:, None] & dmask[None, :]
                x = tl.load(qkv_ptr + rows64[:, None] * stride_in + cols[None, :], mask=m)
                y = _cast(x.to(tl.float32) * scale[:, None], dtype)
                tl.store(out_ptr + rows64[:, None] * stride_out + cols[None, :], y, mask=m)
                if is_v:  # the key head of the same index, unchanged
                    kcols = H * HD + head * HD + ds
                    k = tl.load(qkv_ptr + rows64[:, None] * stride_in + kcols[None, :], mask=m)
                    tl.store(out_ptr + rows64[:, None] * stride_out + kcols[None, :], k, mask=m)


def tau_scale(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    w: torch.Tensor,
    alpha: torch.Tensor,
    n_heads: int,
    n_kv_heads: int,
    gelu_erf: bool,
    bf16_positions: bool,
) -> torch.Tensor:
    """`Tau.scale` in two launches: ``qkv`` [B, T, (H + 2 KVH) * hd] at ``positions`` [B, T],
    ``w`` the stacked [wq; wv] [H + KVH, width] in ``qkv``'s dtype, ``alpha`` [H] -> the
    projection with its query and value heads scaled, a new tensor."""
    if triton is None:
        raise RuntimeError("the fused tau kernel needs Triton")
    b, t, width = qkv.shape
    hd = width // (n_heads + 2 * n_kv_heads)
    x = qkv.reshape(b * t, width)
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((b * t, width), dtype=qkv.dtype, device=qkv.device)
    m = b * t
    if m:
        wide = m > DECODE_M
        bk = BLOCK_K_WIDE if wide else BLOCK_K
        blocks = triton.cdiv(width, bk)
        iters = triton.cdiv(blocks, min(MAX_SPLITS_WIDE if wide else MAX_SPLITS, blocks))
        splits = triton.cdiv(blocks, iters)  # a model constant per side: batch-invariant sums
        part = torch.empty(
            (splits, m, n_heads + n_kv_heads), dtype=torch.float32, device=qkv.device
        )
        bm = WIDE_M if wide else BLOCK_M
        rows = triton.cdiv(m, bm)
        shape = {"H": n_heads, "KVH": n_kv_heads, "HD": hd, "BM": bm}
        tc = qkv.dtype in (torch.bfloat16, torch.float16) and not _INTERPRETED
        # A prefill takes every head in one block, so each GELU is computed once, not once per
        # block of heads: 31 -> 14.8 us a layer at 730 tokens (H100).
        if wide:
            heads, bh = 1, max(BLOCK_H, triton.next_power_of_2(n_heads + n_kv_heads))
        else:
            heads = triton.cdiv(n_heads, BLOCK_H) + triton.cdiv(n_kv_heads, BLOCK_H)
            bh = BLOCK_H
        _logits_kernel[(rows, heads, splits)](
            x, w, part, m, x.stride(0), BH=bh, BK=bk, ITERS=iters,
            GELU_ERF=gelu_erf, TENSOR_CORES=tc, ALL_HEADS=wide, **shape,
            **launch_overlap.kernel_args(),
        )  # fmt: skip
        sh = SCALE_H_WIDE if wide else SCALE_H
        scale_heads = triton.cdiv(n_heads, sh) + triton.cdiv(n_kv_heads, sh)
        # A view where it can be (the decode step's positions are a column of a wider table).
        pos = positions.reshape(-1)
        _scale_kernel[(rows, scale_heads)](
            x, out, part, alpha, pos, m, x.stride(0), out.stride(0), pos.stride(0),
            SPLITS=splits, BLOCK_D=triton.next_power_of_2(hd), BF16_POS=bf16_positions,
            BH=sh, **shape, **launch_overlap.kernel_args(),
        )  # fmt: skip
    return out.view(b, t, width)
