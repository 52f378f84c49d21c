"""GPU sampling time per step: mask gather + top-p sampling (and the greedy path) at batch
1/8/32/64 over a 51,200-token vocabulary, eager and graph-captured, timed with CUDA events.

    python -m bench.bench_sampling [--vocab 51200] [--out bench/results/<device>]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from decoding.batch_masks import apply_masks
from decoding.sampling import sample


def _time(fn: Callable[[], object], iters: int = 200) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=51200)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    dev = "cuda"
    table = torch.rand(64, args.vocab, device=dev) > 0.3
    table[0] = True
    rows = []
    for b in (1, 8, 32, 64):
        logits = torch.randn(b, args.vocab, device=dev)
        temp = torch.full((b,), 0.7, device=dev)
        top_p = torch.full((b,), 0.9, device=dev)
        seeds = torch.arange(b, device=dev)
        steps = torch.zeros(b, dtype=torch.int64, device=dev)
        idx = torch.randint(0, 64, (b,), device=dev)

        def masked_sample(
            logits: torch.Tensor = logits,
            idx: torch.Tensor = idx,
            temp: torch.Tensor = temp,
            top_p: torch.Tensor = top_p,
            seeds: torch.Tensor = seeds,
            steps: torch.Tensor = steps,
        ) -> torch.Tensor:
            return sample(apply_masks(logits, idx, table), temp, top_p, seeds, steps)

        def greedy(logits: torch.Tensor = logits) -> torch.Tensor:
            return logits.argmax(dim=-1)

        graph = torch.cuda.CUDAGraph()
        masked_sample()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            masked_sample()
        row = {
            "batch": b,
            "mask_sample_eager_ms": _time(masked_sample),
            "mask_sample_graph_ms": _time(graph.replay),
            "greedy_ms": _time(greedy),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    name = torch.cuda.get_device_name()
    out = args.out or Path("bench/results") / name.replace(" ", "_")
    out.mkdir(parents=True, exist_ok=True)
    (out / "sampling_bench.json").write_text(json.dumps({"device": name, "rows": rows}, indent=2))
    print(f"\n{name}, vocab {args.vocab}")
    print(f"{'batch':>5} {'mask+sample eager':>17} {'graphed':>8} {'greedy':>7}")
    for r in rows:
        print(
            f"{r['batch']:>5} {r['mask_sample_eager_ms']:>17.3f} "
            f"{r['mask_sample_graph_ms']:>8.3f} {r['greedy_ms']:>7.3f}"
        )


if __name__ == "__main__":
    main()
