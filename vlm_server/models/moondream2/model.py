"""The whole Moondream 2 model (a `DeviceModel`); parameter names equal the native checkpoint
keys (without ``model.``)."""

from __future__ import annotations

import torch
from torch import nn

from vlm_server.models.interface import KVShape
from vlm_server.models.moondream2.config import ModelConfig
from vlm_server.models.moondream2.region import RegionModel
from vlm_server.models.moondream2.text import TextDecoder
from vlm_server.models.moondream2.vision import VisionEncoder


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

    @property
    def kv_shape(self) -> KVShape:
        t = self.config.text
        return KVShape(t.n_layers, t.n_kv_heads, t.head_dim)

    @property
    def n_heads(self) -> int:
        return self.config.text.n_heads

    @property
    def fused_attention(self) -> bool:
        return True

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
