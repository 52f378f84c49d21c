"""``--device`` values -> `torch.device`, or a one-line error saying why not."""

from __future__ import annotations

import torch

CHOICES = "cpu, cuda or cuda:N"


def resolve_device(name: str | None) -> torch.device:
    """The device ``name`` names (None: cuda when present, else cpu).

    Raises ValueError for a name torch does not know and for a GPU this machine or this
    torch build does not have, before any model is loaded."""
    if not name:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}: use {CHOICES}") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"unsupported device {name!r}: use {CHOICES}")
    if not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise ValueError(f"device {name!r}: CUDA is not available ({why}); use --device cpu")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(f"device {name!r}: this machine has {count} GPU(s)")
    return device


def cap_memory(device: torch.device, limit: int) -> None:
    """Cap what PyTorch's allocator may hold on ``device`` at ``limit`` bytes (--gpu-memory);
    the CUDA context and library workspaces come on top. Refuses a cap above the device's
    memory, naming the flag; nothing to cap off CUDA."""
    if device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    if limit > total:
        raise ValueError(
            f"gpu_memory_bytes: {limit} bytes is more than the {total} bytes of {device}"
        )
    torch.cuda.set_per_process_memory_fraction(limit / total, index)
