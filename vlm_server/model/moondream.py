"""The whole model; parameter names equal the native checkpoint keys (without ``model.``)."""

from __future__ import annotations

import torch
from torch import nn

from vlm_server.config import ModelConfig
from vlm_server.model.region import RegionModel
from vlm_server.model.text import TextDecoder
from vlm_server.model.vision import VisionEncoder


class MoondreamModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.vision = VisionEncoder(config.vision)
        self.text = TextDecoder(config.text)
        self.region = RegionModel(config.region)

    @property
    def dtype(self) -> torch.dtype:
        return self.text.wte.dtype

    @property
    def device(self) -> torch.device:
        return self.text.wte.device

    def image_embeddings(self, crops: torch.Tensor, tiling: tuple[int, int]) -> torch.Tensor:
        """Normalized crops of one image [1 + h*w, 3, S, S] -> embeddings [patches, dim]."""
        return self.vision.project(self.vision.encode(crops.to(self.dtype)), tiling)

    def prefix_embeddings(self, image_emb: torch.Tensor) -> torch.Tensor:
        """BOS followed by the image embeddings: [1, 1 + patches, dim]."""
        # A view of BOS's embedding row: building an id tensor here would be a host-to-device
        # copy from pageable memory, which makes the host wait for the GPU (the vision tower).
        bos_id = self.config.tokens.bos_id
        bos = self.text.wte[bos_id : bos_id + 1]
        return torch.cat([bos, image_emb], dim=0)[None]
