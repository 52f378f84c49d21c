"""Write seeded random checkpoints in the real layout, with a matching tokenizer and config.

Tests, benchmarks and the built-in default model all come from here: same keys, shapes and
dtype as a released moondream2 ``model.safetensors``, so the loader runs its real code path.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from vlm_server.models.common.legacy_layout import native_to_legacy
from vlm_server.models.common.random_weights import random_tensor
from vlm_server.models.common.tokenizer_build import build_tokenizer
from vlm_server.models.moondream2.config import ModelConfig
from vlm_server.models.moondream2.layout import (
    NATIVE_PREFIX,
    TRANSPOSED_NATIVE_KEYS,
    expected_shapes,
)

CONFIG_FORMAT = "moondream-serve/1"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "config.json"


def write_checkpoint(
    config: ModelConfig,
    out_dir: str | Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    layout: str = "native",
    prefix: bool = True,
    progress: bool = True,
) -> Path:
    """Write ``model.safetensors``, ``tokenizer.json`` and ``config.json`` into ``out_dir``.

    ``layout`` is ``"native"`` (keys ``model.`` + module path, or without the prefix when
    ``prefix`` is False) or ``"legacy"`` (the training layout's names and transposes).
    """
    if layout not in ("native", "legacy"):
        raise ValueError(f"layout must be 'native' or 'legacy', not {layout!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shapes = expected_shapes(config)
    tensors: dict[str, torch.Tensor] = {}
    items = tqdm(
        shapes.items(), desc=f"random weights ({config.name})", unit="tensor", disable=not progress
    )
    for key, shape in items:
        value = random_tensor(key, shape, seed, dtype)
        if layout == "legacy":
            if key in TRANSPOSED_NATIVE_KEYS:
                value = value.T.contiguous()
            tensors[native_to_legacy(key)] = value
        else:
            tensors[(NATIVE_PREFIX if prefix else "") + key] = value
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    build_tokenizer(config, seed=seed).save(str(out / TOKENIZER_FILE))
    meta = {
        "format": CONFIG_FORMAT,
        "family": "moondream2",
        "seed": seed,
        "random_weights": True,
        "model": config.to_dict(),
    }
    (out / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return out
