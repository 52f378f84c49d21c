"""KV-cache contract between a family's decoder and the engine, and the reference's dense cache.

A decoder layer hands its keys and values to a `KVCache` and gets attention back; the engine
passes paged caches (engine/device/kernels), the reference generation a `DenseKVCache`. The
attention rule is the same for every family: causal, except that the image prefix (BOS +
image) sees itself both ways.

Keys and values may be stored compact (``--kv-dtype fp8|int8``, docs/kv_cache.md): 8 bits an
element and one fp32 scale per (position, KV head), by `quantize_kv` here, the one rule the
engine's PyTorch paths, its Triton store kernel and the reference all follow; attention reads
`dequantize_kv` of what was stored, so engine and reference attend over the same values.
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


# Compact KV element types -> the largest magnitude a scaled element takes. One scale per
# (position, KV head) rather than per (page, head): a page fills one position at a time, so a
# page scale is not known when its first positions are written, and per position it costs 4
# bytes against head_dim (64+) elements. Measured on N(0, 1) vectors whose magnitudes vary 4x
# between positions (tests/test_kv_quant.py `test_the_scale_granularity_measured`): INT8
# relative RMS error 0.0059 per (position, head) against 0.0103 with an oracle (page, head)
# scale; FP8 e4m3 0.0250 against 0.0262 (floating point: the scale matters little).
KV_QMAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def kv_storage_dtype(fmt: str, activations: torch.dtype) -> torch.dtype:
    """The element type of KV pages in format ``fmt`` (``auto``: the activations')."""
    named = {
        "auto": activations,
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
        "fp32": torch.float32,
        "int8": torch.int8,
        "fp8": torch.float8_e4m3fn,
    }
    if fmt not in named:
        raise ValueError(f"kv_dtype: unknown KV format {fmt!r} (one of {', '.join(named)})")
    return named[fmt]


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (elements [..., head_dim] in ``dtype``, fp32 scales [...]): each
    vector scaled so its largest magnitude is the type's largest (an all-zero one: scale 1),
    INT8 rounded half to even, FP8 e4m3 rounded to nearest (both clamped first)."""
    qmax = KV_QMAX[dtype]
    xf = x.float()
    amax = xf.abs().amax(-1)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    y = (xf / scale[..., None]).clamp(-qmax, qmax)
    if dtype == torch.int8:
        y = y.round()
    return y.to(dtype), scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values `quantize_kv` stored, in ``dtype``."""
    return (q.float() * scale[..., None]).to(dtype)


def compact(dtype: torch.dtype) -> bool:
    """Whether KV pages of ``dtype`` carry scales."""
    return dtype in KV_QMAX


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
    """Contiguous per-layer cache [B, kv_heads, max_context, hd]; the reference path uses it.
    ``storage``: the KV pages' element type (None: ``dtype``); a compact one (`compact`)
    stores what `quantize_kv` gives and attends over `dequantize_kv` of it, as the engine."""

    attend_packed: PackedAttend | None = None  # the reference's arithmetic only

    def __init__(
        self,
        kv: KVShape,
        max_context: int,
        batch: int,
        dtype: torch.dtype,
        device: torch.device | str,
        prefix_len: int,
        storage: torch.dtype | None = None,
    ) -> None:
        self.dtype = dtype
        self.storage = storage or dtype
        shape = (batch, kv.n_kv_heads, max_context, kv.head_dim)
        self.k = [torch.zeros(shape, dtype=self.storage, device=device) for _ in range(kv.n_layers)]
        self.v = [torch.zeros(shape, dtype=self.storage, device=device) for _ in range(kv.n_layers)]
        self.scales: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        if compact(self.storage):
            self.scales = tuple(  # type: ignore[assignment]
                [torch.ones(shape[:3], device=device) for _ in range(kv.n_layers)] for _ in range(2)
            )
        self.prefix_len = prefix_len
        self.max_context = max_context

    def _store(
        self, layer: int, which: int, b: torch.Tensor, pos: torch.Tensor, x: torch.Tensor
    ) -> None:
        pool = (self.k, self.v)[which][layer]
        if self.scales is None:
            pool[b, :, pos] = x.transpose(1, 2).to(self.storage)
            return
        q, scale = quantize_kv(x.transpose(1, 2), self.storage)
        pool[b, :, pos] = q
        self.scales[which][layer][b, :, pos] = scale

    def _read(self, layer: int, which: int, length: int) -> torch.Tensor:
        pool = (self.k, self.v)[which][layer][:, :, :length]
        if self.scales is None:
            return pool.to(self.dtype)
        return dequantize_kv(pool, self.scales[which][layer][:, :, :length], self.dtype)

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        b = torch.arange(q.shape[0], device=q.device)[:, None]
        self._store(layer, 0, b, positions, k)
        self._store(layer, 1, b, positions, v)
        # Only the slots up to the furthest position can be visible: attend over that window.
        length = int(positions.max()) + 1
        k_all, v_all = self._read(layer, 0, length), self._read(layer, 1, length)
        k_pos = torch.arange(length, device=q.device)
        mask = allowed_mask(positions, k_pos, self.prefix_len)
        rep = q.shape[1] // k_all.shape[1]
        if rep > 1:
            k_all, v_all = k_all.repeat_interleave(rep, 1), v_all.repeat_interleave(rep, 1)
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)
