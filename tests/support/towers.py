"""moondream2's vision tower at full size with seeded random weights, for GPU tests."""

from __future__ import annotations

import torch

from vlm_server.models.common.vision import VisionEncoder
from vlm_server.models.moondream2.config import VisionConfig


def full_size_tower(seed: int, crops: int = 9) -> tuple[VisionEncoder, torch.Tensor]:
    """The tower in bf16 on CUDA (weights drawn N(0, 0.02)) and ``crops`` random crops."""
    torch.manual_seed(seed)
    enc = VisionEncoder(VisionConfig()).cuda().bfloat16().eval()
    for p in enc.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return enc, torch.randn(crops, 3, 378, 378, device="cuda").bfloat16()
