"""Read a config.json in the moondream reference's own format into a `ModelConfig`.

That format has up to four sections, `text`, `vision`, `region` and `tokenizer`, each a flat
dict of the reference's config fields; a missing section or key takes the reference's default
(its current release). What the file cannot say comes from the token era, told apart by the
eos id (0: the 2025-06 contract; anything else: the GPT-2-era contract), or from the preset
when one is named: size-bin scale, question spacing, suppressed ids, segment templates.

Behaviour of the reference code this follows: the rotary embedding covers half of each head
(`dim / (2 * n_heads)` frequencies); the 2025-06 query appends its suffix twice.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vlm_server.models.checkpoint_io import CheckpointError
from vlm_server.models.moondream2.config import (
    CONTRACT_2025_06,
    CONTRACT_GPT2_LINEAR,
    ModelConfig,
    PromptTemplates,
    RegionConfig,
    TextConfig,
    VisionConfig,
    preset,
)

SECTIONS = ("text", "vision", "region", "tokenizer")

# The reference's defaults (current release) for keys a file leaves out.
_TEXT = {"dim": 2048, "ff_dim": 8192, "n_layers": 24, "vocab_size": 51200, "max_context": 2048}
_TEXT |= {"n_heads": 32, "n_kv_heads": None, "prefix_attn": 730, "group_size": None}
_VISION = {"enc_dim": 1152, "enc_patch_size": 14, "enc_n_layers": 27, "enc_ff_dim": 4304}
_VISION |= {"enc_n_heads": 16, "proj_out_dim": 2048, "crop_size": 378, "in_channels": 3}
_VISION |= {"max_crops": 12, "overlap_margin": 4, "proj_inner_dim": 8192}
_REGION = {"dim": 2048, "coord_feat_dim": 256, "coord_out_dim": 1024, "size_feat_dim": 512}
_REGION |= {"size_out_dim": 2048, "inner_dim": 8192, "group_size": None}
_TOKENIZER = {"bos_id": 0, "eos_id": 0, "answer_id": 3, "thinking_id": 4, "coord_id": 5}
_TOKENIZER |= {"size_id": 6, "start_ground_points_id": 7, "end_ground_id": 9, "templates": None}


def is_moondream_format(data: dict[str, Any]) -> bool:
    """Whether a parsed config.json is in the reference's format (sections, nothing else)."""
    return bool(data) and set(data) <= set(SECTIONS)


def _section(data: dict[str, Any], name: str, defaults: dict[str, Any]) -> dict[str, Any]:
    given = data.get(name) or {}
    if not isinstance(given, dict):
        raise CheckpointError(f"config.json: section {name!r} must be an object")
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise CheckpointError(f"config.json: unknown keys in {name!r}: {', '.join(unknown)}")
    return defaults | given


def _ids(value: object, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(i, int) for i in value):
        raise CheckpointError(f"config.json: tokenizer.templates.{where} must be a list of ids")
    return tuple(value)


def _templates(
    raw: object, base: PromptTemplates, double_query_suffix: bool, thinking_id: int | None
) -> PromptTemplates:
    if raw is None:
        return base
    if not isinstance(raw, dict):
        raise CheckpointError("config.json: tokenizer.templates must be an object")
    fields: dict[str, Any] = {}
    caption = raw.get("caption")
    if isinstance(caption, dict):
        for length in ("short", "normal", "long"):
            if length in caption:
                fields[f"caption_{length}"] = _ids(caption[length], f"caption.{length}")
    for task in ("query", "detect", "point"):
        entry = raw.get(task)
        if isinstance(entry, dict):
            fields[f"{task}_prefix"] = _ids(entry.get("prefix"), f"{task}.prefix")
            suffix = _ids(entry.get("suffix"), f"{task}.suffix")
            fields[f"{task}_suffix"] = (
                suffix * 2 if task == "query" and double_query_suffix else suffix
            )
            if task == "query" and thinking_id is not None:
                fields["reasoning_suffix"] = (*suffix, thinking_id)
    return dataclasses.replace(base, **fields)


def from_moondream_dict(data: dict[str, Any], preset_name: str | None = None) -> ModelConfig:
    """`ModelConfig` of a reference-format config (CheckpointError naming what is wrong)."""
    text = _section(data, "text", _TEXT)
    vision = _section(data, "vision", _VISION)
    region = _section(data, "region", _REGION)
    tok = _section(data, "tokenizer", _TOKENIZER)
    if text["group_size"] is not None or region["group_size"] is not None:
        raise CheckpointError("config.json: int4 checkpoints (group_size) are not supported")
    base = preset(preset_name) if preset_name else None
    if base is not None:
        contract = base.tokens
    else:
        contract = CONTRACT_2025_06 if tok["eos_id"] == 0 else CONTRACT_GPT2_LINEAR
    starmie = contract.coord_id is not None
    try:
        heads = text["n_heads"]
        text_cfg = TextConfig(
            dim=text["dim"],
            n_layers=text["n_layers"],
            n_heads=heads,
            n_kv_heads=text["n_kv_heads"] or heads,
            ff_dim=text["ff_dim"],
            vocab_size=text["vocab_size"],
            max_context=text["max_context"],
            rotary_dim=text["dim"] // heads // 2,
        )
        vision_cfg = VisionConfig(
            enc_dim=vision["enc_dim"],
            enc_n_layers=vision["enc_n_layers"],
            enc_n_heads=vision["enc_n_heads"],
            enc_ff_dim=vision["enc_ff_dim"],
            in_channels=vision["in_channels"],
            crop_size=vision["crop_size"],
            patch_size=vision["enc_patch_size"],
            overlap_margin=vision["overlap_margin"],
            max_crops=vision["max_crops"],
            proj_inner_dim=vision["proj_inner_dim"],
            proj_out_dim=vision["proj_out_dim"],
        )
        region_cfg = RegionConfig(**{k: v for k, v in region.items() if k != "group_size"})
        ids = {k: tok[k] for k in ("bos_id", "eos_id")}
        if starmie:
            ids |= {k: tok[k] for k in ("coord_id", "size_id", "answer_id", "thinking_id")}
            ids |= {k: tok[k] for k in ("start_ground_points_id", "end_ground_id")}
            ids["decode_suppressed_ids"] = (tok["answer_id"],)
        tokens = dataclasses.replace(
            contract,
            name=f"{contract.name} (config.json)",
            templates=_templates(
                tok["templates"],
                contract.templates,
                starmie,
                tok["thinking_id"] if starmie else None,
            ),
            **ids,
        )
        prefix = 1 + vision_cfg.n_patches
        if text["prefix_attn"] != prefix:
            raise ValueError(f"text.prefix_attn is {text['prefix_attn']}, the image needs {prefix}")
        return ModelConfig(
            name=preset_name or "moondream (config.json)",
            vision=vision_cfg,
            text=text_cfg,
            region=region_cfg,
            tokens=tokens,
            tokenizer_vocab_size=min(
                base.tokenizer_vocab_size if base else text_cfg.vocab_size, text_cfg.vocab_size
            ),
        )
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"config.json: {err}") from err


__all__ = ["SECTIONS", "from_moondream_dict", "is_moondream_format"]
