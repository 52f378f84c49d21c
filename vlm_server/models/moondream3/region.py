"""Moondream 3's region heads: Fourier-feature encoders as in Moondream 2; decoders are one
LayerNorm and a single linear layer each (no MLP).

The decoders read the raw residual stream of the last position (before the decoder's final
norm). Where the region norm sits is disputed (`DisputedPoints.region_norm`): on that raw state
(the author's engine), on the final-normed state (vLLM), or nowhere (older ports).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from vlm_server.models.common.layers import LayerNorm
from vlm_server.models.moondream2.region import fourier_features
from vlm_server.models.moondream3.config import RegionConfig, RegionNorm

Norm = Callable[[torch.Tensor], torch.Tensor]


class RegionModel(nn.Module):
    def __init__(self, cfg: RegionConfig, norm: RegionNorm) -> None:
        super().__init__()
        self.coord_features = nn.Parameter(torch.zeros(1, cfg.coord_feat_dim // 2))
        self.coord_encoder = nn.Linear(cfg.coord_feat_dim, cfg.dim)
        self.coord_decoder = nn.Linear(cfg.dim, cfg.coord_out_dim)
        self.size_features = nn.Parameter(torch.zeros(2, cfg.size_feat_dim // 2))
        self.size_encoder = nn.Linear(cfg.size_feat_dim, cfg.dim)
        self.size_decoder = nn.Linear(cfg.dim, cfg.size_out_dim)
        self.norm = norm
        if norm != "none":
            self.ln = LayerNorm(cfg.dim)
        # For ``post_ln``: the decoder's final norm, set by the model (a plain attribute, so
        # its weights stay the decoder's in the state dict).
        self.final_norm: tuple[Norm, ...] = ()

    def _pre(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.norm == "none":
            return hidden
        if self.norm == "post_ln":
            hidden = self.final_norm[0](hidden)
        return self.ln(hidden)

    def encode_coord(self, x: torch.Tensor) -> torch.Tensor:
        """Coordinate [..., 1] in [0, 1] -> input embedding [..., dim]."""
        return self.coord_encoder(fourier_features(x, self.coord_features))

    def encode_size(self, wh: torch.Tensor) -> torch.Tensor:
        """(width, height) [..., 2] -> input embedding [..., dim]."""
        return self.size_encoder(fourier_features(wh, self.size_features))

    def decode_coord(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden [..., dim] -> coordinate bin logits [..., coord_out_dim]."""
        return self.coord_decoder(self._pre(hidden))

    def decode_size(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden [..., dim] -> size bin logits [..., 2 * bins] (width row, height row)."""
        return self.size_decoder(self._pre(hidden))
