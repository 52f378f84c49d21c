"""The Triton kernel that writes the KV cache: rotary on queries and keys, then keys and values
into their pages, in one launch per layer (decode rows, a mixed step's tokens, image prefixes).

Compact pages (``--kv-dtype fp8|int8``) are written as models/kv.py `quantize_kv` writes them:
each (token, KV head) vector scaled to the type's largest magnitude, its fp32 scale stored
beside the page (``k_scale``, ``v_scale``: [pages, page_size, kv_heads]), INT8 rounded half to
even, FP8 e4m3 rounded to nearest; the attention kernels (triton_attention.py) read them back.
"""

from __future__ import annotations

import torch

from vlm_server.models.common import launch_overlap
from vlm_server.models.kv import KV_QMAX

try:
    import triton
    import triton.language as tl

    from vlm_server.models.common.launch_overlap import gdc_launch_dependents, gdc_wait
except ImportError:  # the CPU path needs no Triton
    triton = None
    tl = None

AVAILABLE = triton is not None

# QUANT of `_rope_store_kernel` by page element type: 0 exact, 1 INT8, 2 FP8 e4m3.
QUANT_KINDS = {torch.int8: 1, torch.float8_e4m3fn: 2}


if AVAILABLE:

    @triton.jit
    def _round_half_even(y):
        """torch.round's rounding, from floor: no libdevice call (the interpreter has none)."""
        r = tl.floor(y + 0.5)
        odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
        return tl.where(((r - y) == 0.5) & odd, r - 1.0, r)

    @triton.jit
    def _e4m3_grid(y):
        """y (|y| <= 448) rounded half to even onto the e4m3 values, in fp32: the conversion
        that follows is then exact, whichever rounding it does (Triton's interpreter carries
        no rounding into the exponent). A binade's step is 2^(e - 3); subnormals use 2^-9."""
        bits = y.to(tl.int32, bitcast=True)
        e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
        step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
        return _round_half_even(y / step) * step

    @triton.jit
    def _quantized(x, QMAX: tl.constexpr, QUANT: tl.constexpr):
        """x [T, HD] fp32 -> (scaled elements on the type's grid, still fp32; scales [T]):
        one scale per row, as `quantize_kv`."""
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.where(amax > 0.0, amax / QMAX, 1.0)
        y = x / scale[:, None]
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        y = _round_half_even(y) if QUANT == 1 else _e4m3_grid(y)
        return y, scale

    @triton.jit
    def _store_kv(x, pool_ptr, scale_ptr, out_ptr, slot, scale_slot, d, ok, row_ok,
                  QMAX: tl.constexpr, QUANT: tl.constexpr, STORE_OUT: tl.constexpr):  # fmt: skip
        """Write x [T, HD] (fp32) into its page slots (quantized when QUANT), and what the
        page now holds, in ``out_ptr``'s type, at ``out_ptr`` when STORE_OUT."""
        if QUANT > 0:
            y, scale = _quantized(x, QMAX, QUANT)
            q = y.to(pool_ptr.dtype.element_ty)
            tl.store(pool_ptr + slot + d, q, mask=ok)
            tl.store(scale_ptr + scale_slot, scale[:, None], mask=row_ok)
            if STORE_OUT:
                held = q.to(tl.float32) * scale[:, None]
                tl.store(out_ptr + d, held.to(out_ptr.dtype.element_ty), mask=ok)
        else:
            tl.store(pool_ptr + slot + d, x.to(pool_ptr.dtype.element_ty), mask=ok)
            if STORE_OUT:
                tl.store(out_ptr + d, x.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _rope_store_kernel(
        qkv_ptr,
        cos_ptr,
        sin_ptr,
        pos_ptr,
        table_ptr,
        rows_ptr,
        q_out_ptr,
        k_ptr,
        v_ptr,
        k_out_ptr,
        v_out_ptr,
        ks_ptr,
        vs_ptr,
        n_tokens,
        qkv_stride,
        pos_stride,
        table_stride,
        rows_stride,
        n_heads,
        PAGE: tl.constexpr,
        KVH: tl.constexpr,
        HD: tl.constexpr,
        HALF: tl.constexpr,
        STORE_K: tl.constexpr,  # also write the rotated keys to k_out [B, KVH, HD]
        STORE_V: tl.constexpr = False,  # and the values as stored to v_out (compact pages)
        QUANT: tl.constexpr = 0,  # `QUANT_KINDS`
        QMAX: tl.constexpr = 1.0,
        BLOCK_T: tl.constexpr = 1,
        PDL: tl.constexpr = False,
    ):
        if PDL:  # launched early (launch_overlap.py): wait for the predecessor first
            gdc_wait()
            gdc_launch_dependents()
        b = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        b_ok = b < n_tokens
        b = tl.where(b_ok, b, 0).to(tl.int64)  # rows past the end re-read row 0, never stored
        j = tl.program_id(1)
        pos = tl.load(pos_ptr + b * pos_stride)[:, None]
        d = tl.arange(0, HD)[None, :]
        rot = d < 2 * HALF
        first = d < HALF
        partner = tl.where(first, d + HALF, d - HALF)
        freq = tl.where(first, d, d - HALF)
        sign = tl.where(first, -1.0, 1.0)
        is_q = j < n_heads
        kvh = j - n_heads
        col = tl.where(is_q, j * HD, n_heads * HD + kvh * HD)
        base = qkv_ptr + b[:, None] * qkv_stride + col
        x = tl.load(base + d).to(tl.float32)
        xp = tl.load(base + partner, mask=rot, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + pos * HALF + freq, mask=rot, other=1.0)
        sn = tl.load(sin_ptr + pos * HALF + freq, mask=rot, other=0.0)
        out = tl.where(rot, x * c + sign * xp * sn, x)
        ok = b_ok[:, None] & (d < HD)
        if is_q:
            at = q_out_ptr + (b[:, None] * n_heads + j) * HD + d
            tl.store(at, out.to(q_out_ptr.dtype.element_ty), mask=ok)
        else:
            row = tl.load(rows_ptr + b * rows_stride)[:, None]
            page = tl.load(table_ptr + row * table_stride + pos // PAGE).to(tl.int64)
            scale_slot = (page * PAGE + pos % PAGE) * KVH + kvh
            slot = scale_slot * HD
            row_ok = b_ok[:, None]
            out_at = (b[:, None] * KVH + kvh) * HD
            _store_kv(out, k_ptr, ks_ptr, k_out_ptr + out_at, slot, scale_slot, d, ok, row_ok,
                      QMAX, QUANT, STORE_K)  # fmt: skip
            v = tl.load(qkv_ptr + b[:, None] * qkv_stride + (n_heads + KVH) * HD + kvh * HD + d)
            _store_kv(v.to(tl.float32), v_ptr, vs_ptr, v_out_ptr + out_at, slot, scale_slot, d,
                      ok, row_ok, QMAX, QUANT, STORE_V)  # fmt: skip


# Tokens per program of the rotary + KV write by token count: (fewer than, tokens a program).
# One token a program (one per token and head) costs 30 us a layer for a 730-token prefix on
# an H100, 6.1 in blocks of 16. The rotary is elementwise, so every launch writes the same bits.
ROPE_BLOCKS: tuple[tuple[int, int], ...] = ((16, 1), (128, 4), (1 << 62, 16))


def rope_block(tokens: int) -> int:
    """Tokens per program of `rope_and_store_kv` for a launch over ``tokens`` tokens."""
    return next(block for below, block in ROPE_BLOCKS if tokens < below)


def rope_and_store_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    rows: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    n_heads: int,
    k_out: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One kernel for a decode step's rotary and KV write: qkv [B, (H + 2 KVH) * hd] (the
    qkv projection of one position per row) -> rotated q [B, H, hd]; rotated k and v go
    straight into the paged pools at each row's position (and the rotated k into ``k_out``
    [B, KVH, hd] when given). cos/sin are the fp32 tables [max_context, rotary_dim / 2];
    rotary math in fp32, as the PyTorch path. Compact pools (int8, FP8) need ``k_scale`` and
    ``v_scale``; ``k_out`` and ``v_out`` then get the keys and values as stored, dequantized."""
    if not AVAILABLE:
        raise RuntimeError("Triton is not installed")
    b = qkv.shape[0]
    _, page, kvh, hd = k_pool.shape
    quant = QUANT_KINDS.get(k_pool.dtype, 0)
    if quant and (k_scale is None or v_scale is None):
        raise ValueError(f"a {k_pool.dtype} KV pool needs its scales")
    q = torch.empty((b, n_heads, hd), dtype=qkv.dtype, device=qkv.device)
    block = rope_block(b)
    _rope_store_kernel[(triton.cdiv(b, block), n_heads + kvh)](
        qkv,
        cos,
        sin,
        positions,
        block_table,
        rows,
        q,
        k_pool,
        v_pool,
        k_out if k_out is not None else q,
        v_out if v_out is not None else q,
        k_scale if k_scale is not None else cos,  # unread unless compact
        v_scale if v_scale is not None else cos,
        b,
        qkv.stride(0),
        positions.stride(0),
        block_table.stride(0),
        rows.stride(0),
        n_heads,
        PAGE=page,
        KVH=kvh,
        HD=hd,
        HALF=cos.shape[1],
        STORE_K=k_out is not None,
        STORE_V=v_out is not None,
        QUANT=quant,
        QMAX=KV_QMAX.get(k_pool.dtype, 1.0),
        BLOCK_T=block,
        **launch_overlap.kernel_args(),
    )
    return q
