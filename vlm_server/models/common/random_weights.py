"""Seeded random weights of plausible scale, one tensor at a time: the random checkpoints and
in-memory models of both Moondream families."""

from __future__ import annotations

import hashlib
import math

import torch


def _tensor_seed(seed: int, key: str) -> int:
    """Per-tensor seed, so a tensor's values do not depend on the order tensors are made in."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def random_tensor(key: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    """A plausible random value for one checkpoint tensor.

    Linear weights get std 1/sqrt(fan_in) so activations keep their scale through the layers;
    LayerNorm weights sit near 1; Fourier features are spread like trained ones.
    """
    gen = torch.Generator().manual_seed(_tensor_seed(seed, key))
    name = key.rsplit(".", 1)[-1]
    parent = key.rsplit(".", 2)[-2] if key.count(".") >= 2 else ""
    is_norm = parent.startswith("ln") or parent.endswith("_ln")
    if key.endswith(("coord_features", "size_features")):
        std = 2.0
    elif is_norm and name == "weight":
        return (1.0 + 0.1 * torch.randn(shape, generator=gen)).to(dtype)
    elif name == "bias":
        std = 0.02
    elif key.endswith(("pos_emb", "wte")):
        std = 0.5
    else:
        std = 1.0 / math.sqrt(shape[-1])
    return (torch.randn(shape, generator=gen) * std).to(dtype)
