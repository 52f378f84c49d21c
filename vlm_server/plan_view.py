"""The engine's memory plan for a model on a card (engine/core/memory_plan.py), as `vlm plan`
prints it and the server logs it at start: the model resolved from a preset or a checkpoint
directory (its config only), the plan, the verdict, and what would fit instead."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlm_server.chips import CHIPS, ChipSpec
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.memory_plan import (
    KV_MIN_CAPABILITY,
    WEIGHT_FORMATS,
    MemoryPlan,
    kv_format_of,
    plan_memory,
)
from vlm_server.models.interface import MemoryShape
from vlm_server.models.registry import checkpoint_config, memory_shape, preset, preset_names

# Short names of the default presets.
ALIASES = {"md2": "moondream2", "md3": "moondream3"}
GIB = 1 << 30


def model_shape(model: str, preset_name: str | None = None) -> tuple[str, MemoryShape]:
    """A preset (or its alias) or a checkpoint directory -> (its name, its `MemoryShape`);
    a directory's config.json is read, never its weights. ValueError naming ``model``."""
    name = ALIASES.get(model, model)
    if name in preset_names():
        return name, memory_shape(preset(name))
    path = Path(model)
    if not path.is_dir():
        raise ValueError(
            f"model: {model!r} is neither a preset ({', '.join([*ALIASES, *preset_names()])}) "
            "nor a checkpoint directory"
        )
    config = checkpoint_config(path, preset_name)
    return config.name, memory_shape(config)


def formats_for(shape: MemoryShape, card: ChipSpec | None) -> list[str]:
    """The weight formats ``shape``'s model can be served in (on ``card``, when named)."""
    out = []
    for name, fmt in WEIGHT_FORMATS.items():
        if fmt.experts_only and "experts" not in shape.params:
            continue
        if card is not None and card.capability < fmt.min_capability:
            continue
        out.append(name)
    return out


def check_format(
    shape: MemoryShape, weights: str, card: ChipSpec | None, kv_dtype: str = "auto"
) -> None:
    """ValueError naming ``weights`` (or ``kv_dtype``) when the model or the card cannot take
    that format."""
    fmt = WEIGHT_FORMATS.get(weights)
    if fmt is None:
        raise ValueError(f"weights: {weights!r} is not one of {', '.join(WEIGHT_FORMATS)}")
    if fmt.experts_only and "experts" not in shape.params:
        raise ValueError(f"weights: {weights} needs a mixture-of-experts model (Moondream 3)")
    if card is not None and card.capability < fmt.min_capability:
        need = ".".join(map(str, fmt.min_capability))
        have = ".".join(map(str, card.capability))
        raise ValueError(
            f"weights: {weights} needs compute capability {need}; the {card.name} has {have}"
        )
    kv = kv_format_of(kv_dtype, fmt.activation_dtype)
    if card is not None and card.capability < KV_MIN_CAPABILITY.get(kv, (0, 0)):
        need = ".".join(map(str, KV_MIN_CAPABILITY[kv]))
        have = ".".join(map(str, card.capability))
        raise ValueError(
            f"kv_dtype: {kv} needs compute capability {need}; the {card.name} has {have} "
            "(int8 keeps the same bytes)"
        )


@dataclass(frozen=True)
class Alternatives:
    """What would hold ``max_batch_size`` requests when the plan does not."""

    kv_budget_bytes: int | None  # a --kv-budget that fits this card, if any
    formats: list[str]  # other weight formats that fit this card
    cards: list[str]  # cards of the table that fit in this format


def fitting_plan(
    shape: MemoryShape, cfg: EngineConfig, card_bytes: int, weights: str, kv: str | None
) -> MemoryPlan:
    """The plan with the KV budget ``cfg.max_batch_size`` requests need."""
    plan = plan_memory(shape, cfg, card_bytes, weights, kv)
    sized = dataclasses.replace(cfg, kv_budget_bytes=plan.kv_needed_bytes)
    return plan_memory(shape, sized, card_bytes, weights, kv)


