"""Paged decode attention as a Triton kernel: each (row, head) reads only its live pages.

One program per (batch row, query head) walks the row's block-table entries up to the row's
length with an online softmax, BLOCK_N positions at a time. Shapes never depend on host
values (lengths and block rows are read on the device), so the call can be graph-captured.
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


if AVAILABLE:

    @triton.jit
    def _paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, rows_ptr, lengths_ptr,
        scale, table_stride, n_heads, kv_group,
        PAGE: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr, BLOCK_N: tl.constexpr,
        MAX_POS: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        kvh = h // kv_group
        row = tl.load(rows_ptr + b)
        length = tl.load(lengths_ptr + b)
        d = tl.arange(0, HD)
        q = tl.load(q_ptr + (b * n_heads + h) * HD + d).to(tl.float32) * scale
        m_i = -float("inf")
        l_i = 0.0
        acc = tl.zeros([HD], dtype=tl.float32)
        n = tl.arange(0, BLOCK_N)
        # A static loop with a scalar branch: the bound is the row's length, read on the device.
        for start in tl.range(0, MAX_POS, BLOCK_N):
            if start < length:
                pos = start + n
                valid = pos < length
                page = tl.load(table_ptr + row * table_stride + pos // PAGE, mask=valid,
                               other=0)
                base = (page.to(tl.int64) * PAGE + pos % PAGE) * (KVH * HD) + kvh * HD
                k = tl.load(k_ptr + base[:, None] + d[None, :], mask=valid[:, None], other=0.0)
                s = tl.sum(k.to(tl.float32) * q[None, :], axis=1)
                s = tl.where(valid, s, -float("inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=0))
                p = tl.exp(s - m_new)
                alpha = tl.exp(m_i - m_new)
                v = tl.load(v_ptr + base[:, None] + d[None, :], mask=valid[:, None], other=0.0)
                acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
                l_i = l_i * alpha + tl.sum(p, axis=0)
                m_i = m_new
        tl.store(out_ptr + (b * n_heads + h) * HD + d, (acc / l_i).to(out_ptr.dtype.element_ty))


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           block_table: torch.Tensor, rows: torch.Tensor,
                           lengths: torch.Tensor, block_n: int = 64) -> torch.Tensor:
    """q [B, H, hd] -> out [B, H, hd]; row b attends to positions [0, lengths[b]) of
    ``block_table[rows[b]]`` in the pools [n_pages, page_size, kv_heads, hd]."""
    if not AVAILABLE:
        raise RuntimeError("Triton is not installed")
    b, n_heads, hd = q.shape
    _, page, kvh, _ = k_pool.shape
    out = torch.empty_like(q)
    _paged_decode_kernel[(b, n_heads)](
        q, k_pool, v_pool, out, block_table, rows, lengths,
        hd ** -0.5, block_table.stride(0), n_heads, n_heads // kvh,
        PAGE=page, KVH=kvh, HD=hd, BLOCK_N=block_n, MAX_POS=block_table.shape[1] * page,
    )
    return out
