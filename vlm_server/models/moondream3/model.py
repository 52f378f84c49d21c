"""The whole Moondream 3 model (a `DeviceModel`); parameter names equal the Hugging Face
layout's keys without ``model.``. The vision tower is Moondream 2's, unchanged
(common/vision.py)."""

from __future__ import annotations

from pathlib import Path

from vlm_server.models.common.model_base import MoondreamBase
from vlm_server.models.common.vision import VisionEncoder
from vlm_server.models.interface import Capabilities, SegmentRefine
from vlm_server.models.moondream3.config import FORMATS, ModelConfig
from vlm_server.models.moondream3.fp8_experts import fp8_experts_supported
from vlm_server.models.moondream3.moe import MoeMLP
from vlm_server.models.moondream3.region import RegionModel
from vlm_server.models.moondream3.text import TextDecoder


class Moondream3Model(MoondreamBase):
    config: ModelConfig
    text: TextDecoder
    region: RegionModel

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.vision = VisionEncoder(config.vision)
        self.text = TextDecoder(config.text, config.choices)
        self.region = RegionModel(config.region, config.choices.region_norm)
        self.region.final_norm = (self.text.post_ln,)

    @property
    def capabilities(self) -> Capabilities:
        """Adapters on the MLPs, fused tau kernels, the FP8 tower, FP8 experts, the refiner;
        the block linears, experts included, in 8 or 4 bits when loaded so (loader.py
        `quant_targets`), and the tower's when quantized at load (then no FP8 tower: it
        quantizes 16-bit weights)."""
        text = self.text
        return Capabilities(
            FORMATS,
            quantized=self.quantized,
            vision_quantized=self.vision_quantized,
            adapters=text,
            fused_products=text,
            fp8_vision=None if self.tower_quantized else self.vision,
            fp8_experts=self,
            segment_refiner=self._segment_refiner,
        )

    def _segment_refiner(self, weights: Path) -> SegmentRefine:
        # Imported when asked for: the refiner's mask process and tracing are not the model's.
        from vlm_server.models.moondream3.refiner import build_refiner

        return build_refiner(self, weights)

    def use_fp8_experts(self) -> None:
        """Hold every expert matrix in FP8 with per-row scales (quantizing bf16 weights):
        half the memory; the fused kernels read them as they are. Call it before any graph
        captures the decoder. On CUDA it needs FP8 units (the kernels widen FP8 tiles)."""
        if self.device.type == "cuda" and not fp8_experts_supported(self.device):
            raise ValueError(
                "FP8 experts on CUDA need compute capability 8.9 or newer (the fused "
                f"kernels' FP8 widening); the model is on {self.device}"
            )
        for block in self.text.blocks:
            if isinstance(block.mlp, MoeMLP):
                block.mlp.fc1.use_fp8()
                block.mlp.fc2.use_fp8()

    @property
    def experts_in_fp8(self) -> bool:
        """Whether the expert weights are held in FP8 (every expert layer alike)."""
        return any(
            isinstance(b.mlp, MoeMLP) and b.mlp.fc1.format == "fp8" for b in self.text.blocks
        )

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
                        "checkpoint on a GPU of compute capability 8.9 or newer"
                    ) from err
