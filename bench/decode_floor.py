"""The bandwidth floor of a decode step: the bytes one step must read (the decoder's weights,
the experts its tokens route to, the KV cache its rows attend to) over the GPU's measured copy
bandwidth. Mixture-of-experts banks are recognized as `ExpertBank`-like modules (a
``weight`` whose first dimension is the expert count); a step of T tokens with top-k routing
touches, in expectation over uniform routing, E (1 - (1 - k/E)^T) of E experts.
"""

from __future__ import annotations

import torch
from torch import nn


def copy_bandwidth(device: torch.device | str = "cuda", nbytes: int = 1 << 30) -> float:
    """Bytes per second of a device-to-device copy (read + write counted), best of 5."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    return 2 * src.numel() * src.element_size() / best


def _expert_banks(text: nn.Module, n_experts: int) -> list[nn.Module]:
    return [
        m
        for m in text.modules()
        if isinstance(getattr(m, "weight", None), torch.Tensor)
        and m.weight.dim() == 3
        and m.weight.shape[0] == n_experts
    ]


def step_bytes(
    text: nn.Module,
    rows: int,
    context: int,
    kv_bytes_per_position: int,
    n_experts: int = 0,
    top_k: int = 0,
) -> float:
    """Bytes a decode step of ``rows`` rows at ``context`` positions each reads."""
    banks = _expert_banks(text, n_experts) if n_experts else []
    in_banks = {id(p) for m in banks for p in m.parameters(recurse=False)}
    in_banks |= {id(b) for m in banks for b in m.buffers(recurse=False) if b is not None}
    dense = 0
    for name, p in text.named_parameters():
        if id(p) not in in_banks and not name.endswith("wte"):  # embeddings: rows gathered
            dense += p.numel() * p.element_size()
    experts = 0.0
    if banks:
        touched = n_experts * (1 - (1 - top_k / n_experts) ** rows)
        for m in banks:
            per = sum(
                t.numel() * t.element_size()
                for t in (m.weight, getattr(m, "scale", None))
                if t is not None
            )
            experts += per * touched / n_experts
    return dense + experts + rows * context * kv_bytes_per_position
