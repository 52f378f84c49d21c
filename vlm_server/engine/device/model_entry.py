"""The model's entry points: every call the device runtime makes into the model, in one place.

The runtime's parts never reach into the model object. They embed tokens, run the text
decoder over the paged KV cache (whose attention kernels need its rotary tables and head
count), take logits, turn an image's crops into its BOS + image prefix, encode and decode
region values, size the KV cache and their buffers from the model's shapes, and switch the
vision tower to FP8, all through `ModelEntryPoints`, over any family's `DeviceModel`
(models/interface.py). What a family may lack (adapters, fused products, FP8 parts) comes from
the capabilities it declares, never from probing the model.

Shapes are read once, at construction; weights and rotary tables are read from the model at
every call, so a graph captures whatever the model holds then.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from decoding.region_values import coord_from_logits, size_from_logits
from image_pipeline import normalize_crops
from vlm_server.chip_features import fp8_supported
from vlm_server.engine.core.memory_plan import kv_format_of, kv_page_bytes
from vlm_server.models.capabilities import need
from vlm_server.models.kv import kv_storage_dtype

# The activations' dtypes by KV format name (memory_plan.py `KV_FORMATS`).
ACTIVATION_FORMATS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

if TYPE_CHECKING:
    from vlm_server.models.interface import DeviceModel
    from vlm_server.models.kv import KVCache
    from vlm_server.models.lora.bank import LoraBatch
    from vlm_server.models.lora.spec import LoraTargets


def fp8_activations_choice(asked: bool | None, experts_fp8: bool, cuda: bool) -> tuple[bool, str]:
    """``experts_fp8_activations`` resolved: as asked, or for None (auto) on where the experts
    are held in FP8 on CUDA, as FP8 models are served (FP8 x FP8 wide products; measured on an
    H100 with Moondream 3: unique c=64 49.2 -> 56.3 req/s, c=1 38.4 -> 34.6 ms). Returns the
    choice and why, for the start-up log."""
    if asked is not None:
        return asked, "as asked"
    if not experts_fp8:
        return False, "auto: off, the experts are not in FP8"
    if not cuda:
        return False, "auto: off, the fused FP8 kernels run on CUDA only"
    return True, "auto: on, the experts are in FP8"


def fp8_vision_choice(
    asked: bool | None, experts_fp8: bool, fp8_units: bool, vision_exact: bool, tower: bool
) -> tuple[bool, str]:
    """``vision_fp8`` resolved: as asked, or for None (auto) on for an FP8 build (experts held
    in FP8) on a chip with FP8 units whose tower has FP8 products and exact weights, as FP8
    models are served (measured on an H100, moondream2: 9 crops 12.6 -> 10.5 ms, unique c=64
    56.4 -> 64.2 req/s). Returns the choice and why, for the start-up log."""
    if asked is not None:
        return asked, "as asked"
    if not experts_fp8:
        return False, "auto: off, the experts are not in FP8 (an exact build keeps an exact tower)"
    if not fp8_units:
        return False, "auto: off, no FP8 matrix units here"
    if not tower:
        return False, "auto: off, the model's tower has no FP8 products"
    if not vision_exact:
        return False, "auto: off, --vision-weights quantizes the tower instead"
    return True, "auto: on, an FP8 build on a chip with FP8 units"


class ModelEntryPoints:
    """What the runtime calls on a model."""

    def __init__(self, model: DeviceModel) -> None:
        self._model = model
        self._caps = model.capabilities
        cfg = model.config
        text, vision = cfg.text, cfg.vision
        self.dtype: torch.dtype = model.dtype
        self.device: torch.device = model.device
        self.dim = text.dim  # hidden size: input embeddings and hidden states
        self.n_heads = model.n_heads  # query heads, for the attention kernels
        self.fused_attention = model.fused_attention  # calls attend_packed: the CUDA kernels
        self.max_context = text.max_context  # positions a sequence may reach
        self.image_prefix_len = cfg.image_prefix_len  # BOS + image positions
        # One crop as the image path takes it: uint8 [crop_size, crop_size, channels].
        self.crop_shape = (vision.crop_size, vision.crop_size, vision.in_channels)
        self.max_crops = vision.max_crops  # local crops of the largest tiling
        kv = self._kv = model.kv_shape
        self._kv_per_layer = (kv.n_kv_heads, kv.head_dim)  # per position, keys or values
        self._n_layers = kv.n_layers
        self._contract = cfg.tokens  # the size bins' scale
        # The token that grounds reasoning with a coordinate (-1: the era has none).
        coord_id = cfg.tokens.coord_id
        self.coord_id = -1 if coord_id is None else coord_id
        self.vocab_size = text.vocab_size  # prompt ids past it are spatial-reference slots

    # ---- the KV cache's shape -------------------------------------------------------------

    def kv_shape(self, n_pages: int, page_size: int) -> tuple[int, ...]:
        """Every layer's keys and values of ``n_pages`` pages, as one tensor:
        [2 (keys, values), layers, pages, page_size, kv heads, head dim]."""
        return (2, self._n_layers, n_pages, page_size, *self._kv_per_layer)

    def kv_format(self, kv_dtype: str) -> str:
        """The KV format (memory_plan.py `KV_FORMATS`) of ``kv_dtype`` with this model's
        activations (auto: theirs)."""
        return kv_format_of(kv_dtype, ACTIVATION_FORMATS[self.dtype])

    def kv_storage(self, kv_format: str) -> torch.dtype:
        """The element type of KV pages in ``kv_format``."""
        return kv_storage_dtype(kv_format, self.dtype)

    def kv_page_bytes(self, page_size: int, kv_format: str = "auto") -> int:
        """Bytes of one page of every layer's keys and values in ``kv_format`` (auto: the
        activations' dtype), scales included: the memory plan's rule."""
        return kv_page_bytes(self._kv, page_size, self.kv_format(kv_format))

    # ---- text -----------------------------------------------------------------------------

    @property
    def rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables (cos, sin) [max_context, rotary_dim / 2], fp32: the attention
        kernels rotate queries and keys with them as they write the KV cache."""
        text = self._model.text
        return text.rope_cos, text.rope_sin

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids -> input embeddings [..., dim]."""
        return self._model.text.embed(ids)

    def text_forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv: KVCache,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """The text decoder over input embeddings ``x`` [B, T, dim] at ``positions`` [B, T],
        reading and writing keys and values through ``kv``: hidden [B, T, dim] (pre-norm).
        ``lora``: each token's adapter (only for a family that takes adapters)."""
        if lora is None:
            return self._model.text(x, positions, kv)
        decoder = need(self._caps.adapters, "adapters_dir", self._model)
        return decoder(x, positions, kv, lora)

    @property
    def lora_targets(self) -> LoraTargets | None:
        """The decoder's adapter targets, or None: the family takes no adapters."""
        adapters = self._caps.adapters
        return None if adapters is None else adapters.lora_targets

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden [..., dim] -> fp32 logits [..., vocab]."""
        return self._model.text.logits(hidden)

    # ---- images ---------------------------------------------------------------------------

    def vision_encode(self, x: torch.Tensor) -> torch.Tensor:
        """The vision tower alone: normalized crops [N, C, S, S] -> patch features."""
        return self._model.vision.encode(x)

    def image_prefix(self, crops: torch.Tensor, tiling: tuple[int, int]) -> torch.Tensor:
        """uint8 crops of one image [1 + h*w, S, S, C] -> BOS + image embeddings
        [1, image_prefix_len, dim]: normalize, vision tower, projection, BOS in front."""
        m = self._model
        x = normalize_crops(crops, self.dtype)
        return m.prefix_embeddings(m.image_embeddings(x, tiling))

    def use_fused_decode(self, enabled: bool) -> bool:
        """Switch the decoder's few-row forwards to fused products where the family has them
        (before any graph captures them); returns whether they are on."""
        products = self._caps.fused_products
        return products is not None and products.use_fused_products(enabled)

    def use_fp8_vision(self) -> None:
        """Switch the vision tower's matmuls to FP8 (before any graph captures it)."""
        if not fp8_supported(self.device):
            raise ValueError(
                "vision_fp8 needs a CUDA device with FP8 matrix units (compute capability "
                f"8.9 or newer); the model is on {self.device}"
            )
        need(self._caps.fp8_vision, "vision_fp8", self._model).use_fp8()

    def wants_fp8_vision(self, asked: bool | None, vision_weights: str) -> tuple[bool, str]:
        """Whether the vision tower runs FP8 products for the setting ``asked`` (None: auto),
        and why in words; see `fp8_vision_choice`."""
        experts = self._caps.fp8_experts
        held = experts is not None and experts.experts_in_fp8
        tower = self._caps.fp8_vision is not None
        return fp8_vision_choice(
            asked, held, fp8_supported(self.device), vision_weights == "exact", tower
        )

    def wants_fp8_expert_activations(self, asked: bool | None) -> tuple[bool, str]:
        """Whether wide steps' expert products take FP8 activations for the setting ``asked``
        (None: auto), and why in words; see `fp8_activations_choice`."""
        experts = self._caps.fp8_experts
        held = experts is not None and experts.experts_in_fp8
        return fp8_activations_choice(asked, held, self.device.type == "cuda")

    def use_fp8_expert_activations(self) -> None:
        """Switch wide steps' expert products to FP8 activations (before any graph captures
        the decoder); refused for a model without FP8 experts."""
        experts = need(self._caps.fp8_experts, "experts_fp8_activations", self._model)
        experts.use_fp8_activations()

    # ---- regions --------------------------------------------------------------------------

    def decode_coord(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden [B, dim] -> coordinate [B, 1] in [0, 1]."""
        divisor = self._contract.coord_divisor
        return coord_from_logits(self._model.region.decode_coord(hidden), divisor)

    def decode_size(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden [B, dim] -> (width, height) [B, 2]."""
        scale = self._contract.size_scale
        return size_from_logits(self._model.region.decode_size(hidden), scale)

    def encode_coord(self, coord: torch.Tensor) -> torch.Tensor:
        """Coordinate [B, 1] -> the next input embedding [B, dim]."""
        return self._model.region.encode_coord(coord)

    def encode_size(self, size: torch.Tensor) -> torch.Tensor:
        """(width, height) [B, 2] -> the next input embedding [B, dim]."""
        return self._model.region.encode_size(size)
