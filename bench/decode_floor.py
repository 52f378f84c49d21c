"""The bandwidth floor of a decode step: the bytes one step must read (the decoder's weights,
the experts its tokens route to, the KV cache its rows attend to) over the GPU's measured copy
bandwidth. Mixture-of-experts banks are Moondream 3's `ExpertBank`s, in whatever format they
hold (16-bit, FP8, INT8 or INT4 with their scales); a step of T tokens with top-k routing
touches, in expectation over uniform routing, E (1 - (1 - k/E)^T) of E experts. Quantized
linear layers count their stored values and scales.
"""

from __future__ import annotations

import torch
from torch import nn

from vlm_server.models.common.quant_linear import QuantLinear
from vlm_server.models.moondream3.moe import ExpertBank


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


def _expert_banks(text: nn.Module) -> list[ExpertBank]:
    return [m for m in text.modules() if isinstance(m, ExpertBank)]


def _nbytes(m: nn.Module) -> int:
    """A module's own parameters and buffers (a bank's values and scales)."""
    own = [*m.parameters(recurse=False), *m.buffers(recurse=False)]
    return sum(t.numel() * t.element_size() for t in own if t is not None)


def step_bytes(
    text: nn.Module,
    rows: int,
    context: int,
    kv_bytes_per_position: int,
    n_experts: int = 0,
    top_k: int = 0,
) -> float:
    """Bytes a decode step of ``rows`` rows at ``context`` positions each reads."""
    banks = _expert_banks(text) if n_experts else []
    in_banks = {id(p) for m in banks for p in m.parameters(recurse=False)}
    dense = 0
    for name, p in text.named_parameters():
        if id(p) not in in_banks and not name.endswith("wte"):  # embeddings: rows gathered
            dense += p.numel() * p.element_size()
    for m in text.modules():  # a quantized layer's values and scales (its bias: above)
        if isinstance(m, QuantLinear):
            dense += sum(b.numel() * b.element_size() for b in m.buffers(recurse=False))
    experts = 0.0
    if banks:
        touched = n_experts * (1 - (1 - top_k / n_experts) ** rows)
        experts = sum(_nbytes(m) for m in banks) * touched / n_experts
    return dense + experts + rows * context * kv_bytes_per_position
