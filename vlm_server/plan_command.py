"""``vlm plan``: the engine's own memory plan for a model on a card, without a GPU.

    vlm plan --gpu "RTX 3090" --model md3 [--weights fp8-experts] [--max-batch-size 64]

prints where the card's memory would go (weights by part, KV pages and the picture prefixes
and requests they hold, graph pools and workspaces, what is left), whether ``--max-batch-size``
concurrent picture requests fit, and, when they do not, the KV budget, formats and cards that
would hold them. Exit status 0 when they fit, 1 when not, 2 on bad input. The engine sizing
flags are the server's own (vlm serve --help)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from vlm_server.chips import ChipSpec, by_name
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.memory_plan import WEIGHT_FORMATS, plan_memory
from vlm_server.engine.core.weights_choice import (
    AUTO,
    PLAN_FORMATS,
    WeightsError,
    choose_weights,
)
from vlm_server.models.checkpoint_io import CheckpointError
from vlm_server.models.interface import MemoryShape
from vlm_server.models.quant.files import stored_format
from vlm_server.options.command_line import add_options, config_from
from vlm_server.options.table import OPTIONS
from vlm_server.plan_view import (
    alternatives,
    check_format,
    formats_for,
    model_shape,
    plan_json,
    plan_lines,
)

# The plan's formats --weights auto picks among (the activations' dtype is --dtype's).
_SERVED = ("bf16", "int8", "fp8-experts", "int4")

# The server's flags that change the plan.
PLAN_OPTIONS = (
    "preset",
    "max_batch_size",
    "max_step_tokens",
    "max_prefill_batch",
    "prefill_batches",
    "prefix_prompt_tokens",
    "kv_budget_bytes",
    "gpu_memory_bytes",
    "kv_dtype",
    "vision_weights",
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlm plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", required=True, help='the card, by name (e.g. "RTX 3090", H100)')
    parser.add_argument(
        "--model",
        default="md2",
        help="a preset (md2 and md3 name the default ones) or a checkpoint directory, whose "
        "config.json alone is read (and a vlm quantize directory's format, from its weights' "
        "header) [default md2]",
    )
    parser.add_argument(
        "--weights",
        default=None,
        choices=[AUTO, *WEIGHT_FORMATS, "fp8"],
        help="how the weights are held (fp8-experts, or fp8: Moondream 3's FP8 experts; int8, "
        "int4: the decoder's linears and experts; auto: what vlm serve's --weights auto would "
        "take on this card) [default: a vlm quantize directory's format, else bf16; what auto "
        "would take "
        "is said either way]",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_options(parser, [o for o in OPTIONS if o.name in PLAN_OPTIONS], environment=False)
    return parser


def _stored_weights(model: Path) -> str:
    """A vlm quantize directory's format (from its weights' header alone), else bf16; a header
    that cannot be read counts as bf16 (the plan needs the config only)."""
    if not model.is_dir():
        return "bf16"
    try:
        stored = stored_format(model)
    except CheckpointError:
        return "bf16"
    return stored.name if stored is not None else "bf16"


@dataclass(frozen=True)
class AutoLine:
    """What ``--weights auto`` would take (None: a stored format, or nothing fits) and why."""

    weights: str | None
    line: str


def _auto_line(shape: MemoryShape, cfg: EngineConfig, card: ChipSpec, stored: str) -> AutoLine:
    """``--weights auto`` on ``card``, as the server decides it at start."""
    if stored != "bf16":
        return AutoLine(
            None, f"weights: {stored} (auto): a vlm quantize directory is served in its own format"
        )
    flags = {plan: flag for flag, plan in PLAN_FORMATS.items()}
    served = [flags[f] for f in formats_for(shape, card) if f in flags and f in _SERVED]
    try:
        choice = choose_weights(shape, cfg, card.memory_bytes, AUTO, served)
    except WeightsError as err:
        return AutoLine(None, str(err))
    return AutoLine(choice.weights, choice.line)


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    config = config_from(parser, args, {}, [o for o in OPTIONS if o.name in PLAN_OPTIONS])
    try:
        card = by_name(args.gpu)
        model, shape = model_shape(args.model, config.preset)
        cfg = config.engine_config
        stored = _stored_weights(Path(args.model))
        auto = _auto_line(shape, cfg, card, stored)
        if args.weights == AUTO:
            args.weights = stored if auto.weights is None else PLAN_FORMATS[auto.weights]
        elif args.weights is None:
            args.weights = stored
        args.weights = PLAN_FORMATS.get(args.weights, args.weights)
        check_format(shape, args.weights, card, cfg.kv_dtype)
        plan = plan_memory(shape, cfg, card.memory_bytes, args.weights)
    except (ValueError, CheckpointError, OSError) as err:
        print(f"vlm plan: error: {err}", file=sys.stderr)
        return 2
    alt = None if plan.fits else alternatives(shape, cfg, card, plan)
    if args.json:
        out = plan_json(plan, model, card.name, alt)
        out["auto"] = {"weights": auto.weights, "line": auto.line}
        print(json.dumps(out, indent=2))
        return 0 if plan.fits else 1
    print("\n".join(plan_lines(plan, model, card.name)))
    print(auto.line)
    if alt is not None:
        n = cfg.max_batch_size
        if alt.kv_budget_bytes is not None:
            print(f"  would fit with --kv-budget-bytes {alt.kv_budget_bytes}")
        if alt.formats:
            print(f"  {n} requests fit in weights {', '.join(alt.formats)}")
        if alt.cards:
            print(f"  {n} requests fit ({args.weights}) on: {', '.join(alt.cards)}")
        if alt.kv_budget_bytes is None and not alt.formats and not alt.cards:
            print(f"  no format or card of the table holds {n} requests; lower --max-batch-size")
    return 0 if plan.fits else 1
