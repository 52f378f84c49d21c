"""The adapter decode period per kernel variant, each against the same server without adapters
in one process: where fc2's shrink runs (`products.FC2_SHRINK`), how many hidden columns
each expand program shrinks (`lora_kernel.SHRINK_COLS`), and optionally (1 or 0, default 1)
whether fc1's delta and fc2's shrink run beside the attention (`products.OVERLAP`) and
whether decode steps take the step kernels (`bank.STEP_KERNELS`).

    python -m bench.lora_variants --variants apart:512 apart:512:0 apart:512:0:0 expand:512
    python -m bench.lora_variants --variants apart:512 --profile apart:512

Each variant is `bench.lora_bench`'s period case (32 caption streams over 8 rank-32 adapters by
default) on a fresh engine; the baseline without adapters runs first and last, and the ratios
divide by their mean. Prints a table; writes ``lora_variants.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from bench.lora_bench import period_case
from vlm_server.engine.device.model_entry import ModelEntryPoints
from vlm_server.models.common import lora_kernel
from vlm_server.models.interface import LoadedModel
from vlm_server.models.lora import bank, products
from vlm_server.models.lora.writer import write_random
from vlm_server.models.registry import preset, random_model


def _set(variant: str) -> None:
    where, cols, *more = variant.split(":")
    overlap, step = [*map(int, more), 1, 1][:2]
    products.FC2_SHRINK = where  # type: ignore[assignment]
    lora_kernel.SHRINK_COLS = int(cols)
    products.OVERLAP = bool(overlap)
    bank.STEP_KERNELS = bool(step)


def _profile(
    loaded: LoadedModel, args: argparse.Namespace, folder: str, names: list[str | None]
) -> None:
    from torch.profiler import ProfilerActivity, profile

    _set(args.profile)
    for label, where, who in (("off", None, [None]), (args.profile, folder, names)):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            asyncio.run(period_case(loaded, args, where, who))
        print(f"\n=== {label}: CUDA time per kernel ===")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="moondream2")
    ap.add_argument("--variants", nargs="+", default=["apart:512", "apart:512:0:0"])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--kv-gib", type=float, default=8.0)
    ap.add_argument(
        "--profile",
        default=None,
        help="a variant to profile after the sweep: CUDA time per kernel of its period case "
        "and of the baseline's (warm-up and graph capture included)",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    loaded = random_model(preset(args.preset), seed=0, dtype=torch.bfloat16, device="cuda")
    targets = ModelEntryPoints(loaded.model).lora_targets
    assert targets is not None and targets.format != "finetune", "a Moondream 2 preset"
    gpu = torch.cuda.get_device_name()
    rows: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="lora-variants-") as folder:
        names: list[str | None] = [f"a{i}" for i in range(args.adapters)]
        for i, name in enumerate(names):
            write_random(Path(folder), str(name), targets, args.rank, seed=i, dtype=torch.bfloat16)
        cases = ["off", *args.variants, "off2"]
        for case in tqdm(cases, desc="cases"):
            if case.startswith("off"):
                rows[case] = asyncio.run(period_case(loaded, args, None, [None]))["period_ms"]
                continue
            _set(case)
            rows[case] = asyncio.run(period_case(loaded, args, folder, names))["period_ms"]
        if args.profile:
            _profile(loaded, args, folder, names)
    off = (rows["off"] + rows["off2"]) / 2
    result = {"device": gpu, "settings": vars(args) | {"out": None}, "period_ms": rows, "off": off}
    out = args.out or Path("bench/results") / gpu.replace(" ", "_")
    out.mkdir(parents=True, exist_ok=True)
    (out / "lora_variants.json").write_text(json.dumps(result, indent=2))
    print(f"\n{gpu}: {args.streams} streams over {args.adapters} rank-{args.rank} adapters")
    print(f"{'case':>12} {'period ms':>10} {'x off':>7}")
    for case, ms in rows.items():
        print(f"{case:>12} {ms:>10.3f} {ms / off:>7.3f}")


if __name__ == "__main__":
    main()
