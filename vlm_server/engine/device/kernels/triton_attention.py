"""Triton kernels of the steps: paged decode attention and varlen paged attention over query
tiles for mixed steps (the rotary + paged KV write: triton_kv_store.py).

Attention reads only each row's live pages: programs per (batch row, query head, split) walk
a share of the row's block-table entries up to the row's length with an online softmax,
BLOCK_N positions at a time, and a second kernel merges the splits (flash-decoding: at one
stream, 32 heads alone would leave most of the GPU idle). Shapes never depend on host values
(lengths and block rows are read on the device), so the calls can be graph-captured.

Compact pages (int8, FP8 e4m3; SCALED) are read with their scales (one per position and KV
head): a key's scale multiplies its dot products, a value's its softmax weight, which is the
attention over the dequantized pages up to fp32 rounding.
"""

from __future__ import annotations

import torch

from vlm_server.models.common import launch_overlap
from vlm_server.models.kv import compact

try:
    import triton
    import triton.language as tl

    from vlm_server.models.common.launch_overlap import gdc_launch_dependents, gdc_wait
except ImportError:  # the CPU path needs no Triton
    triton = None
    tl = None

AVAILABLE = triton is not None


if AVAILABLE:

    @triton.jit
    def _decode_block(start, length, row, q, m_i, l_i, acc, keys, values, k_scales, v_scales,
                      table, table_stride, kvh, d, n, PAGE: tl.constexpr, KVH: tl.constexpr,
                      HD: tl.constexpr, SCALED: tl.constexpr):  # fmt: skip
        """One block of a decode row's positions into its online softmax (m, l, acc); pointers
        named without "_ptr": a helper inlined into the kernels, not launched."""
        pos = start + n
        valid = pos < length
        page = tl.load(table + row * table_stride + pos // PAGE, mask=valid, other=0)
        slot = (page.to(tl.int64) * PAGE + pos % PAGE) * KVH + kvh
        base = slot * HD
        k = tl.load(keys + base[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        s = tl.sum(k.to(tl.float32) * q[None, :], axis=1)
        if SCALED:
            s = s * tl.load(k_scales + slot, mask=valid, other=0.0)
        s = tl.where(valid, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(values + base[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        pv = p
        if SCALED:
            pv = p * tl.load(v_scales + slot, mask=valid, other=0.0)
        acc = acc * alpha + tl.sum(pv[:, None] * v.to(tl.float32), axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        return m_new, l_i, acc

    @triton.jit
    def _paged_decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        ks_ptr,
        vs_ptr,
        m_ptr,
        l_ptr,
        acc_ptr,
        table_ptr,
        rows_ptr,
        lengths_ptr,
        scale,
        table_stride,
        rows_stride,
        n_heads,
        kv_group,
        PAGE: tl.constexpr,
        KVH: tl.constexpr,
        HD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLITS: tl.constexpr,
        STATIC_MAX: tl.constexpr,  # positions one split can cover, or 0: a device-read bound
        SCALED: tl.constexpr = False,  # compact pages with scales (ks_ptr, vs_ptr)
        PDL: tl.constexpr = False,
    ):
        """Partial attention of one (row, head) over one split of its live positions."""
        if PDL:  # launched early (launch_overlap.py): wait for the predecessor first
            gdc_wait()
            gdc_launch_dependents()
        b = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        kvh = h // kv_group
        row = tl.load(rows_ptr + b * rows_stride)
        length = tl.load(lengths_ptr + b)
        # Splits cover the row's positions in equal, BLOCK_N-aligned chunks.
        chunk = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N
        lo = sp * chunk
        d = tl.arange(0, HD)
        q = tl.load(q_ptr + (b * n_heads + h) * HD + d).to(tl.float32) * scale
        m_i = -float("inf")
        l_i = 0.0
        acc = tl.zeros([HD], dtype=tl.float32)
        n = tl.arange(0, BLOCK_N)
        live = tl.minimum(chunk, length - lo)  # this split's live positions (device-read)
        if STATIC_MAX > 0:  # a short context: a loop of known length, a branch per block
            for i in tl.range(0, STATIC_MAX, BLOCK_N):
                if i < live:
                    m_i, l_i, acc = _decode_block(
                        lo + i, length, row, q, m_i, l_i, acc, k_ptr, v_ptr, ks_ptr, vs_ptr,
                        table_ptr, table_stride, kvh, d, n, PAGE, KVH, HD, SCALED,
                    )  # fmt: skip
        else:  # a long one (32K for Moondream 3): only the live blocks' iterations
            for i in tl.range(0, live, BLOCK_N):
                m_i, l_i, acc = _decode_block(
                    lo + i, length, row, q, m_i, l_i, acc, k_ptr, v_ptr, ks_ptr, vs_ptr,
                    table_ptr, table_stride, kvh, d, n, PAGE, KVH, HD, SCALED,
                )  # fmt: skip
        part = (b * n_heads + h) * SPLITS + sp
        tl.store(m_ptr + part, m_i)
        tl.store(l_ptr + part, l_i)
        tl.store(acc_ptr + part * HD + d, acc)

    @triton.jit
    def _combine_kernel(
        m_ptr,
        l_ptr,
        acc_ptr,
        out_ptr,
        SPLITS: tl.constexpr,
        HD: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """Merge the splits' online-softmax partials of one (row, head)."""
        if PDL:  # launched early (launch_overlap.py): wait for the predecessor first
            gdc_wait()
            gdc_launch_dependents()
        bh = tl.program_id(0)
        s = tl.arange(0, SPLITS)
        d = tl.arange(0, HD)
        m = tl.load(m_ptr + bh * SPLITS + s)
        l = tl.load(l_ptr + bh * SPLITS + s)  # noqa: E741
        acc = tl.load(acc_ptr + (bh * SPLITS + s)[:, None] * HD + d[None, :])
        top = tl.max(m, axis=0)
        w = tl.where(m == -float("inf"), 0.0, tl.exp(m - top))
        total = tl.sum(w * l, axis=0)
        # Nothing visible (a padding token of a mixed step): zeros, as without splits.
        out = tl.where(total > 0.0, tl.sum(w[:, None] * acc, axis=0) / total, 0.0)
        tl.store(out_ptr + bh * HD + d, out.to(out_ptr.dtype.element_ty))


if AVAILABLE:

    @triton.jit
    def _tile_block(start, hi, row, pos, q, m_i, l_i, acc, keys, values, k_scales, v_scales,
                    table, table_stride, kvh, d, n, scale, PAGE: tl.constexpr,
                    KVH: tl.constexpr, HD: tl.constexpr, PRECISION: tl.constexpr,
                    SCALED: tl.constexpr):  # fmt: skip
        """One block of keys for a tile's queries (causal) into their online softmax."""
        kpos = start + n
        valid_n = kpos < hi
        page = tl.load(table + row * table_stride + kpos // PAGE, mask=valid_n, other=0)
        slot = (page.to(tl.int64) * PAGE + kpos % PAGE) * KVH + kvh
        base = slot * HD
        k = tl.load(keys + base[:, None] + d[None, :], mask=valid_n[:, None], other=0.0)
        if SCALED:  # 8-bit elements are exact in the queries' 16- or 32-bit type
            k = k.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if SCALED:
            s = s * tl.load(k_scales + slot, mask=valid_n, other=0.0)[None, :]
        s = tl.where(kpos[None, :] <= pos[:, None], s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Rows with nothing visible yet keep -inf: guard the exponent against inf - inf.
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        v = tl.load(values + base[:, None] + d[None, :], mask=valid_n[:, None], other=0.0)
        pw = p
        if SCALED:
            pw = p * tl.load(v_scales + slot, mask=valid_n, other=0.0)[None, :]
            v = v.to(q.dtype)
        pv = tl.dot(pw.to(v.dtype), v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        l_i = l_i * alpha + tl.sum(p, axis=1)
        return m_new, l_i, acc

    @triton.jit
    def _paged_tile_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        ks_ptr,
        vs_ptr,
        out_ptr,
        m_ptr,
        l_ptr,
        acc_ptr,
        table_ptr,
        rows_ptr,
        pos_ptr,
        tiles_ptr,
        scale,
        table_stride,
        rows_stride,
        pos_stride,
        n_heads,
        kv_group,
        PAGE: tl.constexpr,
        KVH: tl.constexpr,
        HD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLITS: tl.constexpr,
        STATIC_MAX: tl.constexpr,  # as `_paged_decode_kernel`'s
        PRECISION: tl.constexpr,  # of fp32 dots: "ieee" for fp32 models (no TF32 rounding)
        SCALED: tl.constexpr = False,  # as `_paged_decode_kernel`'s
        PDL: tl.constexpr = False,
    ):
        """Attention of one tile (up to BLOCK_M consecutive query tokens of one row) for one
        head: each query sees its row's positions up to its own (causal), read in place from
        the pages; every key block is loaded once for the whole tile. With SPLITS > 1 each
        program covers one share of the positions and writes online-softmax partials for
        `_combine_kernel` (few tiles alone would leave most of the GPU idle)."""
        if PDL:  # launched early (launch_overlap.py): wait for the predecessor first
            gdc_wait()
            gdc_launch_dependents()
        tile = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        kvh = h // kv_group
        first = tl.load(tiles_ptr + 2 * tile)
        count = tl.load(tiles_ptr + 2 * tile + 1)
        m = tl.arange(0, BLOCK_M)
        valid_m = m < count
        tok = first + m
        row = tl.load(rows_ptr + first * rows_stride, mask=count > 0, other=0)
        pos = tl.load(pos_ptr + tok * pos_stride, mask=valid_m, other=-1)
        hi = tl.max(pos, axis=0) + 1  # 0 for an empty tile: the loop below does nothing
        chunk = tl.cdiv(tl.cdiv(hi, SPLITS), BLOCK_N) * BLOCK_N
        lo = sp * chunk
        d = tl.arange(0, HD)
        q = tl.load(
            q_ptr + (tok[:, None] * n_heads + h) * HD + d[None, :], mask=valid_m[:, None], other=0.0
        )
        m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HD], tl.float32)
        n = tl.arange(0, BLOCK_N)
        live = tl.minimum(chunk, hi - lo)  # this split's live positions (device-read)
        if STATIC_MAX > 0:  # as the decode kernel's loop
            for i in tl.range(0, STATIC_MAX, BLOCK_N):
                if i < live:
                    m_i, l_i, acc = _tile_block(
                        lo + i, hi, row, pos, q, m_i, l_i, acc, k_ptr, v_ptr, ks_ptr, vs_ptr,
                        table_ptr, table_stride, kvh, d, n, scale, PAGE, KVH, HD, PRECISION,
                        SCALED,
                    )  # fmt: skip
        else:
            for i in tl.range(0, live, BLOCK_N):
                m_i, l_i, acc = _tile_block(
                    lo + i, hi, row, pos, q, m_i, l_i, acc, k_ptr, v_ptr, ks_ptr, vs_ptr,
                    table_ptr, table_stride, kvh, d, n, scale, PAGE, KVH, HD, PRECISION,
                    SCALED,
                )  # fmt: skip
        if SPLITS == 1:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(
                out_ptr + (tok[:, None] * n_heads + h) * HD + d[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=valid_m[:, None],
            )
        else:
            part = (tok * n_heads + h) * SPLITS + sp
            tl.store(m_ptr + part, m_i, mask=valid_m)
            tl.store(l_ptr + part, l_i, mask=valid_m)
            tl.store(acc_ptr + part[:, None] * HD + d[None, :], acc, mask=valid_m[:, None])


def paged_tile_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    tiles: torch.Tensor,
    block_m: int,
    block_n: int = 64,
    splits: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen paged attention of a mixed step: q [T, H, hd] -> out [T, H, hd]. Token t belongs
    to block-table row ``rows[t]`` at ``positions[t]`` and sees that row's positions up to its
    own. ``tiles`` [n_tiles, 2] lists (first token, token count <= block_m) of runs of
    consecutive tokens of one row; tiles with count 0 do nothing (padding). Small steps split
    each tile's positions over ``splits`` programs (default: `tile_splits`) and merge them.
    Shapes never depend on host values, so the call can be graph-captured."""
    if not AVAILABLE:
        raise RuntimeError("Triton is not installed")
    t, n_heads, hd = q.shape
    _, page, kvh, _ = k_pool.shape
    splits = splits or tile_splits(t)
    static_max = static_loop_bound(block_table.shape[1] * page, splits, block_n)
    if splits == 1:
        out = torch.zeros_like(q)  # tokens in no tile (padding) read as zeros
        m = l_sum = acc = out  # unused
    else:
        out = torch.empty_like(q)
        # Tokens in no tile keep these: the merge gives them zeros.
        m = torch.full((t, n_heads, splits), -float("inf"), dtype=torch.float32, device=q.device)
        l_sum = torch.zeros_like(m)
        acc = torch.zeros((t, n_heads, splits, hd), dtype=torch.float32, device=q.device)
    _paged_tile_kernel[(tiles.shape[0], n_heads, splits)](
        q,
        k_pool,
        v_pool,
        *_scales(k_pool, k_scale, v_scale),
        out,
        m,
        l_sum,
        acc,
        block_table,
        rows,
        positions,
        tiles,
        hd**-0.5,
        block_table.stride(0),
        rows.stride(0),
        positions.stride(0),
        n_heads,
        n_heads // kvh,
        PAGE=page,
        KVH=kvh,
        HD=hd,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        SPLITS=splits,
        STATIC_MAX=static_max,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SCALED=k_scale is not None,
        **launch_overlap.kernel_args(),
    )
    if splits > 1:
        _combine_kernel[(t * n_heads,)](
            m, l_sum, acc, out, SPLITS=splits, HD=hd, **launch_overlap.kernel_args()
        )
    return out


def _scales(
    k_pool: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale pointers of a launch: a compact pool's (both needed), else the pool itself
    (never read: SCALED is off)."""
    if compact(k_pool.dtype) != (k_scale is not None and v_scale is not None):
        raise ValueError(f"{k_pool.dtype} KV pages need scales exactly when compact")
    if k_scale is None or v_scale is None:
        return k_pool, k_pool
    return k_scale, v_scale


# Splits covering at most this many positions each loop to a bound known at compile time (a
# branch per block; moondream2's 2048-position context: decode 2.736 ms at 32 streams against
# 2.802 with device-read bounds); longer ones loop over their live blocks only (Moondream 3's
# 32K: 5.119 -> 4.476 ms at 32 streams). H100.
STATIC_LOOP_POSITIONS = 512


def static_loop_bound(max_positions: int, splits: int, block_n: int) -> int:
    """The positions one split can cover, as a compile-time loop bound, or 0 (a bound read on
    the device) where that exceeds `STATIC_LOOP_POSITIONS`."""
    per_split = -(-max_positions // splits)
    bound = -(-per_split // block_n) * block_n
    return bound if bound <= STATIC_LOOP_POSITIONS else 0


# Mixed steps of at most this many (padded) tokens attend one token at a time through the
# decode kernel instead of in tiles (`per_token_attention`). 16 decode rows at 800 positions
# on an H100 (python -m bench.mixed_overhead) with a 5-token prompt beside them (24 tokens):
# 2.549 ms one by one against 2.709 in tiles; at 32 tokens the tiles win (2.898 / 2.996).
PER_TOKEN_MAX_TOKENS = 24


def per_token_attention(n_tokens: int) -> bool:
    """Whether a mixed step of ``n_tokens`` (padded, static per graph) attends each token as
    a decode row: a small step is mostly decode rows, for which the decode kernel's programs
    cost less than one-token tiles (no merge buffers to fill, no 16-row query tiles), and a
    prompt token needs only its row's positions up to its own, as a decode row does."""
    return n_tokens <= PER_TOKEN_MAX_TOKENS


def tile_splits(n_tokens: int, target: int = 512) -> int:
    """Splits of a mixed step's tiles over its positions, from its (static) token count: a
    small step (one prompt beside a few decode rows) has few tiles, a large one enough."""
    splits = 1
    while splits < 8 and n_tokens * splits < target:
        splits *= 2
    return splits


def split_count(batch: int, heads: int, target_programs: int = 4096) -> int:
    """Splits per (row, head) so a step has enough programs to fill the GPU (a power of 2)."""
    splits = 1
    while splits < 16 and batch * heads * splits < target_programs:
        splits *= 2
    return splits


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    rows: torch.Tensor,
    lengths: torch.Tensor,
    block_n: int = 64,
    splits: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, H, hd] -> out [B, H, hd]; row b attends to positions [0, lengths[b]) of
    ``block_table[rows[b]]`` in the pools [n_pages, page_size, kv_heads, hd]. Each (row,
    head) is split over ``splits`` programs (flash-decoding) and the partials merged."""
    if not AVAILABLE:
        raise RuntimeError("Triton is not installed")
    b, n_heads, hd = q.shape
    _, page, kvh, _ = k_pool.shape
    splits = splits or split_count(b, n_heads)
    static_max = static_loop_bound(block_table.shape[1] * page, splits, block_n)
    m = torch.empty((b, n_heads, splits), dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    acc = torch.empty((b, n_heads, splits, hd), dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(b, n_heads, splits)](
        q,
        k_pool,
        v_pool,
        *_scales(k_pool, k_scale, v_scale),
        m,
        l_sum,
        acc,
        block_table,
        rows,
        lengths,
        hd**-0.5,
        block_table.stride(0),
        rows.stride(0),
        n_heads,
        n_heads // kvh,
        PAGE=page,
        KVH=kvh,
        HD=hd,
        BLOCK_N=block_n,
        SPLITS=splits,
        STATIC_MAX=static_max,
        SCALED=k_scale is not None,
        **launch_overlap.kernel_args(),
    )
    out = torch.empty_like(q)
    _combine_kernel[(b * n_heads,)](
        m, l_sum, acc, out, SPLITS=splits, HD=hd, **launch_overlap.kernel_args()
    )
    return out
