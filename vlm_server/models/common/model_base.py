"""What both Moondream families' whole models share: a shared vision tower, a decoder with an
input embedding table, BOS in front of the image, and the shapes the engine reads."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from vlm_server.models.common.vision import VisionEncoder
from vlm_server.models.common.vision_quant import quantize_tower
from vlm_server.models.contract import TokenContract
from vlm_server.models.interface import KVShape, QuantizedWeights
from vlm_server.models.quant.formats import QuantFormat


class DecoderShape(Protocol):
    @property
    def n_layers(self) -> int: ...

    @property
    def n_heads(self) -> int: ...

    @property
    def n_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...


class MoondreamConfig(Protocol):
    @property
    def text(self) -> DecoderShape: ...

    @property
    def tokens(self) -> TokenContract: ...


class Embedded(Protocol):
    wte: torch.Tensor  # [vocab, D]


class MoondreamBase(nn.Module):
    """The `DeviceModel` members both families compute alike; a family sets ``config``,
    ``vision``, ``text`` and ``region``."""

    config: MoondreamConfig
    vision: VisionEncoder
    text: Embedded
    # Its weights held in 4 or 8 bits (models/common/quant_load.py sets it); None: none.
    quantized: QuantizedWeights | None = None
    # The vision tower's linears quantized at load (`quantize_vision`); None: none.
    vision_quantized: QuantizedWeights | None = None

    def quantize_vision(self, fmt: QuantFormat) -> None:
        """Hold the vision tower's block linears in ``fmt`` from now on (``--vision-weights``),
        quantized from its loaded 16-bit weights: after loading, before the FP8 tower or any
        graph is made of it."""
        if self.vision_quantized is not None or (
            self.quantized is not None and self.quantized.vision
        ):
            raise ValueError("the vision tower is held quantized already")
        self.vision_quantized = quantize_tower(self.vision.blocks, fmt, "vision.blocks")

    @property
    def tower_quantized(self) -> bool:
        """Whether any of the tower's linears is held in 4 or 8 bits (loaded so, or quantized
        at load): the FP8 tower, which quantizes 16-bit weights, is not offered then."""
        stored = self.quantized is not None and self.quantized.vision
        return stored or self.vision_quantized is not None

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
        # Both decoders hand the cache their packed Q | K | V (common/attention.py) and rotate
        # by their own tables: the engine's CUDA kernels serve them.
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
