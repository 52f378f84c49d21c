"""Model configuration: frozen dataclasses and the named presets.

Every shape, special id and prompt template lives here; model and decode code read them from a
`ModelConfig` and never hard-code them. Presets:

* ``moondream2`` - full size, the 2025-06 token contract (bos = eos = 0, explicit coord/size ids,
  log-scale size bins). This is what the current moondream2 release expects.
* ``moondream2-2025-01-09`` - full size, the GPT-2-era contract of ``config_md2.json``
  (bos = eos = 50256, linear size bins).
* ``moondream2-2025-04-14`` - full size, GPT-2-era ids with log-scale size bins (the 2025-03-27
  and 2025-04-14 revisions).
* ``tiny`` - the same structure with small dimensions and the project's own small byte-level
  vocabulary: tests and the built-in default model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from vlm_server.models.common import config as shared
from vlm_server.models.common.config import VisionConfig
from vlm_server.models.common.contracts import CONTRACT_TINY, GPT2_EOS
from vlm_server.models.contract import PromptTemplates, TokenContract
from vlm_server.models.interface import Formats

# Weights in any of --dtype's formats, the decoder's linears also in 8 or 4 bits (--weights);
# KV pages in the weights' (activations') dtype.
FORMATS = Formats(
    weights=("bf16", "fp16", "fp32"),
    kv=("bf16", "fp16", "fp32", "fp8", "int8"),
    quantized=("int8", "int4"),
    vision_quantized=("int8", "int4"),
)


@dataclass(frozen=True)
class TextConfig:
    """Phi-style decoder: parallel attention + MLP on one LayerNorm per block."""

    dim: int = 2048
    n_layers: int = 24
    n_heads: int = 32
    n_kv_heads: int = 32
    ff_dim: int = 8192
    vocab_size: int = 51200
    max_context: int = 2048
    rotary_dim: int = 32
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError("text dim must be divisible by n_heads")
        if self.n_heads % self.n_kv_heads:
            raise ValueError("text n_heads must be a multiple of n_kv_heads")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError("text rotary_dim must be even and at most head_dim")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@dataclass(frozen=True)
class RegionConfig(shared.RegionConfig):
    """Coordinate and size heads (Fourier-feature encoders, MLP decoders)."""

    inner_dim: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Everything needed to build the model and speak its token contract."""

    name: str
    vision: VisionConfig = field(default_factory=VisionConfig)
    text: TextConfig = field(default_factory=TextConfig)
    region: RegionConfig = field(default_factory=RegionConfig)
    tokens: TokenContract = field(kw_only=True)  # every configuration speaks one
    # Size of the tokenizer the checkpoint writer builds (<= text.vocab_size; the model's
    # vocabulary may be padded beyond the tokenizer).
    tokenizer_vocab_size: int = 50257

    def __post_init__(self) -> None:
        if self.vision.proj_out_dim != self.text.dim or self.region.dim != self.text.dim:
            raise ValueError("vision proj_out_dim and region dim must equal text dim")
        if self.tokenizer_vocab_size > self.text.vocab_size:
            raise ValueError("tokenizer_vocab_size exceeds the model's vocab_size")
        ids = [
            self.tokens.bos_id,
            self.tokens.eos_id,
            self.tokens.coord_id,
            self.tokens.size_id,
            self.tokens.answer_id,
        ]
        bad = [i for i in ids if i is not None and not 0 <= i < self.text.vocab_size]
        if bad:
            raise ValueError(f"special ids {bad} are outside the vocabulary")

    @property
    def image_prefix_len(self) -> int:
        """BOS + one embedding per patch of the global grid (730 for moondream2)."""
        return 1 + self.vision.n_patches

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Inverse of `to_dict`; lists become tuples again."""
        tok = dict(data["tokens"])
        # Written by earlier versions; the boundary decision no longer depends on the contract.
        tok.pop("boundary_rule", None)
        tpl = {k: (tuple(v) if isinstance(v, list) else v) for k, v in tok.pop("templates").items()}
        tok["decode_suppressed_ids"] = tuple(tok.get("decode_suppressed_ids", ()))
        reasoning = tok.get("reasoning_suppressed_ids")
        tok["reasoning_suppressed_ids"] = None if reasoning is None else tuple(reasoning)
        return cls(
            name=data["name"],
            vision=VisionConfig(**data["vision"]),
            text=TextConfig(**data["text"]),
            region=RegionConfig(**data["region"]),
            tokens=TokenContract(templates=PromptTemplates(**tpl), **tok),
            tokenizer_vocab_size=data["tokenizer_vocab_size"],
        )


# ---- token contracts -------------------------------------------------------------------

_GPT2_TEMPLATES = PromptTemplates(
    caption_short=(198, 198, 16438, 8305, 25),
    caption_normal=(198, 198, 24334, 1159, 25),
    caption_long=(198, 198, 14617, 8305, 25),
    query_prefix=(198, 198, 24361, 25),
    query_suffix=(198, 198, 33706, 25),
    detect_prefix=(198, 198, 47504, 25),
    detect_suffix=(628,),
    point_prefix=(198, 198, 12727, 25),
    point_suffix=(628,),
    question_leading_space=True,
    object_leading_space=True,
)

CONTRACT_GPT2_LINEAR = TokenContract(
    name="gpt2-2025-01-09",
    bos_id=GPT2_EOS,
    eos_id=GPT2_EOS,
    templates=_GPT2_TEMPLATES,
    size_scale="linear",
)
CONTRACT_GPT2_LOG = dataclasses.replace(
    CONTRACT_GPT2_LINEAR, name="gpt2-2025-04-14", size_scale="log"
)

CONTRACT_2025_06 = TokenContract(
    name="2025-06",
    bos_id=0,
    eos_id=0,
    templates=PromptTemplates(
        caption_short=(1, 32708, 2, 12492, 3),
        caption_normal=(1, 32708, 2, 6382, 3),
        caption_long=(1, 32708, 2, 4059, 3),
        query_prefix=(1, 15381, 2),
        # The 2025-06 code appends the answer marker twice in non-reasoning mode.
        query_suffix=(3, 3),
        reasoning_suffix=(3, 4),
        detect_prefix=(1, 7235, 476, 2),
        detect_suffix=(3,),
        point_prefix=(1, 2581, 2),
        point_suffix=(3,),
        question_leading_space=False,
        object_leading_space=True,
    ),
    size_scale="log",
    coord_id=5,
    size_id=6,
    answer_id=3,
    decode_suppressed_ids=(3,),
    thinking_id=4,
    start_ground_points_id=7,
    end_ground_id=9,
)

# ---- presets ---------------------------------------------------------------------------


def _moondream2(name: str, tokens: TokenContract, tokenizer_vocab: int) -> ModelConfig:
    return ModelConfig(name=name, tokens=tokens, tokenizer_vocab_size=tokenizer_vocab)


def _tiny() -> ModelConfig:
    return ModelConfig(
        name="tiny",
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
            n_layers=2,
            n_heads=4,
            n_kv_heads=4,
            ff_dim=256,
            vocab_size=1024,
            max_context=2048,
            rotary_dim=8,
        ),
        region=RegionConfig(dim=64, coord_feat_dim=32, size_feat_dim=64, inner_dim=128),
        tokens=CONTRACT_TINY,
        tokenizer_vocab_size=1000,
    )


PRESETS: dict[str, Any] = {
    "moondream2": lambda: _moondream2("moondream2", CONTRACT_2025_06, 51200),
    "moondream2-2025-04-14": lambda: _moondream2(
        "moondream2-2025-04-14", CONTRACT_GPT2_LOG, GPT2_EOS + 1
    ),
    "moondream2-2025-01-09": lambda: _moondream2(
        "moondream2-2025-01-09", CONTRACT_GPT2_LINEAR, GPT2_EOS + 1
    ),
    "tiny": _tiny,
    # Tiny dimensions under the GPT-2-era contract: ids are valid in the model's padded vocab.
    "tiny-gpt2": lambda: dataclasses.replace(
        _tiny(),
        name="tiny-gpt2",
        tokens=CONTRACT_GPT2_LINEAR,
        text=dataclasses.replace(_tiny().text, vocab_size=51200),
    ),
}


def preset(name: str) -> ModelConfig:
    """Return the named preset configuration."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None
