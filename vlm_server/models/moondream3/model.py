"""The whole Moondream 3 model (a `DeviceModel`); parameter names equal the Hugging Face
layout's keys without ``model.``. The vision tower is Moondream 2's, unchanged."""

from __future__ import annotations

import torch
from torch import nn

from vlm_server.models.interface import KVShape
from vlm_server.models.moondream2.vision import VisionEncoder
from vlm_server.models.moondream3.config import ModelConfig
from vlm_server.models.moondream3.fp8_experts import fp8_experts_supported
from vlm_server.models.moondream3.moe import MoeMLP
from vlm_server.models.moondream3.region import RegionModel
from vlm_server.models.moondream3.text import TextDecoder


class Moondream3Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.vision = VisionEncoder(config.vision)
        self.text = TextDecoder(config.text, config.choices)
        self.region = RegionModel(config.region, config.choices.region_norm)
        self.region.final_norm = (self.text.post_ln,)

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
        # The tau-scaled projection is packed Q | K | V like Moondream 2's and rotates by our
        # own tables: the engine's CUDA kernels serve it unchanged.
        return True

    def use_fp8_experts(self) -> None:
        """Hold every expert matrix in FP8 with per-row scales (quantizing bf16 weights):
        half the memory; the fused kernels read them as they are. Call it before any graph
        captures the decoder. On CUDA it needs FP8 units (the kernels widen FP8 tiles)."""
        if self.device.type == "cuda" and not fp8_experts_supported(self.device):
            raise ValueError(
                "FP8 experts on CUDA need compute capability 9.0 or newer (the fused "
                f"kernels' FP8 widening); the model is on {self.device}"
            )
        for block in self.text.blocks:
            if isinstance(block.mlp, MoeMLP):
                block.mlp.fc1.use_fp8()
                block.mlp.fc2.use_fp8()

    def use_fp8_activations(self) -> None:
        """Run the expert products of wide steps with FP8 activations (moe.py); needs the
        experts in FP8 (`use_fp8_experts`, or an FP8 checkpoint). Before any graph capture."""
        for block in self.text.blocks:
            if isinstance(block.mlp, MoeMLP):
                try:
                    block.mlp.use_fp8_activations()
                except ValueError as err:  # 16-bit experts: name the server's flag
                    raise ValueError(
                        "experts_fp8_activations needs the experts in FP8: an FP8-expert "
                        "checkpoint on a GPU of compute capability 9.0 or newer"
                    ) from err

    def image_embeddings(self, crops: torch.Tensor, tiling: tuple[int, int]) -> torch.Tensor:
        """Normalized crops of one image [1 + h*w, 3, S, S] -> embeddings [patches, dim]."""
        return self.vision.project(self.vision.encode(crops.to(self.dtype)), tiling)

    def prefix_embeddings(self, image_emb: torch.Tensor) -> torch.Tensor:
        """BOS followed by the image embeddings: [1, 1 + patches, dim]."""
        # A view of BOS's row: an id tensor would be a pageable host-to-device copy.
        bos_id = self.config.tokens.bos_id
        bos = self.text.wte[bos_id : bos_id + 1]
        return torch.cat([bos, image_emb], dim=0)[None]
