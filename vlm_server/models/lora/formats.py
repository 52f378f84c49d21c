"""Which adapter code serves a family, chosen by the targets its decoder declares (the engine
and the command line never import a family): how a file is read and checked, and the device
bank that holds the resident adapters."""

from __future__ import annotations

from pathlib import Path

import torch

from vlm_server.models.lora import files, finetune_files
from vlm_server.models.lora.bank import LoraBank
from vlm_server.models.lora.experts import ExpertLoraBank
from vlm_server.models.lora.spec import AdapterWeights, LoraTargets


def load(path: Path, targets: LoraTargets, max_rank: int, name: str) -> AdapterWeights:
    """Read and check adapter ``name``'s file in its family's format (raises AdapterError)."""
    if targets.format == "finetune":
        return finetune_files.load(path, targets, max_rank, name)
    return files.load(path, targets, max_rank, name)


def new_bank(
    targets: LoraTargets,
    n_slots: int,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> LoraBank:
    """The device slots for ``targets``: with expert layers, one pair per expert as well."""
    if targets.experts is not None:
        return ExpertLoraBank(targets, n_slots, max_rank, dtype, device)
    return LoraBank(targets, n_slots, max_rank, dtype, device)
