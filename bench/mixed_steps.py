"""Step-level view of mixed steps on the GPU: forward time against tokens in the step.

For each token bucket the runtime captures, one mixed step's token forward is timed three ways
on the same runtime: the graph replay (what the engine runs), the same forward launched
eagerly (host-bound: the time the host spends launching it), and the PyTorch varlen path the
graphs replaced (eager, `ragged_paged_attention`). The tokens are the serving mix: up to 64
decode rows at ``--context``, the rest prompt chunks of 64 other rows right after a shared
730-position image prefix. Also timed: the image path per tiling (normalize, vision tower,
projection; eager and graphed) and the image-prefix forward per number of images in a step.
``--compile-vision`` also times ``torch.compile`` of the vision tower (and its compile time).

    python -m bench.mixed_steps [--context 760] [--compile-vision] [--out DIR]

Writes ``mixed_steps.json`` and ``mixed_steps.png`` under ``--out`` and prints tables.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from decoding.mask_table import MaskTable
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.pages import PageAllocator
from vlm_server.engine.core.step_plan import DEVICE_INPUT, N_TOK
from vlm_server.engine.device.runtime import ModelRuntime
from vlm_server.models.registry import preset, random_model

DECODE_ROWS = 64
CHUNK_ROWS = 64


def gpu_ms(fn: Callable[[], object], stream: torch.cuda.Stream, iters: int = 20) -> float:
    """Median time between events around ``fn`` on ``stream`` (device time, host ahead)."""
    times = []
    with torch.cuda.stream(stream):
        fn()
        for _ in range(iters):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
    return statistics.median(times)


def wall_ms(fn: Callable[[], object], stream: torch.cuda.Stream, iters: int = 10) -> float:
    """Median wall time of ``fn`` until its work is done (includes launching it)."""
    times = []
    with torch.cuda.stream(stream):
        fn()
        stream.synchronize()
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            stream.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def step_tokens(n: int, context: int, prefix_len: int, rows: int) -> np.ndarray:
    """A serving mix of ``n`` tokens: decode rows first, then equal prompt chunks."""
    tokens = np.zeros((n, N_TOK), np.int64)
    d = min(n, DECODE_ROWS)
    tokens[:d, 0] = np.arange(d)
    tokens[:d, 1] = context
    tokens[:d, 2] = DEVICE_INPUT
    rest = n - d
    if rest:
        per = -(-rest // CHUNK_ROWS)
        idx = np.arange(rest)
        tokens[d:, 0] = DECODE_ROWS + idx // per
        tokens[d:, 1] = prefix_len + idx % per
        tokens[d:, 2] = 1 + idx % 1000
    assert tokens[:, 0].max() < rows
    return tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="moondream2")
    ap.add_argument("--context", type=int, default=760)
    ap.add_argument("--max-step-tokens", type=int, default=4096)
    ap.add_argument("--compile-vision", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    loaded = random_model(preset(args.preset), dtype=torch.bfloat16, device="cuda")
    cfg = EngineConfig(
        max_batch_size=DECODE_ROWS, max_step_tokens=args.max_step_tokens, kv_budget_bytes=12 << 30
    )
    rt = ModelRuntime(loaded.model, cfg, MaskTable(loaded.config.text.vocab_size, 4))
    mirror = rt.block_table
    pages = PageAllocator(
        rt.kv_pages, cfg.page_size, cfg.max_rows, mirror.shape[1], block_table=mirror
    )
    prefix_len = loaded.config.image_prefix_len
    ps = cfg.page_size
    shared = pages.allocate(prefix_len // ps)
    own = -(-(max(args.context, prefix_len + args.max_step_tokens // CHUNK_ROWS) + 1) // ps)
    own -= len(shared)
    for row in range(DECODE_ROWS + CHUNK_ROWS):
        pages.assign(row, shared + pages.allocate(own + 1))
    rt.pool.block_dev.copy_(rt.pool.block_host)
    stream = rt.dev.compute_stream
    steps, prefill = rt.steps, rt.prefill
    t0 = time.perf_counter()
    rt.capture_graphs(progress=True)
    capture_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    rt.capture_vision_graphs(progress=True)
    vision_capture_s = time.perf_counter() - t0
    lay = rt.buffers.mixed_layout
    buf = rt.buffers.slots[0]
    mixed = []
    max_blocks = rt.pool.block_dev.shape[1]
    for n in tqdm(steps.token_buckets, desc="mixed steps"):
        tokens = step_tokens(n, args.context, prefix_len, cfg.max_rows)
        last = np.arange(min(n, DECODE_ROWS + CHUNK_ROWS), dtype=np.int64)
        host = lay.pack(steps.mixed_scratch, tokens, last, [], n, rt.buffers.pad_row)
        buf.mixed_dev[: len(host)].copy_(torch.from_numpy(host))
        n_blocks = int(tokens[:, 1].max()) // ps + 1
        with torch.inference_mode():
            graph = gpu_ms(lambda n=n: steps.mixed_graphs.replay((0, n)), stream)
            eager = wall_ms(lambda n=n: steps.mixed_forward(buf, n, max_blocks), stream)
            rt.pool.use_triton = False
            varlen = wall_ms(lambda n=n, b=n_blocks: steps.mixed_forward(buf, n, b), stream, 3)
            rt.pool.use_triton = True
        mixed.append({"tokens": n, "graph_ms": graph, "eager_ms": eager, "varlen_ms": varlen})
    images = []
    vc = loaded.config.vision
    for tiling in ((1, 1), (2, 2), (2, 4), (3, 4)):
        crops = 1 + tiling[0] * tiling[1]
        u8 = torch.randint(0, 256, (crops, vc.crop_size, vc.crop_size, 3), dtype=torch.uint8)
        u8 = u8.cuda()
        x = torch.randn(crops, 3, vc.crop_size, vc.crop_size, device="cuda", dtype=rt.entry.dtype)
        with torch.inference_mode():
            tower = gpu_ms(lambda x=x: loaded.model.vision.encode(x), stream)
            path_eager = wall_ms(lambda u=u8, t=tiling: prefill.image_embedding(u, t), stream)
            prefill.image_inputs[crops].copy_(u8)
            path_graph = gpu_ms(
                lambda t=tiling: prefill.image_graphs.replay(t), rt.dev.prefill_stream
            )
        images.append(
            {
                "crops": crops,
                "tower_ms": tower,
                "path_eager_wall_ms": path_eager,
                "path_graph_ms": path_graph,
            }
        )
    prefixes = []
    side = rt.dev.prefill_stream
    for k in range(1, cfg.max_prefill_batch + 1):
        with torch.inference_mode():
            graph = gpu_ms(lambda k=k: prefill.prefix_graphs.replay((0, k, 0)), side)
            eager = wall_ms(lambda k=k: prefill.prefix_forward(0, k), side)
            # The same forward with prompt tokens riding along (pad tokens: the same work).
            riding = {
                p: gpu_ms(lambda k=k, p=p: prefill.prefix_graphs.replay((0, k, p)), side)
                for p in prefill.prompt_buckets
            }
        prefixes.append(
            {"images": k, "graph_ms": graph, "eager_wall_ms": eager, "riding_graph_ms": riding}
        )
    compiled = None
    result = {
        "device": torch.cuda.get_device_name(),
        "context": args.context,
        "graphs": {
            "decode": len(steps.decode_graphs),
            "mixed": len(steps.mixed_graphs),
            "prefix": len(prefill.prefix_graphs),
            "image": len(prefill.image_graphs),
            "text_capture_s": capture_s,
            "image_capture_s": vision_capture_s,
            "pool_mib": {
                name: g.pool_bytes / 2**20
                for name, g in (
                    ("decode", steps.decode_graphs),
                    ("mixed", steps.mixed_graphs),
                    ("prefix", prefill.prefix_graphs),
                    ("image", prefill.image_graphs),
                )
            },
        },
        "mixed_steps": mixed,
        "image_path": images,
        "image_prefix": prefixes,
        "vision_compile": compiled,
    }
    out = args.out or Path("bench/results") / torch.cuda.get_device_name().replace(" ", "_")
    out.mkdir(parents=True, exist_ok=True)
    (out / "mixed_steps.json").write_text(json.dumps(result, indent=2))
    report(result, out)
    if args.compile_vision:  # last: a slow compile must not cost the tables above
        result["vision_compile"] = compile_vision(loaded.model.vision, vc, stream)
        (out / "mixed_steps.json").write_text(json.dumps(result, indent=2))
        report(result, out)


def compile_vision(vision: torch.nn.Module, vc: object, stream: torch.cuda.Stream) -> dict:
    """torch.compile of the vision tower: compile time and run time per crop count."""
    fn = torch.compile(vision.encode, mode=None)
    rows = []
    for crops in (1, 5, 9, 13):
        x = torch.randn(crops, 3, vc.crop_size, vc.crop_size, device="cuda", dtype=torch.bfloat16)
        with torch.inference_mode():
            t0 = time.perf_counter()
            ref = vision.encode(x)
            got = fn(x)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            err = (got.float() - ref.float()).abs().max().item()
            rows.append(
                {
                    "crops": crops,
                    "compile_s": compile_s,
                    "compiled_ms": gpu_ms(lambda x=x: fn(x), stream),
                    "eager_ms": gpu_ms(lambda x=x: vision.encode(x), stream),
                    "max_abs_diff": err,
                }
            )
    return {"mode": "default", "rows": rows}


def report(result: dict, out: Path) -> None:
    g = result["graphs"]
    print(
        f"\n{result['device']}: graphs decode {g['decode']}, mixed {g['mixed']}, prefix "
        f"{g['prefix']}, image {g['image']}; capture {g['text_capture_s']:.1f} s + "
        f"{g['image_capture_s']:.1f} s; pools (MiB) {g['pool_mib']}"
    )
    print(f"\n{'tokens':>6} {'graph ms':>9} {'eager ms':>9} {'varlen ms':>10}")
    for r in result["mixed_steps"]:
        print(
            f"{r['tokens']:>6} {r['graph_ms']:>9.3f} {r['eager_ms']:>9.3f} {r['varlen_ms']:>10.3f}"
        )
    print(f"\n{'crops':>5} {'tower ms':>9} {'path eager':>11} {'path graph':>11}")
    for r in result["image_path"]:
        print(
            f"{r['crops']:>5} {r['tower_ms']:>9.3f} {r['path_eager_wall_ms']:>11.3f} "
            f"{r['path_graph_ms']:>11.3f}"
        )
    riding = sorted({int(p) for r in result["image_prefix"] for p in r.get("riding_graph_ms", {})})
    head = "".join(f" {f'+{p} tok':>9}" for p in riding)
    print(f"\n{'images':>6} {'graph ms':>9} {'eager ms':>9}{head}")
    for r in result["image_prefix"]:
        ride = r.get("riding_graph_ms", {})
        cells = "".join(f" {ride.get(p, ride.get(str(p), 0.0)):>9.3f}" for p in riding)
        print(f"{r['images']:>6} {r['graph_ms']:>9.3f} {r['eager_wall_ms']:>9.3f}{cells}")
    if result["vision_compile"]:
        print(f"\n{'crops':>5} {'compile s':>9} {'compiled':>9} {'eager':>9} {'max diff':>9}")
        for r in result["vision_compile"]["rows"]:
            print(
                f"{r['crops']:>5} {r['compile_s']:>9.1f} {r['compiled_ms']:>9.3f} "
                f"{r['eager_ms']:>9.3f} {r['max_abs_diff']:>9.4f}"
            )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = result["mixed_steps"]
    xs = [r["tokens"] for r in steps]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(xs, [r["graph_ms"] for r in steps], "o-", label="graph replay (GPU)")
    ax.plot(xs, [r["eager_ms"] for r in steps], "s--", label="same forward, eager (wall)")
    ax.plot(xs, [r["varlen_ms"] for r in steps], "^:", label="PyTorch varlen, eager (wall)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens in the step")
    ax.set_ylabel("ms")
    ax.set_title(f"mixed step forward vs tokens - {result['device']}", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "mixed_steps.png", dpi=120)
    print(f"\nwrote {out / 'mixed_steps.json'} and {out / 'mixed_steps.png'}")


if __name__ == "__main__":
    main()
