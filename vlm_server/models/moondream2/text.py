"""Phi-style text decoder with a pluggable KV cache.

The decoder returns the raw residual stream (before ``post_ln``): the region heads read that,
and `TextDecoder.logits` applies the final norm and the untied ``lm_head`` on top.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlm_server.models.common.fused_norm import add_layernorm
from vlm_server.models.common.layers import MLP, LayerNorm
from vlm_server.models.common.rotary import apply_rotary, rotary_tables
from vlm_server.models.kv import KVCache
from vlm_server.models.moondream2.config import TextConfig


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
