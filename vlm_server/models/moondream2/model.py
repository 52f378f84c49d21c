"""The whole Moondream 2 model (a `DeviceModel`); parameter names equal the native checkpoint
keys (without ``model.``)."""

from __future__ import annotations

from vlm_server.models.common.model_base import MoondreamBase
from vlm_server.models.common.vision import VisionEncoder
from vlm_server.models.interface import Capabilities
from vlm_server.models.moondream2.config import FORMATS, ModelConfig
from vlm_server.models.moondream2.region import RegionModel
from vlm_server.models.moondream2.text import TextDecoder


class MoondreamModel(MoondreamBase):
    config: ModelConfig
    text: TextDecoder
    region: RegionModel

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.vision = VisionEncoder(config.vision)
        self.text = TextDecoder(config.text)
        self.region = RegionModel(config.region)

    @property
    def capabilities(self) -> Capabilities:
        """Adapters on every linear of the decoder, fused decode products (over 16-bit weights
        or 4- and 8-bit ones alike), the FP8 tower. The FP8 tower is off when its linears are
        quantized too (it quantizes 16-bit weights)."""
        text, quantized = self.text, self.quantized
        return Capabilities(
            FORMATS,
            quantized=quantized,
            vision_quantized=self.vision_quantized,
            adapters=text,
            fused_products=text,
            fp8_vision=None if self.tower_quantized else self.vision,
        )
