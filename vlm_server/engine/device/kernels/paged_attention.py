"""Paged KV storage and attention in plain PyTorch (any device; the CPU path of the engine).

Pools are per layer, [n_pages, page_size, kv_heads, head_dim]; a sequence's block row lists
its pages in position order, so position p lives at (row[p // page_size], p % page_size).
Compact pools (``--kv-dtype fp8|int8``) come with scales [n_pages, page_size, kv_heads] per
layer (``scales``: the keys' and the values' lists): writes store `quantize_kv` of the keys
and values, reads attend over `dequantize_kv` of what was stored, everywhere (also where a
forward attends over the keys it just computed), so every path reads the values the pages hold.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vlm_server.models.kv import PackedAttend, allowed_mask, dequantize_kv, quantize_kv

# A compact cache's scales: every layer's, of the keys and of the values (None: exact pages).
Scales = tuple[list[torch.Tensor], list[torch.Tensor]] | None


def store(
    pool: torch.Tensor, scale: torch.Tensor | None, index: tuple[torch.Tensor, ...], x: torch.Tensor
) -> None:
    """``pool[index] = x`` [..., kv_heads, hd], quantized (scales into ``scale[index]``) when
    ``scale`` is given."""
    if scale is None:
        pool[index] = x.to(pool.dtype)
        return
    q, s = quantize_kv(x, pool.dtype)
    pool[index] = q
    scale[index] = s


def gather(
    pool: torch.Tensor, scale: torch.Tensor | None, index: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``pool[index]`` as attention reads it: dequantized into ``dtype`` when ``scale`` is
    given, else as stored."""
    if scale is None:
        return pool[index]
    return dequantize_kv(pool[index], scale[index], dtype)


def as_stored(x: torch.Tensor, pool: torch.Tensor, compact: bool) -> torch.Tensor:
    """``x`` as the pages hold it once written, in ``x``'s dtype when ``compact`` (the values
    attention reads back), else in the pool's."""
    if not compact:
        return x.to(pool.dtype)
    return dequantize_kv(*quantize_kv(x, pool.dtype), x.dtype)


