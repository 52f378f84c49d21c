"""How far 8- and 4-bit weights move a model from its 16-bit checkpoint, measured on the same
checkpoint and inputs (random weights cannot show task accuracy; this is what can be measured):

    python -m bench.quant_numerics --preset moondream3 [--device cuda] [--json out.json]
    python -m bench.quant_numerics --model DIR [--formats int8 int4]

Per format:

* each quantized layer's output relative error ``||x Wq^T - x W^T|| / ||x W^T||`` on the
  inputs the 16-bit model's own forward gives that layer (64 prompts with pictures);
* the final logits' cosine and top-1 agreement (the next token after each prompt);
* the textbook bound beside them. Rounding to a step ``s`` leaves a uniform error of standard
  deviation ``s / sqrt(12)`` per weight; per-channel INT8 has ``s = max|row| / 127``, INT4 in
  groups ``s = max|group| / 7``. For a row of Gaussian weights (``max|row| ~ 3 sigma`` over a
  few thousand columns, ``~ 2.5 sigma`` over a group of 128) the relative error of
  ``x . w`` is then about ``3 / (127 sqrt 12) = 0.7%`` (INT8) and ``2.5 / (7 sqrt 12) = 10%``
  (INT4), independent of ``x``: `bound` computes it from the layer's weights themselves
  (``rms(step) / sqrt(12) / rms(w)``).

Writes JSON (``--json``), a PNG beside it (per-layer error against its bound, log scale) and
prints a table. bench/targets.py reads the JSON (``quant_numerics.json``) into the rows
``<model>.int8.logits_cosine``, ``<model>.int4.logits_cosine``, ``<model>.int4.top1_agreement``.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from bench.plotting import png_beside, pyplot, save
from bench.synth_images import base_image, encode
from image_pipeline import prepare_image
from vlm_server.models.common.quant_linear import QuantLinear
from vlm_server.models.interface import LoadedModel
from vlm_server.models.quant.formats import weight_format
from vlm_server.models.registry import load_model, preset, random_model
from vlm_server.reference import ReferenceGenerator

QUESTIONS = (
    "What is in this picture?",
    "Describe the colors.",
    "How many objects are there?",
    "Is it day or night?",
)


def bound(w: torch.Tensor, bits: int, group: int) -> float:
    """The textbook relative error of ``x . w`` for ``w`` rounded to ``bits`` (per row, or in
    groups of ``group`` columns): rms(step) / sqrt(12) / rms(w) (module doc)."""
    w = w.float()
    qmax = 127 if bits == 8 else 7
    amax = w.abs().amax(-1) if group == 0 else w.unflatten(-1, (-1, group)).abs().amax(-1)
    step = amax / qmax
    return float(step.pow(2).mean().sqrt() / math.sqrt(12) / w.pow(2).mean().sqrt())


def _load(args: argparse.Namespace, weights: str | None) -> LoadedModel:
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    group = {"group_size": args.group_size} if weights else {}
    if args.model:
        return load_model(
            args.model, dtype=dtype, device=args.device, progress=False, weights=weights, **group
        )
    return random_model(
        preset(args.preset), seed=args.seed, dtype=dtype, device=args.device, progress=False,
        weights=weights, **group,
    )  # fmt: skip


def _inputs(loaded: LoadedModel, prompts: int, seed: int) -> list[tuple[Any, list[int]]]:
    """``prompts`` (picture, question tokens) pairs, each picture its own."""
    out = []
    for i in range(prompts):
        image = prepare_image(encode(base_image(96 + 8 * (i % 4), 64 + 8 * (i % 3), seed + i)))
        ids = loaded.tokenizer.encode(QUESTIONS[i % len(QUESTIONS)]).ids
        out.append((image, ids))
    return out


def _linears(model: nn.Module, names: Sequence[str]) -> dict[str, nn.Module]:
    return {n: model.get_submodule(n) for n in names}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every format's layer errors and logits agreement against the 16-bit model."""
    base = _load(args, None)
    inputs = _inputs(base, args.prompts, args.seed)
    ref = ReferenceGenerator(base.model, base.tokenizer)
    out: dict[str, Any] = {"model": args.model or args.preset, "prompts": args.prompts}
    formats: dict[str, Any] = {}
    for name in args.formats:
        quant = _load(args, name)
        fmt = weight_format(name, args.group_size)
        layers = [n for n, m in quant.model.named_modules() if isinstance(m, QuantLinear)]
        plain = _linears(base.model, layers)
        mine = _linears(quant.model, layers)
        errors: dict[str, list[float]] = {n: [] for n in layers}
        hooks = [plain[n].register_forward_hook(_recorder(n, mine[n], errors)) for n in layers]
        cosines, agree = [], 0
        qref = ReferenceGenerator(quant.model, quant.tokenizer)
        try:
            for image, ids in inputs:
                a = ref.next_logits(image, ids).float()[0]
                b = qref.next_logits(image, ids).float()[0]
                cosines.append(float(torch.nn.functional.cosine_similarity(a, b, dim=0)))
                agree += int(a.argmax() == b.argmax())
        finally:
            for h in hooks:
                h.remove()
        formats[name] = {
            "group_size": fmt.group_size,
            "layers": [
                {
                    "name": n,
                    "rel_error": sum(errors[n]) / len(errors[n]),
                    "bound": bound(plain[n].weight, fmt.bits, fmt.group_size),
                }
                for n in layers
                if errors[n]
            ],
            "logits_cosine": sum(cosines) / len(cosines),
            "logits_cosine_min": min(cosines),
            "top1_agreement": agree / len(inputs),
        }
        layer_rows = formats[name]["layers"]
        formats[name]["mean_rel_error"] = sum(r["rel_error"] for r in layer_rows) / max(
            1, len(layer_rows)
        )
        formats[name]["mean_bound"] = sum(r["bound"] for r in layer_rows) / max(1, len(layer_rows))
        del quant, qref
    out["formats"] = formats
    return out


