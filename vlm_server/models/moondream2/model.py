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
        """Adapters on every linear of the decoder, fused decode products, the FP8 tower."""
        text = self.text
        return Capabilities(FORMATS, adapters=text, fused_products=text, fp8_vision=self.vision)
