"""FP8 expert weights as the md3 checkpoint layout stores them: float8_e4m3fn values with one
fp32 scale per expert and output row, ``W[e, n, k] = q[e, n, k] * s[e, n]``."""

from __future__ import annotations

import torch

from vlm_server.chip_features import capability, fp8_supported
from vlm_server.chips import FP8_CAPABILITY

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked experts [E, N, K] -> (fp8 values [E, N, K], fp32 row scales [E, N]); each row's
    absolute maximum maps to 448. (The released files' scales come from a finer search; any
    scales load the same way.)"""
    w32 = w.float()
    scale = (w32.abs().amax(dim=-1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (w32 / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [E, N, K] and row scales [E, N] -> q * s in fp32, then ``dtype``."""
    return (q.float() * scale.float()[..., None]).to(dtype)


# Every chip with FP8 units (Ada's sm_89 too): the fused kernels' FP8 tiles and their widening
# assemble there (tests/test_kernels_fit_chips.py compiles each for sm_89, 90, 100 and 120).
FP8_EXPERTS_CAPABILITY = FP8_CAPABILITY


def fp8_experts_supported(device: torch.device) -> bool:
    """Whether the fused expert kernels take FP8 weights on ``device``."""
    if not fp8_supported(device):
        return False
    return capability(device) >= FP8_EXPERTS_CAPABILITY