def _recorder(name: str, quantized: nn.Module, errors: dict[str, list[float]]) -> Any:
    """A forward hook on the 16-bit layer: the quantized layer on the same input, and the
    relative error of its output."""

    def hook(module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        x = args[0]
        with torch.inference_mode():
            q = quantized(x).float()
        ref = output.float()
        errors[name].append(float((q - ref).norm() / ref.norm().clamp_min(1e-30)))

    return hook


def table(out: dict[str, Any]) -> str:
    lines = [f"{'format':<7} {'layers':>6} {'rel err':>9} {'bound':>9} {'cosine':>9} {'top-1':>7}"]
    for name, f in out["formats"].items():
        lines.append(
            f"{name:<7} {len(f['layers']):>6} {f['mean_rel_error']:>9.5f} {f['mean_bound']:>9.5f} "
            f"{f['logits_cosine']:>9.6f} {f['top1_agreement']:>7.3f}"
        )
    return "\n".join(lines)


def plot(out: dict[str, Any], path: str) -> bool:
    """Each layer's relative error (dots) and its bound (line) per format, log scale."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, f in out["formats"].items():
        xs = range(len(f["layers"]))
        dots = ax.semilogy(xs, [r["rel_error"] for r in f["layers"]], "o", label=f"{name} measured")
        ax.semilogy(xs, [r["bound"] for r in f["layers"]], "-", color=dots[0].get_color(),
                    label=f"{name} bound")  # fmt: skip
    ax.set_xlabel("quantized layer (model order)")
    ax.set_ylabel("output relative error")
    ax.set_title(f"{out['model']}: weight-only quantization error")
    ax.legend()
    save(plt, fig, path)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a 16-bit checkpoint directory")
    source.add_argument("--preset", help="a preset, seeded random weights (e.g. moondream3)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--formats", nargs="+", default=["int8", "int4"], choices=["int8", "int4"])
    parser.add_argument("--group-size", type=int, default=128, help="INT4's group")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="quant_numerics.json")
    args = parser.parse_args(argv)
    out = measure(args)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    plot(out, png_beside(args.json))
    print(table(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
