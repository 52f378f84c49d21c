"""Seeded random adapters in the reference's file format (tests and benchmarks)."""

from __future__ import annotations

from pathlib import Path

import torch

from vlm_server.models.lora.spec import LoraTargets

# The training code's module names, which the reference renames when it loads a file.
_TRAINING = {
    "qkv": "mixer.Wqkv",
    "proj": "mixer.out_proj",
    "fc1": "mlp.fc1",
    "fc2": "mlp.fc2",
}


def random_state(
    targets: LoraTargets,
    rank: int,
    seed: int = 0,
    scale: float = 0.05,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """A random adapter of ``rank`` on every target, under the training code's key names."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for layer in range(targets.n_layers):
        for target, (n_in, n_out) in targets.targets.items():
            key = f"text_model.transformer.h.{layer}.{_TRAINING[target]}.parametrizations.weight.0"
            out[f"{key}.A"] = (torch.randn(rank, n_in, generator=g) * scale).to(dtype)
            out[f"{key}.B"] = (torch.randn(n_out, rank, generator=g) * scale).to(dtype)
    return out


def write_random(
    folder: Path,
    name: str,
    targets: LoraTargets,
    rank: int,
    seed: int = 0,
    scale: float = 0.05,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """``<folder>/<name>/final.pt``, where the reference caches a downloaded finetune."""
    path = Path(folder) / name / "final.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(random_state(targets, rank, seed, scale, dtype), path)
    return path
