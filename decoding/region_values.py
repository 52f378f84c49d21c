"""Region value decoding: coordinate and size bins to normalized floats (device-side, batched)."""

from __future__ import annotations

import torch

COORD_BINS = 1024
SIZE_BINS = 1024


def coord_from_logits(logits: torch.Tensor, divisor: int = COORD_BINS) -> torch.Tensor:
    """Coordinate logits [..., 1024] -> value bin / divisor, shape [..., 1].

    Moondream 2's inference code divides by 1024 (values in [0, 1023/1024]); Moondream 3's own
    engine by 1023 (the token contract's ``coord_divisor`` says which).
    """
    return (logits.argmax(dim=-1, keepdim=True).to(torch.float32)) / divisor


def size_from_logits(logits: torch.Tensor, scale: str) -> torch.Tensor:
    """Size logits [..., 2048] -> (width, height) [..., 2].

    `scale` is "log" (2^(bin/1023*10-10), the 2025-03 and later heads) or "linear" (bin/1024,
    the 2025-01-09 heads). Row 0 of the [2, 1024] view is width, row 1 is height.
    """
    bins = logits.reshape(*logits.shape[:-1], 2, SIZE_BINS).argmax(dim=-1).to(torch.float32)
    if scale == "log":
        return torch.exp2(bins / (SIZE_BINS - 1) * 10.0 - 10.0)
    if scale == "linear":
        return bins / SIZE_BINS
    raise ValueError(f"unknown size scale {scale!r} (expected 'log' or 'linear')")
