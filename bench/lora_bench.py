"""Finetune adapters: what they cost a decode step, and whether loading one stalls streams.

Runs the real engine (scheduler thread, pipeline, graphs) in-process on a seeded random
checkpoint of the chosen preset, with seeded random rank-``--rank`` adapters in the family's
file format (the reference's; Moondream 3: the cloud finetunes', rank divisible by the experts
per token) written to a temporary folder:

  period     ``--streams`` caption streams (temperature 0, ``--tokens`` each, one cached
             picture), decode period (median wall time between full-batch decode commits),
             three ways: ``off`` (a server without adapters), ``none`` (adapters on, no
             request uses one) and ``lora`` (the streams spread over ``--adapters`` distinct
             adapters, loaded beforehand). Figure: lora / off.
  load gap   ``--load-streams`` caption streams without adapters; after ``--warmup`` s,
             ``--loads`` text-only one-token queries naming adapters already resident (the
             baseline: the same requests, no load), then ``--loads`` naming adapters not
             loaded yet
             (one after another), so each brings a file read, a host copy and a device copy
             into a slot beside the running steps. Figure: the p99 of the gaps between step
             commits while the loads run over their p99 while the baseline's queries run.

    python -m bench.lora_bench --preset moondream2 --streams 32 --adapters 8 --rank 32

Prints a table; writes ``lora_bench.json`` (rows ``lora8.period_ratio.s32`` and
``lora.load_gap_ratio`` for bench/targets.py) under ``--out`` (default
bench/results/<device>/).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.step_bench import StepRecorder
from image_pipeline import prepare_image, sample_image_bytes
from vlm_server.engine.api import Finished, GenerationRequest, Task
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.device.model_entry import ModelEntryPoints
from vlm_server.engine.engine import BatchedEngine
from vlm_server.models.interface import LoadedModel
from vlm_server.models.lora.writer import write_random, write_random_finetune
from vlm_server.models.registry import preset, random_model
from vlm_server.server.in_process import InProcessEngine


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    at = (len(xs) - 1) * q / 100
    lo, hi = math.floor(at), math.ceil(at)
    return xs[lo] + (xs[hi] - xs[lo]) * (at - lo)


async def _finish(engine: InProcessEngine, req: GenerationRequest) -> Finished:
    async for event in await engine.submit(req):
        if isinstance(event, Finished):
            return event
    raise AssertionError("no result")


def _config(args: argparse.Namespace, folder: str | None, batch: int) -> EngineConfig:
    return EngineConfig(
        max_batch_size=batch,
        kv_budget_bytes=int(args.kv_gib * (1 << 30)),
        adapters_dir=folder,
        max_adapters=max(args.adapters, 2),
        max_adapter_rank=args.rank,
    )


async def period_case(
    loaded: LoadedModel, args: argparse.Namespace, folder: str | None, names: list[str | None]
) -> dict:
    """Decode period of ``--streams`` captions, stream i with adapter ``names[i % len]``."""
    rec = StepRecorder()
    engine = InProcessEngine(
        BatchedEngine(loaded, _config(args, folder, args.streams), observer=rec)
    )
    await engine.start()
    try:
        image = prepare_image(sample_image_bytes())
        # Warm-up: the image prefix of every adapter cached, adapters resident, kernels built.
        warm = {n: GenerationRequest(Task.CAPTION, image, max_tokens=4, adapter=n) for n in names}
        await asyncio.gather(*[_finish(engine, r) for r in warm.values()])
        rec.device_timing = True
        reqs = [
            GenerationRequest(
                Task.CAPTION,
                image,
                temperature=0,
                max_tokens=args.tokens,
                seed=i,
                adapter=names[i % len(names)],
            )
            for i in range(args.streams)
        ]
        t0 = time.perf_counter()
        done = await asyncio.gather(*[_finish(engine, r) for r in reqs])
        wall = time.perf_counter() - t0
    finally:
        await engine.close()
    commits = [(t, n) for t, kind, n in rec.commits if kind == "decode"]
    full = [b - a for (a, n1), (b, n2) in itertools.pairwise(commits) if n1 == n2 == args.streams]
    return {
        "period_ms": statistics.median(full) * 1e3 if full else float("nan"),
        "steps": len(full),
        "tokens_per_s": sum(r.metrics.output_tokens for r in done) / wall,
    }


async def _queries(engine: InProcessEngine, adapters: list[str]) -> tuple[float, float, list]:
    """One-token text queries, one at a time, each naming an adapter: (start, end, ms each)."""
    start, took = time.perf_counter(), []
    for name in adapters:
        t = time.perf_counter()
        q = GenerationRequest(Task.QUERY, None, question="hi", max_tokens=1, adapter=name)
        await _finish(engine, q)
        took.append((time.perf_counter() - t) * 1e3)
    return start, time.perf_counter(), took


async def load_gap_case(loaded: LoadedModel, args: argparse.Namespace, folder: str) -> dict:
    """Step gaps of ``--load-streams`` captions while queries name resident adapters, then
    while queries name adapters that must load."""
    rec = StepRecorder()
    engine = InProcessEngine(
        BatchedEngine(loaded, _config(args, folder, args.load_streams + 1), observer=rec)
    )
    await engine.start()
    try:
        image = prepare_image(sample_image_bytes())
        await _finish(engine, GenerationRequest(Task.CAPTION, image, max_tokens=4))
        await _queries(engine, [f"ready{i}" for i in range(args.loads)])  # resident now
        rec.device_timing = True
        streams = [
            asyncio.ensure_future(
                _finish(
                    engine,
                    GenerationRequest(
                        Task.CAPTION, image, temperature=0, max_tokens=args.load_tokens, seed=i
                    ),
                )
            )
            for i in range(args.load_streams)
        ]
        await asyncio.sleep(args.warmup)
        base_start, base_end, _ = await _queries(engine, [f"ready{i}" for i in range(args.loads)])
        start, end, load_ms = await _queries(engine, [f"new{i}" for i in range(args.loads)])
        busy = not any(s.done() for s in streams)
        await asyncio.gather(*streams)
    finally:
        await engine.close()
    times = [t for t, _, _ in rec.commits]
    gaps = [(b, (b - a) * 1e3) for a, b in itertools.pairwise(times)]
    before = [g for t, g in gaps if t < base_start]
    resident = [g for t, g in gaps if base_start <= t <= base_end]
    during = [g for t, g in gaps if start <= t <= end]
    p50, base99, p99 = percentile(before, 50), percentile(resident, 99), percentile(during, 99)
    return {
        "gap_p50_before_ms": p50,
        "gap_p99_resident_ms": base99,
        "gap_p99_during_ms": p99,
        "gap_max_during_ms": max(during, default=float("nan")),
        "load_request_p50_ms": percentile(load_ms, 50),
        "streams_ran_throughout": busy,
        "ratio": p99 / base99,
        "ratio_to_p50_before": p99 / p50,
    }


def _finite(value: object) -> object:
    """``value`` with NaN and infinities as None (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="moondream2")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--load-streams", type=int, default=16)
    ap.add_argument("--load-tokens", type=int, default=1024)
    ap.add_argument("--loads", type=int, default=4)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--kv-gib", type=float, default=8.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    loaded = random_model(preset(args.preset), seed=0, dtype=dtype, device=device)
    targets = ModelEntryPoints(loaded.model).lora_targets
    if targets is None:
        raise SystemExit(f"{args.preset}: the family takes no adapters")
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as folder:
        names = [f"a{i}" for i in range(args.adapters)]
        write = write_random_finetune if targets.format == "finetune" else write_random
        extra = [f"{kind}{j}" for kind in ("ready", "new") for j in range(args.loads)]
        for i, name in enumerate([*names, *extra]):
            write(Path(folder), name, targets, args.rank, seed=i, dtype=torch.bfloat16)
        cases = {
            "off": asyncio.run(period_case(loaded, args, None, [None])),
            "none": asyncio.run(period_case(loaded, args, folder, [None])),
            "lora": asyncio.run(period_case(loaded, args, folder, list(names))),
        }
        gap = asyncio.run(load_gap_case(loaded, args, folder))
    off = cases["off"]["period_ms"]
    result = {
        "device": gpu,
        "preset": args.preset,
        "dtype": args.dtype,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "period": cases,
        "period_ratio": cases["lora"]["period_ms"] / off,
        "none_ratio": cases["none"]["period_ms"] / off,
        "load_gap": gap,
    }
    out = args.out or Path("bench/results") / gpu.replace(" ", "_")
    out.mkdir(parents=True, exist_ok=True)
    (out / "lora_bench.json").write_text(json.dumps(_finite(result), indent=2))
    print(f"\n{gpu}, {args.preset} {args.dtype}, rank {args.rank}")
    print(f"{'case':>6} {'period ms':>10} {'tok/s':>9} {'x off':>7}")
    for name, c in cases.items():
        print(
            f"{name:>6} {c['period_ms']:>10.3f} {c['tokens_per_s']:>9.1f} "
            f"{c['period_ms'] / off:>7.3f}"
        )
    print(
        f"load gap: p50 before {gap['gap_p50_before_ms']:.3f} ms, p99 with resident adapters "
        f"{gap['gap_p99_resident_ms']:.3f} ms, p99 while loading {gap['gap_p99_during_ms']:.3f}"
        f" ms, ratio {gap['ratio']:.2f} (to the p50 before: {gap['ratio_to_p50_before']:.2f};"
        f" a load request {gap['load_request_p50_ms']:.1f} ms)"
    )


if __name__ == "__main__":
    main()
