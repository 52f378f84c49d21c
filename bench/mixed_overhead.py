"""What a mixed step costs over a decode step of the same decode rows, and where.

A stream's inter-token gap is one step: a decode step, or a mixed step when some request's
prompt runs beside the decode rows (a caption restart: 5 prompt tokens). This probe builds one
runtime on a random checkpoint and times, as CUDA-graph replays on the compute stream:

    decode          the decode forward of ``--rows`` rows at ``--context``
    mixed +P        a mixed step of the same decode rows and a P-token prompt chunk of one
                    more row (P in ``--prompt``; 0: the mixed path with decode rows only)

each mixed step with its attention in one-token tiles (the tile kernel) and one token at a
time (the decode kernel; `triton_attention.per_token_attention`), and profiles one eager
forward of each kind kernel by kernel (torch.profiler), so the difference has names.

    python -m bench.mixed_overhead [--rows 16] [--context 800] [--prompt 0 5 16 32 48]

Prints a table, and writes ``mixed_overhead.json`` and ``mixed_overhead.png`` under ``--out``
(default bench/results/<device>/).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from bench.graph_timing import graph_ms
from bench.plotting import grouped_bars, png_beside, replot
from decoding.mask_table import MaskTable
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.pages import PageAllocator
from vlm_server.engine.core.step_plan import DEVICE_INPUT, N_TOK
from vlm_server.engine.device.kernels import triton_attention
from vlm_server.engine.device.runtime import ModelRuntime
from vlm_server.models.registry import preset, random_model

VARIANTS = {"tiles": 0, "per-token": 1 << 30}  # PER_TOKEN_MAX_TOKENS of each


def kernel_table(fn: Callable[[], object], stream: torch.cuda.Stream) -> dict[str, float]:
    """CUDA microseconds per kernel name of one eager ``fn`` (summed over its launches)."""
    with torch.cuda.stream(stream):
        fn()
    stream.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with torch.cuda.stream(stream):
            fn()
        stream.synchronize()
    table: dict[str, float] = {}
    for ev in prof.key_averages():
        us = ev.device_time_total
        if us > 0:
            table[ev.key[:60]] = table.get(ev.key[:60], 0.0) + us
    return table


def mixed_tokens(rows: int, context: int, prompt: int, prompt_at: int) -> np.ndarray:
    """``rows`` decode rows at ``context``, then ``prompt`` tokens of row ``rows``."""
    tokens = np.zeros((rows + prompt, N_TOK), np.int64)
    tokens[:rows, 0] = np.arange(rows)
    tokens[:rows, 1] = context
    tokens[:rows, 2] = DEVICE_INPUT
    tokens[rows:, 0] = rows
    tokens[rows:, 1] = prompt_at + np.arange(prompt)
    tokens[rows:, 2] = 1 + np.arange(prompt)
    return tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="moondream2")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--context", type=int, default=800)
    ap.add_argument("--prompt", type=int, nargs="+", default=[0, 5, 16, 32, 48])
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--plot-from", help="only draw the plot of a saved mixed_overhead.json")
    args = ap.parse_args()
    if args.plot_from:
        raise SystemExit(replot(args.plot_from, plot))
    loaded = random_model(preset(args.preset), dtype=torch.bfloat16, device="cuda")
    cfg = EngineConfig(max_batch_size=args.rows + 1, kv_budget_bytes=4 << 30)
    rt = ModelRuntime(loaded.model, cfg, MaskTable(loaded.config.text.vocab_size, 4))
    table = rt.block_table
    width = table.shape[1]
    pages = PageAllocator(rt.kv_pages, cfg.page_size, cfg.max_rows, width, block_table=table)
    prefix_len = loaded.config.image_prefix_len
    per_row = -(-(max(args.context, prefix_len + max(args.prompt)) + 1) // cfg.page_size)
    for row in range(args.rows + 1):
        pages.assign(row, pages.allocate(per_row))
    rt.pool.block_dev.copy_(rt.pool.block_host)
    stream, steps = rt.dev.compute_stream, rt.steps
    buf, lay = rt.buffers.slots[0], rt.buffers.mixed_layout
    max_blocks = rt.pool.block_dev.shape[1]
    buf.launch_dev[: args.rows, 0] = torch.arange(args.rows)
    buf.launch_dev[: args.rows, 1] = args.context
    torch.set_grad_enabled(False)

    def decode() -> None:
        steps.decode_forward(buf, args.rows, max_blocks, lora=False)

    result: dict = {"device": torch.cuda.get_device_name(), "rows": args.rows, "cases": []}
    with torch.inference_mode():
        result["decode_ms"] = graph_ms(decode, 50, stream)
        kernels = {"decode": kernel_table(decode, stream)}
        for p in args.prompt:
            tokens = mixed_tokens(args.rows, args.context, p, prefix_len)
            n = steps.token_bucket(len(tokens))
            last = np.arange(args.rows + (p > 0), dtype=np.int64)
            host = lay.pack(steps.mixed_scratch, tokens, last, [], n, rt.buffers.pad_row)
            buf.mixed_dev[: len(host)].copy_(torch.from_numpy(host))
            case = {"prompt": p, "tokens": len(tokens), "bucket": n}
            for name, limit in VARIANTS.items():
                triton_attention.PER_TOKEN_MAX_TOKENS = limit

                def mixed(n: int = n) -> None:
                    steps.mixed_forward(buf, n, max_blocks, lora=False)

                case[name] = graph_ms(mixed, 50, stream)
                if p == args.prompt[min(1, len(args.prompt) - 1)]:
                    kernels[f"mixed +{p} {name}"] = kernel_table(mixed, stream)
            result["cases"].append(case)
    result["kernels_us"] = kernels
    report(result, args.top)
    out = args.out or Path("bench/results") / result["device"].replace(" ", "_")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "mixed_overhead.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, png_beside(str(path)))
    print(f"wrote {path} and {png_beside(str(path))}")


def plot(result: dict, path: str) -> bool:
    """Bars per case: the step with tiles, one by one, and the decode step alone."""
    labels = [f"+{c['prompt']} ({c['bucket']})" for c in result["cases"]]
    bars = {name: [c[name] for c in result["cases"]] for name in VARIANTS}
    bars["decode only"] = [result["decode_ms"]] * len(labels)
    return grouped_bars(
        bars,
        labels,
        path,
        xlabel="prompt tokens beside the decode rows (token bucket)",
        ylabel="graph replay, ms",
        title=f"{result['rows']} decode rows: mixed vs decode step\n{result['device']}",
    )


def report(result: dict, top: int) -> None:
    head = f"{result['device']}, {result['rows']} decode rows"
    print(f"\n{head}: decode {result['decode_ms']:.3f} ms")
    print(f"{'prompt':>6} {'bucket':>6} " + " ".join(f"{v:>10}" for v in VARIANTS))
    for c in result["cases"]:
        cells = " ".join(f"{c[v]:>10.3f}" for v in VARIANTS)
        print(f"{c['prompt']:>6} {c['bucket']:>6} {cells}")
    tables = result["kernels_us"]
    names = sorted(
        {k for t in tables.values() for k in t},
        key=lambda k: -max(t.get(k, 0.0) for t in tables.values()),
    )[:top]
    print("\nkernel CUDA us (one eager forward): " + " | ".join(tables))
    for k in names:
        print(f"{k[:60]:<60} " + " ".join(f"{t.get(k, 0.0):>9.1f}" for t in tables.values()))
    print(f"{'total':<60} " + " ".join(f"{sum(t.values()):>9.1f}" for t in tables.values()))


if __name__ == "__main__":
    main()
