"""The region heads' encoders both Moondream families share: a coordinate or a size becomes an
input embedding through Fourier features and one linear layer. Each family adds its decoders."""

from __future__ import annotations

import math

import torch
from torch import nn

from vlm_server.models.common.config import RegionConfig


def fourier_features(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[cos | sin] of 2*pi*x @ w, in the weights' dtype (bf16 for real checkpoints)."""
    f = 2 * math.pi * x.to(w.dtype) @ w
    return torch.cat([f.cos(), f.sin()], dim=-1)


class RegionEncoders(nn.Module):
    """Coordinate and size encoders; parameter names are the checkpoints' (``region.*``)."""

    def __init__(self, cfg: RegionConfig) -> None:
        super().__init__()
        self.coord_features = nn.Parameter(torch.zeros(1, cfg.coord_feat_dim // 2))
        self.coord_encoder = nn.Linear(cfg.coord_feat_dim, cfg.dim)
        self.size_features = nn.Parameter(torch.zeros(2, cfg.size_feat_dim // 2))
        self.size_encoder = nn.Linear(cfg.size_feat_dim, cfg.dim)

    def encode_coord(self, x: torch.Tensor) -> torch.Tensor:
        """Coordinate [..., 1] in [0, 1] -> input embedding [..., dim]."""
        return self.coord_encoder(fourier_features(x, self.coord_features))

    def encode_size(self, wh: torch.Tensor) -> torch.Tensor:
        """(width, height) [..., 2] -> input embedding [..., dim]."""
        return self.size_encoder(fourier_features(wh, self.size_features))
