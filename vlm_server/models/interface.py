"""What the engine needs from a model family, as protocols: the seam every family plugs into.

The engine (runtime, scheduler, request builder) and the doors are typed against these and
never import a family's modules. A family's loaded model is a `DeviceModel`: a text decoder
that writes its keys and values through a `KVCache` (models/kv.py), a vision tower and
projection, and region heads; its configuration is a `FamilyConfig`.

Everything optional is declared, never probed: a model's `Capabilities` hold each optional
part it has (adapters, fused products, FP8 vision, FP8 experts, the segment refiner) as the
object that provides it, typed by its protocol here, the weight and KV formats it accepts, and
which of its weights it holds in 4 or 8 bits.
models/capabilities.py checks them once, at load, against what the flags ask.

Shapes: ``D`` the decoder width, ``H`` query heads, ``P`` image-prefix positions (BOS + one per
patch of the global grid).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:  # the torch-free engine core imports this module
    import numpy as np
    import torch
    from tokenizers import Tokenizer

    from decoding.segment_output import SegmentResult
    from vlm_server.models.contract import TokenContract
    from vlm_server.models.kv import KVCache
    from vlm_server.models.lora.spec import LoraDelta, LoraTargets


@dataclass(frozen=True)
class KVShape:
    """Keys and values per position: what a KV page holds, per layer."""

    n_layers: int
    n_kv_heads: int
    head_dim: int

    def page_bytes(self, page_size: int, itemsize: int, scale_bytes: int = 0) -> int:
        """Bytes of one page (keys and values of every layer): ``itemsize`` an element and
        ``scale_bytes`` per position and KV head (a compact format's scales)."""
        per_head = self.head_dim * itemsize + scale_bytes
        return 2 * self.n_layers * page_size * self.n_kv_heads * per_head


@dataclass(frozen=True)
class MemoryShape:
    """What the engine's memory plan (engine/core/memory_plan.py) reads of a model: its
    parameters by part and the widths of its work, known from the configuration alone."""

    params: dict[str, int]  # part ("text", "vision", "region", "experts") -> parameters
    expert_rows: int  # output rows of every expert stack (FP8 scales: one per row); 0: none
    kv: KVShape
    dim: int
    qkv_dim: int
    ff_dim: int
    vocab_size: int
    max_context: int
    prefix_len: int  # BOS + image positions
    enc_dim: int  # the vision tower's width, its MLP's, patches per crop, most local crops
    enc_ff_dim: int
    n_patches: int
    max_crops: int
    proj_inner_dim: int
    rotary_dim: int  # the decoder's rotary tables: fp32 [max_context, rotary_dim / 2], two
    enc_layers: int  # the vision tower's blocks (FP8 vision quantizes three products of each)
    top_k: int = 0  # experts per token (0: a dense model)
    expert_dim: int = 0
    # The decoder's linear weights ``--weights int8|int4`` holds quantized (within "text"):
    # their parameters and output rows (INT8 scales: one per row).
    linear_params: int = 0
    linear_rows: int = 0
    # Elements, in the weights' dtype, of the tensors the fused decode products derive at
    # start beside the weights they stack (FusedProducts: on CUDA with --fused-decode).
    fused_elements: int = 0
    # The vision tower's block linears ``--vision-weights int8|int4`` quantizes (within
    # "vision"): each one's [out, in].
    vision_linears: tuple[tuple[int, int], ...] = ()


class TextShape(Protocol):
    """The decoder sizes the engine reads."""

    vocab_size: int
    max_context: int
    dim: int  # D


class CropShape(Protocol):
    """The image path's geometry: the overlap-crop tiling reads it."""

    crop_size: int
    patch_size: int
    overlap_margin: int
    max_crops: int
    in_channels: int


class FamilyConfig(Protocol):
    """A family's configuration as the engine sees it."""

    name: str
    text: TextShape
    vision: CropShape
    tokens: TokenContract

    @property
    def image_prefix_len(self) -> int:
        """Positions of BOS + image (``P``)."""
        ...


class TextStack(Protocol):
    """The decoder: embeddings in, hidden states out, keys and values through the cache."""

    rope_cos: torch.Tensor  # [max_context, rotary_dim / 2] fp32, for fused rotary kernels
    rope_sin: torch.Tensor

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [...] -> embeddings [..., D]."""
        ...

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Embeddings [B, T, D] at positions [B, T] -> hidden states [B, T, D] (before the
        final norm: the region heads read them)."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [..., D] -> fp32 logits [..., vocab]."""
        ...


class VisionStack(Protocol):
    """The vision tower and its projection into the decoder's width."""

    def encode(self, crops: torch.Tensor) -> torch.Tensor:
        """Normalized crops [N, 3, S, S] -> patch features."""
        ...

    def project(self, features: torch.Tensor, tiling: tuple[int, int]) -> torch.Tensor:
        """One image's crop features -> its embeddings [P - 1, D]."""
        ...


class RegionHeads(Protocol):
    """Coordinate and size heads: hidden state -> value logits, value -> input embedding."""

    def encode_coord(self, x: torch.Tensor) -> torch.Tensor: ...

    def encode_size(self, wh: torch.Tensor) -> torch.Tensor: ...

    def decode_coord(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def decode_size(self, hidden: torch.Tensor) -> torch.Tensor: ...


# ---- capabilities: what a family may have, each as the protocol of the part that has it ----

# The dtypes weights may be loaded in (``--dtype`` names them).
WeightFormat = Literal["bf16", "fp16", "fp32"]
# What a KV page holds per element; today the engine stores keys and values in the weights'
# dtype, so a family names the weight dtypes its attention reads and writes.
KVFormat = Literal["bf16", "fp16", "fp32", "fp8", "int8"]
# The 4- and 8-bit weight formats (``--weights`` names them; docs/quantization.md).
QuantizedFormat = Literal["int8", "int4"]


@dataclass(frozen=True)
class Formats:
    """The weight and KV formats a family accepts (declared on its `ModelFamily`, known before
    anything loads, and on its models' `Capabilities`); ``quantized``: the 4- and 8-bit
    formats its decoder's linear layers can be served in; ``fp8_experts``: whether its
    experts can be held in FP8 (``--weights fp8``, where the chip has FP8 units);
    ``vision_quantized``: those its vision tower's linears can be quantized to at load
    (``--vision-weights``)."""

    weights: tuple[WeightFormat, ...]
    kv: tuple[KVFormat, ...]
    quantized: tuple[QuantizedFormat, ...] = ()
    fp8_experts: bool = False
    vision_quantized: tuple[QuantizedFormat, ...] = ()


@dataclass(frozen=True)
class QuantizedWeights:
    """What a loaded model holds in 4 or 8 bits: the format, its group (0: a scale per output
    channel), the quantized weights' names, and the family's targets left 16-bit (-> why)."""

    format: QuantizedFormat
    group_size: int
    weights: tuple[str, ...]
    kept: dict[str, str] = field(default_factory=dict)

    @property
    def vision(self) -> bool:
        """Whether the vision tower's linears are among them (a `vlm quantize --vision` file)."""
        return any(name.startswith("vision.") for name in self.weights)


class AdapterDecoder(Protocol):
    """A decoder that takes finetune adapters (models/lora/): their targets, and a forward
    that adds each token's adapter deltas."""

    @property
    def lora_targets(self) -> LoraTargets:
        """The layers an adapter adds to, with their widths (models/lora/spec.py)."""
        ...

    def __call__(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        lora: LoraDelta | None = None,
    ) -> torch.Tensor:
        """`TextStack.__call__`, plus ``lora``: the deltas of these tokens' adapters."""
        ...


class FusedProducts(Protocol):
    """A decoder whose few-row forwards (decode steps) can run fused matrix products."""

    def use_fused_products(self, enabled: bool = True) -> bool:
        """Switch them on or off (before any graph captures the decoder); whether they are on
        (only where their kernels run: CUDA with Triton)."""
        ...


class Fp8Vision(Protocol):
    """A vision tower whose matrix products can run in FP8."""

    def use_fp8(self, enabled: bool = True) -> None:
        """Quantize the tower's weights and switch its products to FP8, or back (after loading
        the weights, before any graph captures the tower)."""
        ...


class Fp8Experts(Protocol):
    """A mixture-of-experts model whose experts can be held, and multiplied, in FP8."""

    def use_fp8_experts(self) -> None:
        """Hold the expert weights in FP8 (ValueError where the device cannot run them)."""
        ...

    def use_fp8_activations(self) -> None:
        """Run wide steps' expert products with FP8 activations (ValueError unless the experts
        are FP8)."""
        ...

    @property
    def experts_in_fp8(self) -> bool:
        """Whether the expert weights are held in FP8 now (an FP8 checkpoint, or
        `use_fp8_experts`)."""
        ...


# The segment refiner's maker: its head's weights file -> the refiner (the engine only calls
# it), over the model's own vision tower; ValueError when the file does not fit.
SegmentRefinerMaker = Callable[[Path], "SegmentRefine"]


@dataclass(frozen=True)
class Capabilities:
    """What a loaded model has beyond the `DeviceModel` core: each optional part as the object
    that provides it (None: the family has none), the formats it accepts, and its weights held
    in 4 or 8 bits (None: none): ``quantized`` as loaded (``--weights``, or a ``vlm quantize``
    directory's), ``vision_quantized`` the tower's quantized at load (``--vision-weights``)."""

    formats: Formats
    quantized: QuantizedWeights | None = None
    vision_quantized: QuantizedWeights | None = None
    adapters: AdapterDecoder | None = None
    fused_products: FusedProducts | None = None
    fp8_vision: Fp8Vision | None = None
    fp8_experts: Fp8Experts | None = None
    segment_refiner: SegmentRefinerMaker | None = None


class DeviceModel(Protocol):
    """A loaded model, as the runtime and the reference generation drive it."""

    config: FamilyConfig
    text: TextStack
    vision: VisionStack
    region: RegionHeads

    @property
    def capabilities(self) -> Capabilities:
        """Its optional parts and formats, declared (models/capabilities.py checks them)."""
        ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def kv_shape(self) -> KVShape: ...

    @property
    def n_heads(self) -> int:
        """Query heads of the decoder's attention (fused attention kernels need it)."""
        ...

    @property
    def fused_attention(self) -> bool:
        """Whether the decoder hands the engine's caches its raw projection through
        ``cache.attend_packed(layer, qkv, positions)`` when they offer it: queries, keys and
        values packed in that order, rotary by `TextStack.rope_cos` / ``rope_sin`` (half-split,
        over the first dims of each head). The CUDA kernels need it; the CPU path does not."""
        ...

    def image_embeddings(self, crops: torch.Tensor, tiling: tuple[int, int]) -> torch.Tensor:
        """One image's normalized crops [1 + h*w, 3, S, S] -> its embeddings [P - 1, D]."""
        ...

    def prefix_embeddings(self, image_emb: torch.Tensor) -> torch.Tensor:
        """An image's embeddings [P - 1, D] -> BOS + image [1, P, D]."""
        ...


@dataclass
class LoadedModel:
    """A model ready to serve: weights on their device, tokenizer, configuration."""

    model: DeviceModel
    tokenizer: Tokenizer
    config: FamilyConfig
    source: str


# A family's segmentation refiner (registry.segment_refiner; the engine only calls it): upright
# RGB pixels [H, W, 3] uint8 and the decoded segment -> the refined one, or None to keep it.
SegmentRefine = Callable[["np.ndarray", "SegmentResult"], "SegmentResult | None"]
