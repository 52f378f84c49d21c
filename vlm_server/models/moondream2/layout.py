"""Checkpoint key layouts: the native one (the model's own names) and the legacy training one.

The legacy layout only renames tensors (common/legacy_layout.py), plus two transposes (the
Fourier feature matrices).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from vlm_server.models.common.legacy_layout import legacy_to_native
from vlm_server.models.moondream2.config import ModelConfig

NATIVE_MARKER = "vision.blocks.0.attn.proj.bias"
NATIVE_PREFIX = "model."

# Stored transposed in the legacy layout.
TRANSPOSED_NATIVE_KEYS = frozenset({"region.coord_features", "region.size_features"})
# Finetune dumps carry cache tensors that are not weights.
_IGNORED = re.compile(r"(^|\.)kv_cache\.(k|v)_cache$")


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Native key -> shape for a configuration, taken from the model itself (no allocation)."""
    from vlm_server.models.moondream2.model import MoondreamModel

    with torch.device("meta"):
        model = MoondreamModel(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def is_native(keys: set[str]) -> bool:
    return NATIVE_MARKER in keys or NATIVE_PREFIX + NATIVE_MARKER in keys


def to_native(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Rename a native or legacy state dict to native keys.

    Returns the renamed tensors and the keys that no rule understood (reported as unexpected).
    """
    keys = set(state)
    out: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    if is_native(keys):
        for k, v in state.items():
            if _IGNORED.search(k):
                continue
            out[k.removeprefix(NATIVE_PREFIX)] = v
        return out, unknown
    for k, v in state.items():
        if _IGNORED.search(k):
            continue
        native = legacy_to_native(k)
        if native is None:
            unknown.append(k)
            continue
        out[native] = v.T.contiguous() if native in TRANSPOSED_NATIVE_KEYS else v
    return out, unknown
