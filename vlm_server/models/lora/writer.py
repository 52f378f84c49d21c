"""Seeded random adapters in the reference's file format, and Moondream 3 finetunes in the
cloud's (tests and benchmarks)."""

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


# Moondream 3 finetunes: the cloud's module names of fc1 and fc2 (models/lora/finetune_files.py).
_PARTS = {"fc1": "up", "fc2": "down"}


def random_finetune(
    targets: LoraTargets,
    rank: int,
    seed: int = 0,
    scale: float = 0.05,
    dtype: torch.dtype = torch.float32,
    prefix: str = "text_lora.",
) -> dict[str, dict[str, torch.Tensor]]:
    """A random finetune checkpoint of ``rank`` for a decoder with expert layers, as the cloud
    saves one: ``{"lora_state_dict": {prefix + "dense.<i>.up_a": ..., prefix + "moe.<j>...}}``
    (each expert of rank ``rank / top_k``)."""
    ex = targets.experts
    if ex is None or rank % ex.top_k:
        raise ValueError("a finetune needs expert layers and a rank divisible by their top_k")
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    state: dict[str, torch.Tensor] = {}
    for layer in range(targets.n_layers):
        for target, (n_in, n_out) in targets.targets.items():
            key = f"{prefix}dense.{layer}.{_PARTS[target]}"
            state[f"{key}_a"], state[f"{key}_b"] = rand(rank, n_in), rand(n_out, rank)
    r, e = rank // ex.top_k, ex.n_experts
    for layer in range(ex.n_layers):
        for target, (n_in, n_out) in ex.targets.items():
            key = f"{prefix}moe.{layer}.{_PARTS[target]}"
            state[f"{key}_a"], state[f"{key}_b"] = rand(e, r, n_in), rand(e, n_out, r)
    return {"lora_state_dict": state}


def write_random_finetune(
    folder: Path,
    name: str,
    targets: LoraTargets,
    rank: int,
    seed: int = 0,
    scale: float = 0.05,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """``<folder>/<name>/final.pt``: a random finetune checkpoint (`random_finetune`)."""
    path = Path(folder) / name / "final.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(random_finetune(targets, rank, seed, scale, dtype), path)
    return path
