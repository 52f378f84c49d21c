"""Region heads: Fourier-feature encoders and MLP decoders for coordinates and sizes."""

from __future__ import annotations

import math

import torch
from torch import nn

from vlm_server.models.common.layers import MLP
from vlm_server.models.moondream2.config import RegionConfig


def fourier_features(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[cos | sin] of 2*pi*x @ w, in the weights' dtype (bf16 for real checkpoints)."""
    f = 2 * math.pi * x.to(w.dtype) @ w
    return torch.cat([f.cos(), f.sin()], dim=-1)


class RegionModel(nn.Module):
    def __init__(self, cfg: RegionConfig) -> None:
        super().__init__()
        self.coord_features = nn.Parameter(torch.zeros(1, cfg.coord_feat_dim // 2))
        self.coord_encoder = nn.Linear(cfg.coord_feat_dim, cfg.dim)
        self.coord_decoder = MLP(cfg.dim, cfg.inner_dim, cfg.coord_out_dim)
        self.size_features = nn.Parameter(torch.zeros(2, cfg.size_feat_dim // 2))
        self.size_encoder = nn.Linear(cfg.size_feat_dim, cfg.dim)
        self.size_decoder = MLP(cfg.dim, cfg.inner_dim, cfg.size_out_dim)

    def encode_coord(self, x: torch.Tensor) -> torch.Tensor:
        """Coordinate [..., 1] in [0, 1] -> input embedding [..., dim]."""
        return self.coord_encoder(fourier_features(x, self.coord_features))

    def encode_size(self, wh: torch.Tensor) -> torch.Tensor:
        """(width, height) [..., 2] -> input embedding [..., dim]."""
        return self.size_encoder(fourier_features(wh, self.size_features))

    def decode_coord(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden [..., dim] -> coordinate bin logits [..., coord_out_dim]."""
        return self.coord_decoder(hidden)

    def decode_size(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden [..., dim] -> size bin logits [..., 2 * bins] (width row, height row)."""
        return self.size_decoder(hidden)
