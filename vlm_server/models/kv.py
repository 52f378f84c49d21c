"""KV-cache contract between a family's decoder and the engine, and the reference's dense cache.

A decoder layer hands its keys and values to a `KVCache` and gets attention back; the engine
passes paged caches (engine/device/kernels), the reference generation a `DenseKVCache`. The
attention rule is the same for every family: causal, except that the image prefix (BOS +
image) sees itself both ways.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from vlm_server.models.interface import KVShape

# ``attend_packed(layer, qkv, positions)``: rotary, the KV write and attention fused over the
# raw projection [B, T, (H + 2 KVH) hd] -> [B, H, T, hd].
PackedAttend = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


class KVCache(Protocol):
    """Storage for keys (after rotary) and values, one pair per layer."""

    @property
    def attend_packed(self) -> PackedAttend | None:
        """The cache's fused path over the raw projection, or None where it has none (then
        the decoder splits heads, applies rotary and calls `attend`)."""
        ...

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

    attend_packed: PackedAttend | None = None  # the reference's arithmetic only

    def __init__(
        self,
        kv: KVShape,
        max_context: int,
        batch: int,
        dtype: torch.dtype,
        device: torch.device | str,
        prefix_len: int,
    ) -> None:
        shape = (batch, kv.n_kv_heads, max_context, kv.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(kv.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(kv.n_layers)]
        self.prefix_len = prefix_len
        self.max_context = max_context

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