def layer_scales(scales: Scales, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One layer's (key, value) scales, or (None, None) for exact pages."""
    return (None, None) if scales is None else (scales[0][layer], scales[1][layer])


def write_kv(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_rows: torch.Tensor,
    positions: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store k, v [B, kv_heads, T, hd] at positions [B, T] through block_rows [B, n_blocks]."""
    ps = k_pool.shape[1]
    pages = block_rows.gather(1, positions // ps)  # [B, T]
    offsets = positions % ps
    store(k_pool, k_scale, (pages, offsets), k.transpose(1, 2))
    store(v_pool, v_scale, (pages, offsets), v.transpose(1, 2))


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_rows: torch.Tensor,
    positions: torch.Tensor,
    prefix_len: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [B, H, T, hd] at positions [B, T] over the pages of block_rows
    [B, n_blocks] (which must cover every visible position). Causal, except that positions
    below ``prefix_len`` see each other both ways."""
    b, n_blocks = block_rows.shape
    ps, kvh, hd = k_pool.shape[1:]
    keys = gather(k_pool, k_scale, block_rows, q.dtype)
    values = gather(v_pool, v_scale, block_rows, q.dtype)
    keys = keys.reshape(b, n_blocks * ps, kvh, hd).transpose(1, 2)
    values = values.reshape(b, n_blocks * ps, kvh, hd).transpose(1, 2)
    rep = q.shape[1] // kvh
    if rep > 1:
        keys, values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
    k_pos = torch.arange(n_blocks * ps, device=q.device)
    mask = allowed_mask(positions, k_pos, prefix_len)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


class PagedKV:
    """The `KVCache` the text decoder sees during one engine forward."""

    attend_packed: PackedAttend | None = None

    def __init__(
        self,
        k_pools: list[torch.Tensor],
        v_pools: list[torch.Tensor],
        block_rows: torch.Tensor,
        prefix_len: int,
        fresh_prefix: bool = False,
        scales: Scales = None,
    ) -> None:
        self.k_pools, self.v_pools = k_pools, v_pools
        self.scales = scales
        self.block_rows = block_rows
        self.prefix_len = prefix_len
        # The forward is exactly the bidirectional prefix [0, prefix_len) of each row: keys
        # and values are the ones just computed, and no mask applies.
        self.fresh_prefix = fresh_prefix

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        kp, vp = self.k_pools[layer], self.v_pools[layer]
        ks, vs = layer_scales(self.scales, layer)
        write_kv(kp, vp, self.block_rows, positions, k, v, ks, vs)
        if self.fresh_prefix:
            k, v = as_stored(k, kp, ks is not None), as_stored(v, vp, vs is not None)
            rep = q.shape[1] // k.shape[1]
            if rep > 1:
                k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            return F.scaled_dot_product_attention(q, k, v)
        return paged_attention(q, kp, vp, self.block_rows, positions, self.prefix_len, ks, vs)


class PrefixKV:
    """The `KVCache` of a BOS + image forward on CUDA: the Triton rotary kernel rotates q and
    k and writes the keys and values straight into the prefix's pages (``pages`` [images,
    pages per prefix], token t of the flattened batch in image ``image_of_token[t]``), then
    dense attention over the prefix, which sees itself both ways (no mask)."""

    def __init__(
        self,
        k_pools: list[torch.Tensor],
        v_pools: list[torch.Tensor],
        pages: torch.Tensor,
        image_of_token: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        n_heads: int,
        scales: Scales = None,
    ) -> None:
        self.k_pools, self.v_pools = k_pools, v_pools
        self.scales = scales
        self.pages = pages
        self.image_of_token = image_of_token
        self.rope = rope
        self.n_heads = n_heads

    def attend_packed(self, layer: int, qkv: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        from vlm_server.engine.device.kernels.triton_kv_store import rope_and_store_kv

        kp, vp = self.k_pools[layer], self.v_pools[layer]
        ks, vs = layer_scales(self.scales, layer)
        images, length = positions.shape
        kvh, hd = kp.shape[2], kp.shape[3]
        flat = qkv.reshape(images * length, -1)
        # The keys (and, compact, the values) as the pages hold them, in the activations' dtype
        # when compact: the prefix attends over what it stored.
        dtype = kp.dtype if ks is None else qkv.dtype
        keys = torch.empty((images * length, kvh, hd), dtype=dtype, device=qkv.device)
        values = None if vs is None else torch.empty_like(keys)
        q = rope_and_store_kv(
            flat,
            self.rope[0],
            self.rope[1],
            positions.reshape(-1, 1),
            self.pages,
            self.image_of_token[: images * length],
            kp,
            vp,
            self.n_heads,
            k_out=keys,
            v_out=values,
            k_scale=ks,
            v_scale=vs,
        )
        q = q.view(images, length, self.n_heads, hd).transpose(1, 2)
        k = keys.view(images, length, kvh, hd).transpose(1, 2)
        if values is None:
            values = flat[:, (self.n_heads + kvh) * hd :].to(kp.dtype)
        v = values.view(images, length, kvh, hd).transpose(1, 2)
        rep = self.n_heads // kvh
        if rep > 1:
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        return F.scaled_dot_product_attention(q, k, v)

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        raise NotImplementedError("PrefixKV runs through attend_packed only")


class PrefixPromptKV:
    """The `KVCache` of a BOS + image forward that carries prompts (core/prefix_jobs.py), over
    [1, T] tokens: the first ``images * length`` are the prefixes, flattened (token t in
    image ``image_of_token[t]``), the rest prompt tokens of prefix ``prompt_rows[t]`` at
    ``prompt_pos[t]``; ``pages`` [rows, n] maps each prefix's (and its prompt's) positions to
    pages. Every key and value is written first, then each prefix attends to itself both ways
    and each prompt token causally over its prefix and its prompt so far.

    On CUDA (``tiles`` given, see core/mixed_inputs.py) the Triton kernels do the writes and the
    prompts' attention, reading the pages in place; elsewhere plain PyTorch."""

    def __init__(
        self,
        k_pools: list[torch.Tensor],
        v_pools: list[torch.Tensor],
        pages: torch.Tensor,
        images: int,
        length: int,
        image_of_token: torch.Tensor,
        prompt_rows: torch.Tensor,
        prompt_pos: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        n_heads: int,
        tiles: torch.Tensor | None = None,
        tile_tokens: int = 16,
        scales: Scales = None,
    ) -> None:
        self.k_pools, self.v_pools = k_pools, v_pools
        self.scales = scales
        self.pages = pages
        self.images, self.length = images, length
        self.image_of_token = image_of_token[: images * length]
        self.prompt_rows, self.prompt_pos = prompt_rows, prompt_pos
        self.rope = rope
        self.n_heads = n_heads
        self.tiles = tiles
        self.tile_tokens = tile_tokens
        self.attend_packed = self._attend_packed if tiles is not None else None

    def _prefix_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [P, H, hd], k and v [P, KVH, hd] of the flattened prefixes -> [P, H, hd]."""
        n, length = self.images, self.length
        q, k, v = (t.reshape(n, length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = F.scaled_dot_product_attention(q, k, v)
        return out.transpose(1, 2).reshape(n * length, q.shape[1], q.shape[3])

    def _attend_packed(
        self, layer: int, qkv: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        from vlm_server.engine.device.kernels.triton_attention import paged_tile_attention
        from vlm_server.engine.device.kernels.triton_kv_store import rope_and_store_kv

        kp, vp = self.k_pools[layer], self.v_pools[layer]
        ks, vs = layer_scales(self.scales, layer)
        kvh, hd = kp.shape[2], kp.shape[3]
        flat, pos = qkv[0], positions[0]
        n = self.images * self.length
        dtype = kp.dtype if ks is None else qkv.dtype  # as `PrefixKV`'s
        keys = torch.empty((n, kvh, hd), dtype=dtype, device=qkv.device)
        v_pre = None if vs is None else torch.empty_like(keys)
        cos, sin = self.rope
        q_pre = rope_and_store_kv(
            flat[:n], cos, sin, pos[:n, None], self.pages, self.image_of_token, kp, vp,
            self.n_heads, k_out=keys, v_out=v_pre, k_scale=ks, v_scale=vs,
        )  # fmt: skip
        q_pro = rope_and_store_kv(
            flat[n:], cos, sin, pos[n:, None], self.pages, self.prompt_rows, kp, vp, self.n_heads,
            k_scale=ks, v_scale=vs,
        )  # fmt: skip
        if v_pre is None:
            v_pre = flat[:n, (self.n_heads + kvh) * hd :].view(n, kvh, hd).to(kp.dtype)
        prompt = paged_tile_attention(
            q_pro, kp, vp, self.pages, self.prompt_rows, self.prompt_pos, self.tiles,
            self.tile_tokens, k_scale=ks, v_scale=vs,
        )  # fmt: skip
        out = torch.cat([self._prefix_attention(q_pre, keys, v_pre), prompt])
        return out.transpose(0, 1)[None]

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        kp, vp = self.k_pools[layer], self.v_pools[layer]
        ks, vs = layer_scales(self.scales, layer)
        ps = kp.shape[1]
        pos = positions[0]
        n = self.images * self.length
        rows = torch.cat([self.image_of_token, self.prompt_rows])
        pages = self.pages[rows, pos // ps].long()
        q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))  # [T, heads, hd]
        store(kp, ks, (pages, pos % ps), k)
        store(vp, vs, (pages, pos % ps), v)
        prompt = ragged_paged_attention(
            q[n:], kp, vp, self.pages, self.prompt_rows, pos[n:], self.pages.shape[1],
            k_scale=ks, v_scale=vs,
        )  # fmt: skip
        k_pre, v_pre = as_stored(k[:n], kp, ks is not None), as_stored(v[:n], vp, vs is not None)
        prefix = self._prefix_attention(q[:n], k_pre, v_pre)
        out = torch.cat([prefix.to(q.dtype), prompt.to(q.dtype)])
        return out.transpose(0, 1)[None]


class DecodeKV:
    """The `KVCache` of a decode step: one new position per row, rows read from the block
    table on the device. On CUDA two Triton kernels per layer do the work (rotary + KV write,
    then attention over live pages only); shapes never depend on host values, so the step can
    be graph-captured. Elsewhere: plain PyTorch over the first ``n_blocks`` pages.

    A mixed step on CUDA uses it too, one "row" per token: with ``tiles`` (see
    core/mixed_inputs.py) attention runs per tile of a row's consecutive tokens, so a prompt
    chunk loads each key block once for up to ``tile_tokens`` queries; a small step's tokens
    attend one by one through the decode kernel instead (`per_token_attention`)."""

    def __init__(
        self,
        k_pools: list[torch.Tensor],
        v_pools: list[torch.Tensor],
        block_table: torch.Tensor,
        rows: torch.Tensor,
        n_blocks: int,
        rope: tuple[torch.Tensor, torch.Tensor],
        n_heads: int,
        use_triton: bool,
        tiles: torch.Tensor | None = None,
        tile_tokens: int = 16,
        scales: Scales = None,
    ) -> None:
        self.k_pools, self.v_pools = k_pools, v_pools
        self.scales = scales
        self.block_table = block_table
        self.rows = rows
        self.n_blocks = n_blocks
        self.rope = rope
        self.n_heads = n_heads
        self.tiles = tiles
        self.tile_tokens = tile_tokens
        # The decoder takes the fused path when this attribute is not None.
        self.attend_packed = self._attend_packed if use_triton else None
        # Each row's attended length, computed by the first layer for all: one small kernel
        # per forward instead of one per layer.
        self._lengths: tuple[torch.Tensor, torch.Tensor] | None = None

    def _attend_packed(
        self, layer: int, qkv: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        from vlm_server.engine.device.kernels.triton_attention import (
            paged_decode_attention,
            paged_tile_attention,
            per_token_attention,
        )
        from vlm_server.engine.device.kernels.triton_kv_store import rope_and_store_kv

        kp, vp = self.k_pools[layer], self.v_pools[layer]
        ks, vs = layer_scales(self.scales, layer)
        q = rope_and_store_kv(
            qkv[:, 0],
            self.rope[0],
            self.rope[1],
            positions,
            self.block_table,
            self.rows,
            kp,
            vp,
            self.n_heads,
            k_scale=ks,
            v_scale=vs,
        )
        if self.tiles is not None and not per_token_attention(q.shape[0]):
            out = paged_tile_attention(
                q,
                kp,
                vp,
                self.block_table,
                self.rows,
                positions[:, 0],
                self.tiles,
                self.tile_tokens,
                k_scale=ks,
                v_scale=vs,
            )
        else:
            if self._lengths is None or self._lengths[0] is not positions:
                self._lengths = (positions, positions[:, 0] + 1)
            out = paged_decode_attention(
                q, kp, vp, self.block_table, self.rows, self._lengths[1], k_scale=ks, v_scale=vs
            )
        return out[:, :, None]

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        kp, vp = self.k_pools[layer], self.v_pools[layer]
        ks, vs = layer_scales(self.scales, layer)
        ps = kp.shape[1]
        pages = self.block_table[self.rows[:, None], positions // ps].long()  # [B, 1]
        offsets = positions % ps
        store(kp, ks, (pages, offsets), k.transpose(1, 2))
        store(vp, vs, (pages, offsets), v.transpose(1, 2))
        rows = self.block_table[self.rows, : self.n_blocks].long()
        return paged_attention(q, kp, vp, rows, positions, 0, ks, vs)


def ragged_paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    n_blocks: int,
    prefix_lens: torch.Tensor | None = None,
    query_block: int = 64,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen paged attention, the reference (and CPU path) of a mixed step's attention.

    Each query token t of q [T, H, hd] belongs to block-table row ``rows[t]`` at
    ``positions[t]`` and attends over that row's first ``n_blocks`` pages up to its own
    position: causal, except that a query inside its row's prefix (``prefix_lens[t]``, none
    when omitted) sees the whole prefix both ways. Returns [T, H, hd].

    Tokens are taken ``query_block`` at a time so the gathered keys stay
    [query_block, n_blocks * page_size] whatever the step's size; the loop runs over host-known
    sizes only (no device value is read).
    """
    t_total, h, hd = q.shape
    ps, kvh = k_pool.shape[1], k_pool.shape[2]
    rep = h // kvh
    k_pos = torch.arange(n_blocks * ps, device=q.device)
    outs = []
    for lo in range(0, t_total, query_block):
        hi = min(lo + query_block, t_total)
        pages = block_table[rows[lo:hi], :n_blocks].long()  # [t, n_blocks]
        t = hi - lo
        keys = gather(k_pool, k_scale, pages, q.dtype)
        values = gather(v_pool, v_scale, pages, q.dtype)
        keys = keys.reshape(t, n_blocks * ps, kvh, hd).transpose(1, 2)
        values = values.reshape(t, n_blocks * ps, kvh, hd).transpose(1, 2)
        if rep > 1:
            keys, values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
        pos = positions[lo:hi, None]
        mask = k_pos[None] <= pos  # [t, K]
        if prefix_lens is not None:
            plen = prefix_lens[lo:hi, None]
            mask = mask | ((pos < plen) & (k_pos[None] < plen))
        out = F.scaled_dot_product_attention(
            q[lo:hi, :, None].to(keys.dtype), keys, values, attn_mask=mask[:, None, None]
        )
        outs.append(out[:, :, 0])
    return torch.cat(outs) if outs else q.new_zeros(q.shape)


class RaggedKV:
    """The `KVCache` of a mixed step's forward over [1, T] tokens: token t writes its key and
    value at ``positions[t]`` of block-table row ``rows[t]`` and attends with
    `ragged_paged_attention` (every position in a mixed step is past its prefix: causal)."""

    attend_packed: PackedAttend | None = None

    def __init__(
        self,
        k_pools: list[torch.Tensor],
        v_pools: list[torch.Tensor],
        block_table: torch.Tensor,
        rows: torch.Tensor,
        n_blocks: int,
        scales: Scales = None,
    ) -> None:
        self.k_pools, self.v_pools = k_pools, v_pools
        self.scales = scales
        self.block_table = block_table
        self.rows = rows
        self.n_blocks = n_blocks

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        kp, vp = self.k_pools[layer], self.v_pools[layer]
        ks, vs = layer_scales(self.scales, layer)
        ps = kp.shape[1]
        pos = positions[0]  # [T]
        pages = self.block_table[self.rows, pos // ps].long()
        offsets = pos % ps
        store(kp, ks, (pages, offsets), k[0].transpose(0, 1))  # [T, kv_heads, hd]
        store(vp, vs, (pages, offsets), v[0].transpose(0, 1))
        out = ragged_paged_attention(
            q[0].transpose(0, 1), kp, vp, self.block_table, self.rows, pos, self.n_blocks,
            k_scale=ks, v_scale=vs,
        )  # fmt: skip
        return out.transpose(0, 1)[None]  # [1, H, T, hd]
