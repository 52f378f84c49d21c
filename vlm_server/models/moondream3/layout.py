"""Checkpoint key layouts of Moondream 3: the Hugging Face one (``model.`` + the model's own
names, bf16, sharded with an index) and the author's engine's "md3" one (``text_model.*``,
``vision_encoder.*``, ``region_model.*``; FP8 experts with per-row scales).

The md3 layout renames tensors, stores the two Fourier matrices transposed, may fuse the two
tau matrices into one (query rows first), and adds per-expert row scales and optional KV-cache
scales (read and ignored: the KV cache here stays in the activation dtype).
"""

from __future__ import annotations

import re

import torch

from vlm_server.models.common.legacy_layout import legacy_to_native, native_to_legacy
from vlm_server.models.moondream3.config import ModelConfig

HF_PREFIX = "model."
MD3_MARKER = "text_model.transformer."
_T = re.escape(MD3_MARKER)

# (md3 pattern, native replacement) for the keys Moondream 2's training layout has no rule for.
_MD3_RULES: tuple[tuple[str, str], ...] = (
    (_T + r"h\.(\d+)\.tau_wq", r"text.blocks.\1.attn.tau.wq"),
    (_T + r"h\.(\d+)\.tau_wv", r"text.blocks.\1.attn.tau.wv"),
    (_T + r"h\.(\d+)\.tau_alpha", r"text.blocks.\1.attn.tau.alpha"),
    (_T + r"h\.(\d+)\.gate\.(weight|bias)", r"text.blocks.\1.mlp.router.\2"),
    (_T + r"h\.(\d+)\.mlp\.experts\.weight", r"text.blocks.\1.mlp.fc1.weight"),
    (_T + r"h\.(\d+)\.mlp\.output_experts\.weight", r"text.blocks.\1.mlp.fc2.weight"),
    (r"region_model\.coordinate_head\.(weight|bias)", r"region.coord_decoder.\1"),
    (r"region_model\.size_head\.(weight|bias)", r"region.size_decoder.\1"),
    (r"region_model\.ln\.(weight|bias)", r"region.ln.\1"),
)
_COMPILED = tuple((re.compile(p), r) for p, r in _MD3_RULES)

# The fused tau matrix [q heads + kv heads, qkv_dim] of one layer, and the scales.
FUSED_TAU = re.compile(_T + r"h\.(\d+)\.tau_wqwv")
MOE_SCALE = re.compile(_T + r"h\.(\d+)\.moe_quant\.(up|down)_scale")
KV_SCALE = re.compile(_T + r"h\.(\d+)\.kv_quantizer\.(k|v)_scale")
TRANSPOSED = frozenset({"region.coord_features", "region.size_features"})


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Native key -> shape for a configuration, taken from the model itself (no allocation)."""
    from vlm_server.models.moondream3.model import Moondream3Model

    with torch.device("meta"):
        model = Moondream3Model(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def is_md3_layout(keys: set[str]) -> bool:
    return any(k.startswith(MD3_MARKER) for k in keys)


def md3_to_native(key: str) -> str | None:
    """Native name of an md3 key (tensors that need more than a rename: see the patterns
    above), or None when no rule matches."""
    key = key.replace("._orig_mod", "").removeprefix("_orig_mod.")
    for pattern, repl in _COMPILED:
        if pattern.fullmatch(key):
            return pattern.sub(repl, key)
    return legacy_to_native(key)


def native_to_md3(key: str) -> str:
    """md3 name of a native key (the writer's direction)."""
    m = re.fullmatch(r"text\.blocks\.(\d+)\.attn\.tau\.(wq|wv|alpha)", key)
    if m:
        return f"{MD3_MARKER}h.{m[1]}.tau_{m[2]}"
    m = re.fullmatch(r"text\.blocks\.(\d+)\.mlp\.router\.(weight|bias)", key)
    if m:
        return f"{MD3_MARKER}h.{m[1]}.gate.{m[2]}"
    m = re.fullmatch(r"region\.(coord|size)_decoder\.(weight|bias)", key)
    if m:
        head = "coordinate" if m[1] == "coord" else "size"
        return f"region_model.{head}_head.{m[2]}"
    m = re.fullmatch(r"region\.ln\.(weight|bias)", key)
    if m:
        return f"region_model.ln.{m[1]}"
    return native_to_legacy(key)


def expert_key(layer: int, up: bool) -> str:
    """md3 name of a layer's stacked expert matrices (fc1 = "up", fc2 = "down")."""
    return f"{MD3_MARKER}h.{layer}.mlp.{'experts' if up else 'output_experts'}.weight"


def scale_key(layer: int, up: bool) -> str:
    return f"{MD3_MARKER}h.{layer}.moe_quant.{'up' if up else 'down'}_scale"


def fused_tau_key(layer: int) -> str:
    return f"{MD3_MARKER}h.{layer}.tau_wqwv"
