"""Command line: ``vlm serve`` (the gRPC server), ``vlm batch`` (bulk work without a server),
``vlm cluster`` (replicas on Ray Serve behind the gateway), ``vlm gateway`` (the gateway
alone, for a deployed Serve application), ``vlm plan`` (the memory plan for a card),
``vlm quantize`` (INT8 or INT4 weights written ahead), ``vlm compare`` (two models' answers),
``vlm run TASK IMAGE ...`` on the reference path, ``vlm make-checkpoint``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from image_pipeline import ImageError, prepare_image, sample_image_bytes
from vlm_server.default_model import default_model_dir
from vlm_server.devices import resolve_device
from vlm_server.models import capabilities
from vlm_server.models.checkpoint_io import CheckpointError
from vlm_server.models.lora import files as lora_files
from vlm_server.models.lora import formats as lora_formats
from vlm_server.models.registry import load_model, preset, preset_names, write_checkpoint
from vlm_server.options.command_line import add_options, config_from
from vlm_server.options.spec import Option
from vlm_server.options.table import OPTIONS, ServerConfig
from vlm_server.reference import ContextOverflow, ReferenceGenerator, SamplingSettings
from vlm_server.server.weights_start import start_weights

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SAMPLE = "sample"


# The options of the served model, as vlm serve takes them (one table: vlm_server.options).
RUN_OPTIONS = ("model", "preset", "tokenizer", "dtype", "weights", "vision_weights", "device")


def _run_options() -> list[Option]:
    return [opt for opt in OPTIONS if opt.name in RUN_OPTIONS]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="start the gRPC server (vlm serve --help for its flags)")
    sub.add_parser(
        "batch", help="a task over a folder of pictures, or a requests file (vlm batch --help)"
    )
    sub.add_parser(
        "plan", help="the engine's memory plan for a card, without a GPU (vlm plan --help)"
    )
    sub.add_parser(
        "compare", help="two models' answers over a folder of pictures (vlm compare --help)"
    )
    sub.add_parser(
        "quantize", help="write a checkpoint's weights in INT8 or INT4 (vlm quantize --help)"
    )
    sub.add_parser("cluster", help="serve on Ray Serve, one replica per GPU (vlm cluster --help)")
    sub.add_parser(
        "gateway", help="the cluster's doors for a deployed Serve application (vlm gateway --help)"
    )

    run = sub.add_parser("run", help="run one task on one image (reference path)")
    run.add_argument("task", choices=["caption", "query", "point", "detect"])
    run.add_argument("image", help=f"image file, or '{SAMPLE}' for the bundled sample image")
    run.add_argument(
        "text",
        nargs="?",
        default=None,
        help="the question (query) or the object name (point, detect)",
    )
    run.add_argument("--length", default="normal", choices=["short", "normal", "long"])
    run.add_argument("--temperature", type=float, default=0.5)
    run.add_argument("--top-p", type=float, default=0.3)
    run.add_argument("--max-tokens", type=int, default=128)
    run.add_argument("--max-objects", type=int, default=50)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--json", action="store_true", help="print the result as JSON")
    run.add_argument(
        "--adapter",
        type=Path,
        default=None,
        help="a finetune adapter file to answer with (.pt as the moondream reference saves "
        "it, or .safetensors)",
    )
    add_options(run, _run_options(), environment=False)

    mk = sub.add_parser("make-checkpoint", help="write a seeded random checkpoint")
    mk.add_argument("out", type=Path)
    mk.add_argument("--preset", default="tiny", choices=preset_names())
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    mk.add_argument("--layout", default="native", choices=["native", "legacy"])
    return parser


def _run(args: argparse.Namespace, config: ServerConfig) -> int:
    if args.task != "caption" and not args.text:
        print(
            f"vlm: {args.task} needs the {'question' if args.task == 'query' else 'object'}",
            file=sys.stderr,
        )
        return 2
    try:
        device = resolve_device(config.device)
    except ValueError as err:
        print(f"vlm: error: {err}", file=sys.stderr)
        return 2
    dtype = (
        DTYPES[config.dtype]
        if config.dtype
        else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    )
    source = config.model or default_model_dir()
    if config.model is None:
        print(
            "vlm: using the built-in random tiny model (random words; pass --model for real "
            "moondream2 weights)",
            file=sys.stderr,
        )
    weights = start_weights(
        config.model, config.preset, config.weights, config.engine_config, device
    )
    loaded = load_model(
        source,
        preset_name=config.preset,
        dtype=dtype,
        device=device,
        tokenizer_path=config.tokenizer,
        weights=weights,
        vision_weights=config.vision_weights,
    )
    data = sample_image_bytes() if args.image == SAMPLE else Path(args.image).read_bytes()
    image = prepare_image(data)
    adapter = None
    if args.adapter is not None:
        try:
            adapters = capabilities.need(
                loaded.model.capabilities.adapters, "adapter", loaded.model
            )
        except capabilities.CapabilityError as err:
            print(f"vlm: error: {err}", file=sys.stderr)
            return 2
        targets = adapters.lora_targets
        name = args.adapter.parent.name if args.adapter.name == "final.pt" else args.adapter.stem
        try:  # no rank limit here: nothing is allocated per slot
            adapter = lora_formats.load(args.adapter, targets, 1 << 16, name)
        except lora_files.AdapterError as err:
            print(f"vlm: error: {err}", file=sys.stderr)
            return 2
    gen = ReferenceGenerator(loaded.model, loaded.tokenizer, adapter)
    start = time.perf_counter()
    if args.task in ("caption", "query"):
        settings = SamplingSettings(
            temperature=args.temperature,
            top_p=args.top_p,
            max_tokens=args.max_tokens,
            seed=args.seed,
        )
        result = (
            gen.caption(image, args.length, settings)
            if args.task == "caption"
            else gen.query(image, args.text, settings)
        )
    elif args.task == "point":
        result = gen.point(image, args.text, args.max_objects)
    else:
        result = gen.detect(image, args.text, args.max_objects)
    elapsed = time.perf_counter() - start
    out = dataclasses.asdict(result)
    out.pop("token_ids", None)
    if args.task == "point":
        out.pop("boxes")
    elif args.task == "detect":
        out.pop("points")
    if args.json:
        print(json.dumps({"task": args.task, **out, "seconds": round(elapsed, 4)}))
    elif args.task in ("caption", "query"):
        print(out["text"])
    else:
        key = "points" if args.task == "point" else "boxes"
        for item in out[key]:
            print(" ".join(f"{k}={v:.4f}" for k, v in item.items()))
        print(f"({len(out[key])} {key}, finish: {out['finish_reason']})")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # every flag belongs to the server: vlm serve --help
        from vlm_server.server.main import main as serve

        return serve(argv[1:], prog="vlm serve")
    if argv[:1] == ["batch"]:  # every flag belongs to the batch: vlm batch --help
        from vlm_server.batch_command import main as batch

        return batch(argv[1:])
    if argv[:1] == ["plan"]:  # the engine's memory plan for a card: vlm plan --help
        from vlm_server.plan_command import main as plan

        return plan(argv[1:])
    if argv[:1] == ["compare"]:  # two models' answers over a folder: vlm compare --help
        from vlm_server.compare_command import main as compare

        return compare(argv[1:])
    if argv[:1] == ["quantize"]:  # INT8 or INT4 weights written ahead: vlm quantize --help
        from vlm_server.quantize_command import main as quantize

        return quantize(argv[1:])
    if argv[:1] == ["cluster"]:  # needs the ray extra: pip install -e '.[cluster]'
        from vlm_server.cluster.command import main as cluster

        return cluster(argv[1:])
    if argv[:1] == ["gateway"]:
        from vlm_server.cluster.command import gateway_main

        return gateway_main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    # Checked as vlm serve checks them; vlm run reads no VLM_* variables.
    config = config_from(parser, args, {}, _run_options()) if args.command == "run" else None
    try:
        if config is not None:
            return _run(args, config)
        write_checkpoint(
            preset(args.preset),
            args.out,
            seed=args.seed,
            dtype=DTYPES[args.dtype],
            layout=args.layout,
        )
        print(args.out)
        return 0
    except (CheckpointError, ImageError, ContextOverflow, ValueError, OSError) as err:
        print(f"vlm: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
