"""Phi-style text decoder with a pluggable KV cache.

The decoder returns the raw residual stream (before ``post_ln``): the region heads read that,
and `TextDecoder.logits` applies the final norm and the untied ``lm_head`` on top.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from vlm_server.config import TextConfig
from vlm_server.model.fused_norm import add_layernorm
from vlm_server.model.layers import MLP, LayerNorm
from vlm_server.model.rotary import apply_rotary, rotary_tables


class KVCache(Protocol):
    """Storage for keys (after rotary) and values, one pair per layer."""

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Store k, v [B, kv_heads, T, hd] at ``positions`` [B, T]; return attention of q over
        everything this sequence may see, [B, heads, T, hd]."""
        ...


def allowed_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """Boolean attention mask (True = attend): causal, except that positions inside the prefix
    (BOS + image) see each other bidirectionally. q_pos [B, T], k_pos [K] -> [B, 1, T, K]."""
    q = q_pos[:, None, :, None]
    k = k_pos[None, None, None, :]
    return (k <= q) | ((q < prefix_len) & (k < prefix_len))


class DenseKVCache:
    """Contiguous per-layer cache [B, kv_heads, max_context, hd]; the reference path uses it."""

    def __init__(
        self,
        cfg: TextConfig,
        batch: int,
        dtype: torch.dtype,
        device: torch.device | str,
        prefix_len: int,
    ) -> None:
        shape = (batch, cfg.n_kv_heads, cfg.max_context, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.prefix_len = prefix_len
        self.max_context = cfg.max_context

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        b = torch.arange(q.shape[0], device=q.device)[:, None]
        self.k[layer][b, :, positions] = k.transpose(1, 2)
        self.v[layer][b, :, positions] = v.transpose(1, 2)
        # Only the slots up to the furthest position can be visible: attend over that window.
        length = int(positions.max()) + 1
        k_all, v_all = self.k[layer][:, :, :length], self.v[layer][:, :, :length]
        k_pos = torch.arange(length, device=q.device)
        mask = allowed_mask(positions, k_pos, self.prefix_len)
        rep = q.shape[1] // k_all.shape[1]
        if rep > 1:
            k_all, v_all = k_all.repeat_interleave(rep, 1), v_all.repeat_interleave(rep, 1)
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)


class TextAttention(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.qkv = nn.Linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * hd)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def project_qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, D] -> q [B, H, T, hd], k and v [B, KVH, T, hd]; rotary applied to q and k."""
        b, t, _ = x.shape
        cfg = self.cfg
        hd = cfg.head_dim
        q, k, v = self.qkv(x).split(
            [cfg.n_heads * hd, cfg.n_kv_heads * hd, cfg.n_kv_heads * hd], dim=-1
        )
        q = q.view(b, t, cfg.n_heads, hd).transpose(1, 2)
        k = k.view(b, t, cfg.n_kv_heads, hd).transpose(1, 2)
        v = v.view(b, t, cfg.n_kv_heads, hd).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        layer: int,
    ) -> torch.Tensor:
        # A cache may fuse rotary, the KV write and attention over the raw projection.
        packed = getattr(cache, "attend_packed", None)
        if packed is not None:
            out = packed(layer, self.qkv(x), positions)
        else:
            q, k, v = self.project_qkv(x, cos, sin)
            out = cache.attend(layer, q, k, v, positions)
        b, _, t, _ = out.shape
        return self.proj(out.transpose(1, 2).reshape(b, t, -1))


class TextBlock(nn.Module):
    """Parallel block: x + attn(LN(x)) + mlp(LN(x)), one shared LayerNorm."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.ln = LayerNorm(cfg.dim)
        self.attn = TextAttention(cfg)
        self.mlp = MLP(cfg.dim, cfg.ff_dim)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        layer: int,
    ) -> torch.Tensor:
        h = self.ln(x)
        return x + self.attn(h, cos, sin, positions, cache, layer) + self.mlp(h)


class TextDecoder(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.dim))
        self.blocks = nn.ModuleList(TextBlock(cfg) for _ in range(cfg.n_layers))
        self.post_ln = LayerNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size)
        self.reset_rotary(None)

    def reset_rotary(self, device: torch.device | str | None) -> None:
        """(Re)build the fp32 rotary tables, e.g. after loading onto a device from meta."""
        cos, sin = rotary_tables(
            self.cfg.rotary_dim, self.cfg.max_context, self.cfg.rope_theta, device=device
        )
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.wte)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Input embeddings x [B, T, D] at positions [B, T] -> hidden [B, T, D] before post_ln."""
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        blocks = self.blocks
        h = blocks[0].ln(x)
        # Each block's forward, with its residual adds fused into the next block's norm.
        for i, block in enumerate(blocks):
            a, m = block.attn(h, cos, sin, positions, cache, i), block.mlp(h)
            if i + 1 < len(blocks):
                x, h = add_layernorm(x, a, m, blocks[i + 1].ln)
            else:
                x = x + a + m
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and untied head; computed in fp32 for stable sampling."""
        return self.lm_head(self.post_ln(hidden)).float()
