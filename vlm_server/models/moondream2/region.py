"""Region heads: Fourier-feature encoders (common/region.py) and MLP decoders for coordinates
and sizes."""

from __future__ import annotations

import torch

from vlm_server.models.common.layers import MLP
from vlm_server.models.common.region import RegionEncoders
from vlm_server.models.moondream2.config import RegionConfig


class RegionModel(RegionEncoders):
    def __init__(self, cfg: RegionConfig) -> None:
        super().__init__(cfg)
        self.coord_decoder = MLP(cfg.dim, cfg.inner_dim, cfg.coord_out_dim)
        self.size_decoder = MLP(cfg.dim, cfg.inner_dim, cfg.size_out_dim)

    def decode_coord(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden [..., dim] -> coordinate bin logits [..., coord_out_dim]."""
        return self.coord_decoder(hidden)

    def decode_size(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden [..., dim] -> size bin logits [..., 2 * bins] (width row, height row)."""
        return self.size_decoder(hidden)
