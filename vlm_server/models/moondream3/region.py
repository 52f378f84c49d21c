"""Moondream 3's region heads: Moondream 2's Fourier-feature encoders (common/region.py);
decoders are one LayerNorm and a single linear layer each (no MLP).

The decoders read the raw residual stream of the last position (before the decoder's final
norm). Where the region norm sits is disputed (`DisputedPoints.region_norm`): on that raw state
(the author's engine), on the final-normed state (vLLM), or nowhere (older ports).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from vlm_server.models.common.layers import LayerNorm
from vlm_server.models.common.region import RegionEncoders
from vlm_server.models.moondream3.config import RegionConfig, RegionNorm

Norm = Callable[[torch.Tensor], torch.Tensor]


class RegionModel(RegionEncoders):
    def __init__(self, cfg: RegionConfig, norm: RegionNorm) -> None:
        super().__init__(cfg)
        self.coord_decoder = nn.Linear(cfg.dim, cfg.coord_out_dim)
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

    def decode_coord(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden [..., dim] -> coordinate bin logits [..., coord_out_dim]."""
        return self.coord_decoder(self._pre(hidden))

    def decode_size(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden [..., dim] -> size bin logits [..., 2 * bins] (width row, height row)."""
        return self.size_decoder(self._pre(hidden))