def alternatives(
    shape: MemoryShape,
    cfg: EngineConfig,
    card: ChipSpec,
    plan: MemoryPlan,
    kv: str | None = None,
) -> Alternatives:
    sized = fitting_plan(shape, cfg, card.memory_bytes, plan.weights_format, kv)
    budget = sized.kv_budget_bytes if sized.fits else None
    formats = [
        f
        for f in formats_for(shape, card)
        if f != plan.weights_format and fitting_plan(shape, cfg, card.memory_bytes, f, kv).fits
    ]
    cards = [
        c.name
        for c in CHIPS
        if c.name != card.name
        and c.capability >= WEIGHT_FORMATS[plan.weights_format].min_capability
        and c.capability >= KV_MIN_CAPABILITY.get(plan.kv_format, (0, 0))
        and fitting_plan(shape, cfg, c.memory_bytes, plan.weights_format, kv).fits
    ]
    return Alternatives(budget, formats, cards)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def verdict(plan: MemoryPlan) -> str:
    n = plan.max_batch_size
    if plan.fits:
        return f"fits: {n} concurrent picture requests ({plan.requests_held} at most)"
    if not plan.fits_memory:
        return (
            f"does not fit: needs {plan.needed_bytes} bytes ({_gib(plan.needed_bytes)}) for "
            f"{n} picture requests; the allocator may hold {_gib(plan.limit_bytes)}"
        )
    return (
        f"does not fit: {n} concurrent picture requests need {plan.kv_needed_bytes} bytes of "
        f"KV pages ({_gib(plan.kv_needed_bytes)}); the budget holds {plan.requests_held}"
    )


def _held_as(weights: str, part: str) -> str:
    """How ``part`` of the weights is held in format ``weights``: a 4- or 8-bit format holds
    the decoder's linears and expert stacks only."""
    fmt = WEIGHT_FORMATS[weights]
    if not fmt.linear_bits:
        return weights
    if part == "experts":
        return weights
    return f"{weights} linears, the rest {fmt.activation_dtype}" if part == "text" else "bf16"


def plan_lines(plan: MemoryPlan, model: str, device: str) -> list[str]:
    """The plan as a table of lines."""
    cap = f", capped at {_gib(plan.cap_bytes)}" if plan.cap_bytes else ""
    rows = [(f"device: {device}", plan.card_bytes, f"memory{cap}")]
    if plan.context_bytes:
        rows.append(("CUDA context", plan.context_bytes, "outside the allocator (estimate)"))
    for part, n in plan.weights.items():
        held = _held_as(plan.weights_format, part)
        if part == "vision" and plan.vision_weights != "exact":
            held = f"{plan.vision_weights} linears, the rest {held}"
        rows.append((f"weights: {part}", n, held))
    for name, n in plan.start_tensors.items():
        rows.append((name, n, "made at start, before the KV pool"))
    rows.append(
        (
            "KV pages",
            plan.kv_bytes,
            f"{plan.kv_pages} pages of {plan.page_size} positions ({plan.kv_format}, "
            f"{plan.page_bytes} bytes each); {plan.prefixes_held} picture prefixes, "
            f"{plan.requests_held} requests on pictures of their own, "
            f"{plan.requests_held_one_picture} on one picture",
        )
    )
    for name, n in plan.workspaces.items():
        rows.append((name, n, "estimate"))
    rows.append(("peak", plan.peak_bytes, "the allocator's, the context apart"))
    rows.append(("left", plan.left_bytes, ""))
    width = max(len(r[0]) for r in rows)
    lines = [f"memory plan of {model}"]
    lines += [f"  {label:<{width}}  {n / GIB:8.2f} GiB  {note}".rstrip() for label, n, note in rows]
    lines.append(verdict(plan))
    return lines


def plan_json(
    plan: MemoryPlan, model: str, device: str, alt: Alternatives | None
) -> dict[str, Any]:
    out: dict[str, Any] = {"model": model, "device": device}
    out |= {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if f.name != "notes"}
    for name in (
        "weight_bytes",
        "held_at_kv_sizing",
        "kv_bytes",
        "workspace_bytes",
        "peak_bytes",
        "left_bytes",
        "prefixes_held",
        "requests_held",
        "requests_held_one_picture",
        "kv_needed_bytes",
        "needed_bytes",
        "fits",
    ):
        out[name] = getattr(plan, name)
    if alt is not None:
        out["alternatives"] = dataclasses.asdict(alt)
    return out
