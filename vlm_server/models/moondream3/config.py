"""Moondream 3 configuration: frozen dataclasses, the token contract and the named presets.

Moondream 3 keeps Moondream 2's vision tower, crops and image prefix; its decoder replaces the
dense MLP of every layer from ``moe.start_layer`` on with a mixture of experts, scales queries
and values per head ("tau"), and its region heads are one LayerNorm and single linear layers.
Presets:

* ``moondream3-preview`` and ``moondream3.1`` - full size (9.27B parameters, 64 experts, top-8);
  the two releases share architecture, templates and tokenizer: only their weights differ.
* ``md3-tiny`` - the same structure at toy size (two dense layers, two expert layers of eight
  small experts, top-3) over the project's small test vocabulary: CPU tests.
* ``moondream3`` and ``moondream3-tiny`` - short names of ``moondream3.1`` and ``md3-tiny``.

Where public implementations disagree (docs/moondream3.md), `DisputedPoints` holds the decision;
the defaults follow the model author's engine, and a parity test against another
implementation selects that one's behaviour with `with_choices`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from vlm_server.models.common.config import RegionConfig, VisionConfig
from vlm_server.models.common.contracts import CONTRACT_TINY
from vlm_server.models.contract import PromptTemplates, TokenContract
from vlm_server.models.interface import Formats

# Weights in any of --dtype's formats (an FP8-expert checkpoint's experts stay FP8 where the
# device runs them, loader.py), every block linear, experts included, also in 8 or 4 bits
# (--weights); KV pages in the weights' (activations') dtype.
FORMATS = Formats(
    weights=("bf16", "fp16", "fp32"),
    kv=("bf16", "fp16", "fp32", "fp8", "int8"),
    quantized=("int8", "int4"),
    vision_quantized=("int8", "int4"),
    fp8_experts=True,
)

TauGelu = Literal["tanh", "erf"]
TauPositions = Literal["fp32", "bf16", "activations"]
RegionNorm = Literal["raw", "post_ln", "none"]


@dataclass(frozen=True)
class DisputedPoints:
    """Behaviour where the sources disagree (defaults: the model author's engine).

    * ``tau_gelu``: the GELU over the fused projection that feeds the tau scales, ``tanh``
      (author's engine) or exact ``erf`` (the Hugging Face code and its ports).
    * ``tau_positions``: the tau position term computed in ``fp32`` (author's engine); from
      positions cast to the activations' dtype first, and the term computed in it
      (``activations``: the Hugging Face and vLLM code, so bf16 rounding in bf16 runs and
      none in fp32 runs); or in bf16 whatever the activations (``bf16``: the published
      code's bf16 behaviour in any run).
    * ``region_norm``: the region LayerNorm applied to the raw residual stream (``raw``,
      author's engine), to the final-normed state (``post_ln``, vLLM), or absent (``none``,
      checkpoints and ports without ``region.ln``).
    * ``coord_divisor``: a coordinate bin b decodes to b / 1023 (author's engine) or b / 1024.
    The context length is `TextConfig.max_context` (32768 author's engine, 4096 elsewhere).
    """

    tau_gelu: TauGelu = "tanh"
    tau_positions: TauPositions = "fp32"
    region_norm: RegionNorm = "raw"
    coord_divisor: int = 1023

    def __post_init__(self) -> None:
        if self.tau_gelu not in ("tanh", "erf"):
            raise ValueError(f"tau_gelu must be 'tanh' or 'erf', not {self.tau_gelu!r}")
        if self.tau_positions not in ("fp32", "bf16", "activations"):
            raise ValueError(
                f"tau_positions must be fp32, bf16 or activations, not {self.tau_positions!r}"
            )
        if self.region_norm not in ("raw", "post_ln", "none"):
            raise ValueError(f"region_norm must be raw, post_ln or none, not {self.region_norm!r}")
        if self.coord_divisor not in (1023, 1024):
            raise ValueError(f"coord_divisor must be 1023 or 1024, not {self.coord_divisor!r}")


# What the Hugging Face remote code (and the ports derived from it) does.
HF_CHOICES = DisputedPoints(
    tau_gelu="erf", tau_positions="activations", region_norm="none", coord_divisor=1024
)


@dataclass(frozen=True)
class MoeConfig:
    """The expert layers: ``start_layer`` and every later layer route each token to ``top_k``
    of ``n_experts`` experts of width ``expert_dim`` (fc1 writes 2 x expert_dim)."""

    start_layer: int = 4
    n_experts: int = 64
    top_k: int = 8
    expert_dim: int = 1024

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError("moe top_k must be between 1 and n_experts")


@dataclass(frozen=True)
class TextConfig:
    """Parallel attention + MLP on one LayerNorm per block; tau-scaled queries and values."""

    dim: int = 2048
    n_layers: int = 24
    n_heads: int = 32
    n_kv_heads: int = 32
    ff_dim: int = 8192  # the dense layers' MLP
    vocab_size: int = 51200
    max_context: int = 32768
    rotary_dim: int = 32
    rope_theta: float = 1.5e6
    moe: MoeConfig = field(default_factory=MoeConfig)

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError("text dim must be divisible by n_heads")
        if self.n_heads % self.n_kv_heads:
            raise ValueError("text n_heads must be a multiple of n_kv_heads")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError("text rotary_dim must be even and at most head_dim")
        if not 0 <= self.moe.start_layer <= self.n_layers:
            raise ValueError("moe start_layer must lie within the decoder's layers")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def qkv_dim(self) -> int:
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    def is_moe(self, layer: int) -> bool:
        return layer >= self.moe.start_layer


@dataclass(frozen=True)
class ModelConfig:
    """Everything needed to build a Moondream 3 model and speak its token contract."""

    name: str
    vision: VisionConfig = field(default_factory=VisionConfig)
    text: TextConfig = field(default_factory=TextConfig)
    region: RegionConfig = field(default_factory=RegionConfig)
    tokens: TokenContract = field(kw_only=True)  # every configuration speaks one
    choices: DisputedPoints = field(default_factory=DisputedPoints)
    tokenizer_vocab_size: int = 51200

    def __post_init__(self) -> None:
        if self.vision.proj_out_dim != self.text.dim or self.region.dim != self.text.dim:
            raise ValueError("vision proj_out_dim and region dim must equal text dim")
        if self.tokenizer_vocab_size > self.text.vocab_size:
            raise ValueError("tokenizer_vocab_size exceeds the model's vocab_size")
        if self.tokens.coord_divisor != self.choices.coord_divisor:
            raise ValueError(
                "the token contract's coord_divisor must equal choices.coord_divisor "
                "(build variants with with_choices)"
            )

    @property
    def image_prefix_len(self) -> int:
        """BOS + one embedding per patch of the global grid (730)."""
        return 1 + self.vision.n_patches

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Inverse of `to_dict`; lists become tuples again."""
        tok = dict(data["tokens"])
        tpl = {k: (tuple(v) if isinstance(v, list) else v) for k, v in tok.pop("templates").items()}
        tok["decode_suppressed_ids"] = tuple(tok.get("decode_suppressed_ids", ()))
        reasoning = tok.get("reasoning_suppressed_ids")
        tok["reasoning_suppressed_ids"] = None if reasoning is None else tuple(reasoning)
        # A file written before the field existed: the family's rule.
        tok.setdefault("object_boundary", "coord_or_eos")
        text = dict(data["text"])
        text["moe"] = MoeConfig(**text["moe"])
        return cls(
            name=data["name"],
            vision=VisionConfig(**data["vision"]),
            text=TextConfig(**text),
            region=RegionConfig(**data["region"]),
            tokens=TokenContract(templates=PromptTemplates(**tpl), **tok),
            choices=DisputedPoints(**data["choices"]),
            tokenizer_vocab_size=data["tokenizer_vocab_size"],
        )


def with_choices(
    config: ModelConfig, choices: DisputedPoints, max_context: int | None = None
) -> ModelConfig:
    """``config`` with other disputed-point choices (and context length), the token contract's
    coordinate divisor kept in step."""
    text = config.text
    if max_context is not None:
        text = dataclasses.replace(text, max_context=max_context)
    tokens = dataclasses.replace(config.tokens, coord_divisor=choices.coord_divisor)
    return dataclasses.replace(config, text=text, tokens=tokens, choices=choices)


# ---- token contracts -------------------------------------------------------------------

# Templates of the author's engine: a single answer marker (3) closes every prompt; a query
# with reasoning ends on the thinking marker (4) instead. Caption lengths: 12492 short,
# 6382 normal, 4059 long; 32708 "describe", 15381 "query", 7235 476 detect, 2581 point,
# 17374 segment (its object without a leading space; its path one SVG item per token).
CONTRACT_MD3 = TokenContract(
    name="moondream3",
    bos_id=0,
    eos_id=0,
    templates=PromptTemplates(
        caption_short=(1, 32708, 2, 12492, 3),
        caption_normal=(1, 32708, 2, 6382, 3),
        caption_long=(1, 32708, 2, 4059, 3),
        query_prefix=(1, 15381, 2),
        query_suffix=(3,),
        reasoning_suffix=(4,),
        detect_prefix=(1, 7235, 476, 2),
        detect_suffix=(3,),
        point_prefix=(1, 2581, 2),
        point_suffix=(3,),
        segment_prefix=(1, 17374, 2),
        segment_suffix=(3,),
        question_leading_space=False,
        object_leading_space=True,
        segment_object_leading_space=False,
    ),
    size_scale="log",
    coord_id=5,
    size_id=6,
    answer_id=3,
    # As the published code does (docs/moondream3.md): the answer marker is masked on answer
    # steps after the first; eos and the size token on reasoning steps after the first.
    decode_suppressed_ids=(3,),
    coord_divisor=1023,
    thinking_id=4,
    start_ground_points_id=7,
    end_ground_id=9,
    reasoning_suppressed_ids=(0, 6),
    segment_language="svg_tokens",
    object_boundary="coord_or_eos",
)

# The tiny test vocabulary's ids (Moondream 2's tiny contract) under Moondream 3's rules.
CONTRACT_MD3_TINY = dataclasses.replace(
    CONTRACT_TINY,
    name="md3-tiny",
    templates=dataclasses.replace(
        CONTRACT_TINY.templates,
        query_suffix=(3,),
        reasoning_suffix=(CONTRACT_TINY.thinking_id,),
        segment_object_leading_space=False,
    ),
    decode_suppressed_ids=(CONTRACT_TINY.answer_id,),
    coord_divisor=1023,
    reasoning_suppressed_ids=(CONTRACT_TINY.eos_id, CONTRACT_TINY.size_id),
    segment_language="svg_tokens",
    object_boundary="coord_or_eos",
)

# ---- presets ---------------------------------------------------------------------------


def _full(name: str) -> ModelConfig:
    return ModelConfig(name=name, tokens=CONTRACT_MD3)


def _tiny() -> ModelConfig:
    return ModelConfig(
        name="md3-tiny",
        vision=VisionConfig(
            enc_dim=64,
            enc_n_layers=2,
            enc_n_heads=4,
            enc_ff_dim=128,
            proj_inner_dim=128,
            proj_out_dim=64,
        ),
        text=TextConfig(
            dim=64,
            n_layers=4,
            n_heads=4,
            n_kv_heads=4,
            ff_dim=256,
            vocab_size=1024,
            max_context=2048,
            rotary_dim=8,
            moe=MoeConfig(start_layer=2, n_experts=8, top_k=3, expert_dim=32),
        ),
        region=RegionConfig(dim=64, coord_feat_dim=32, size_feat_dim=64),
        tokens=CONTRACT_MD3_TINY,
        tokenizer_vocab_size=1000,
    )


PRESETS: dict[str, Any] = {
    "moondream3-preview": lambda: _full("moondream3-preview"),
    "moondream3.1": lambda: _full("moondream3.1"),
    "md3-tiny": _tiny,
    # Short names: the current release, and the tiny one.
    "moondream3": lambda: _full("moondream3.1"),
    "moondream3-tiny": _tiny,
}


def preset(name: str) -> ModelConfig:
    """Return the named preset configuration."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None
