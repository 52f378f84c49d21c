"""Batched sampling with counter-based randomness: no generator state, no host sync.

Each row's draw depends only on its own logits, seed and step: its uniform is a hash of
(seed, step), so the same request gives the same tokens whatever batch it runs in, in any order.
The hash is integer arithmetic, bit-identical on CPU and CUDA (float rounding of the softmax may
still differ between devices, which can flip a draw that sits exactly on a boundary).

Per row: temperature 0 -> argmax. Otherwise p = softmax(logits / T); top-p as in the reference
(sort descending, stably, drop tokens where cumsum - p_i > top_p, the top-1 always kept), then
inverse-CDF sampling over the kept prefix: the first sorted position whose cumulative
probability exceeds u * (kept mass). Only kept tokens of non-zero probability can be chosen,
so masked logits (-inf) never are. One uniform per row instead of one per token keeps the
device work to a sort, a cumsum and a search (no vocab-wide hashing).

The hash is murmur3's 32-bit finalizer computed in int64 lanes: every value stays below 2^32
and each multiply is split in 16-bit halves, so no product overflows a signed 64-bit integer.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_C1 = 0x85EBCA6B
_C2 = 0xC2B2AE35
_GOLDEN = 0x9E3779B9


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for 0 <= x < 2^32, without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, _C1)
    h = h ^ (h >> 13)
    h = _mul32(h, _C2)
    return h ^ (h >> 16)


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """32-bit key per row from (seed, step), both int64 [B] (any sign, all 64 bits used)."""
    seeds, steps = seeds.to(torch.int64), steps.to(torch.int64)
    h = _fmix32((seeds & _M32) ^ _GOLDEN)
    h = _fmix32(h ^ ((seeds >> 32) & _M32))
    h = _fmix32(h ^ (steps & _M32))
    return _fmix32(h ^ ((steps >> 32) & _M32))


def row_uniforms(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Uniform float32 in (0, 1) per row from (seed, step)."""
    h = row_keys(seeds, steps)
    # 23 bits + 1/2: every value and 1 - value is exact in float32, so u is never 0 or 1.
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
) -> torch.Tensor:
    """Sample one token id per row: logits [B, V] float (masked entries -inf),
    temperature / top_p [B] float, seeds / steps [B] int64 -> ids [B] int64."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    hot = temperature > 0
    safe_t = torch.where(hot, temperature.float(), torch.ones_like(temperature, dtype=torch.float))
    probs = torch.softmax(logits / safe_t.unsqueeze(1), dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    cum = sorted_p.cumsum(dim=-1)
    # Kept tokens form a prefix of the sorted order (cum - p is non-decreasing, p > 0 too).
    keep = ((cum - sorted_p) <= top_p.float().unsqueeze(1)) & (sorted_p > 0)
    n_kept = keep.sum(dim=-1, keepdim=True).clamp_min(1)
    kept_mass = cum.gather(1, n_kept - 1)
    target = row_uniforms(seeds, steps).unsqueeze(1) * kept_mass
    pick = torch.searchsorted(cum, target, right=True)
    # Rounding can put the target on the last kept boundary: stay inside the kept prefix.
    pick = torch.minimum(pick, n_kept - 1)
    drawn = order.gather(1, pick).squeeze(1)
    return torch.where(hot, drawn, greedy)
