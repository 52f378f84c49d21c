"""The decoder attention both Moondream families run over a packed Q | K | V projection:
multi-head (grouped when there are fewer KV heads), half-split partial rotary, through the
`KVCache` (models/kv.py)."""

from __future__ import annotations

import torch

from vlm_server.models.common.rotary import apply_rotary
from vlm_server.models.kv import KVCache


def split_heads(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed projection [B, T, (H + 2 KVH) hd] -> q [B, H, T, hd], k and v
    [B, KVH, T, hd]; rotary (``cos``, ``sin`` gathered at the positions) applied to q and k."""
    b, t, _ = qkv.shape
    hd = head_dim
    q, k, v = qkv.split([n_heads * hd, n_kv_heads * hd, n_kv_heads * hd], dim=-1)
    q = q.view(b, t, n_heads, hd).transpose(1, 2)
    k = k.view(b, t, n_kv_heads, hd).transpose(1, 2)
    v = v.view(b, t, n_kv_heads, hd).transpose(1, 2)
    cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


def attend(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    cache: KVCache,
    layer: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """The packed projection [B, T, (H + 2 KVH) hd] -> attention output [B, T, H hd] (the
    output projection's input), keys and values written to ``cache``."""
    packed = cache.attend_packed  # rotary, the KV write and attention fused, where offered
    if packed is not None:
        out = packed(layer, qkv, positions)
    else:
        q, k, v = split_heads(qkv, cos, sin, n_heads, n_kv_heads, head_dim)
        out = cache.attend(layer, q, k, v, positions)
    b, _, t, _ = out.shape
    return out.transpose(1, 2).reshape(b, t, -1)
