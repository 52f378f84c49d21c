"""Step-level decode benchmark: forward, sampling and period per step, blocking vs pipelined.

Runs the real engine (scheduler thread, pipeline, graphs) on a seeded random checkpoint of the
chosen preset, N concurrent caption streams with a fixed number of output tokens, and reads:
  forward / sampling ms   CUDA events around each decode forward and each finalize
  period ms               wall time between consecutive decode commits at full batch
  gpu idle ms             period - (forward + sampling)
  host ms per tick        commit, finalize (mask build + upload), launch
  speedup                 blocking / pipelined wall time for the whole run, with the cost
                          model's prediction T_block / T_pipe x (1 - z), z ~ 1/L at 1 stream

    python -m bench.step_bench --preset moondream2 --streams 1 8 32 --tokens 128

Writes JSON and a PNG plot next to the printed table (default bench/results/<device>/).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import time
from pathlib import Path

import torch

from image_pipeline import prepare_image, sample_image_bytes
from vlm_server.engine.api import Finished, GenerationRequest, Task
from vlm_server.engine.config import LAUNCH_OVERLAP_MODES, EngineConfig
from vlm_server.engine.core.observer import Observer
from vlm_server.engine.core.pipeline import Step
from vlm_server.engine.engine import BatchedEngine
from vlm_server.models.interface import LoadedModel
from vlm_server.models.registry import load_model, preset, random_model
from vlm_server.server.in_process import InProcessEngine


class StepRecorder(Observer):
    """Collects device timing events, commit times and host seconds per tick."""

    def __init__(self) -> None:
        self.forwards: list[tuple[str, object, object]] = []
        self.samples: list[tuple[object, object]] = []
        self.commits: list[tuple[float, str, int]] = []
        self.host: list[tuple[float, float, float, float]] = []
        self._wait = 0.0  # the commit's wait for results within the current tick

    def forward_timed(self, kind: str, start: object, end: object) -> None:
        self.forwards.append((kind, start, end))

    def sample_timed(self, start: object, end: object) -> None:
        self.samples.append((start, end))

    def committed(self, step: Step) -> None:
        if self.device_timing:
            self.commits.append((time.perf_counter(), step.kind.value, len(step.seqs)))

    def waited(self, seconds: float) -> None:
        self._wait += seconds

    def tick(self, commit_s: float, finalize_s: float, launch_s: float) -> None:
        if self.device_timing:
            self.host.append((commit_s, finalize_s, launch_s, self._wait))
        self._wait = 0.0


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _elapsed(pairs: list[tuple[object, object]]) -> list[float]:
    out = []
    for start, end in pairs:
        if hasattr(start, "elapsed_time"):
            out.append(start.elapsed_time(end))  # type: ignore[attr-defined]
    return out


def _request(task: str, image: object, i: int, tokens: int) -> GenerationRequest:
    if task == "detect":  # 3 positions per box: about `tokens` decode steps per stream
        return GenerationRequest(
            Task.DETECT,
            image,
            request_id=str(i),  # type: ignore[arg-type]
            object_name="car",
            max_objects=max(1, tokens // 3),
        )
    return GenerationRequest(
        Task.CAPTION,
        image,
        request_id=str(i),  # type: ignore[arg-type]
        temperature=0,
        max_tokens=tokens,
        seed=i,
    )


async def run_case(
    loaded: LoadedModel,
    streams: int,
    tokens: int,
    depth: int,
    graphs: bool,
    kv_bytes: int | None,
    task: str = "caption",
    fused_decode: bool = True,
    observer: StepRecorder | None = None,
    launch_overlap: str = EngineConfig.launch_overlap,
    kv_dtype: str = "auto",
) -> dict:
    cfg = EngineConfig(
        kv_dtype=kv_dtype,
        fused_decode=fused_decode,
        launch_overlap=launch_overlap,
        pipeline_depth=depth,
        max_batch_size=max(streams, 1),
        cuda_graphs=graphs,
        kv_budget_bytes=kv_bytes,
    )
    rec = observer or StepRecorder()
    engine = InProcessEngine(BatchedEngine(loaded, cfg, observer=rec))
    await engine.start()
    rt = engine.batched.runtime
    image = prepare_image(sample_image_bytes())
    # Warm-up: the image prefix gets cached, kernels compiled, allocator primed.
    warm = GenerationRequest(Task.CAPTION, image, temperature=0, max_tokens=8)
    async for _ in await engine.submit(warm):
        pass
    rec.device_timing = True
    reqs = [_request(task, image, i, tokens) for i in range(streams)]

    async def one(req: GenerationRequest) -> Finished:
        async for event in await engine.submit(req):
            if isinstance(event, Finished):
                return event
        raise AssertionError("no result")

    t0 = time.perf_counter()
    results = await asyncio.gather(*[one(r) for r in reqs])
    wall = time.perf_counter() - t0
    while not engine.batched.idle():
        await asyncio.sleep(0.001)
    if rt.dev.is_cuda:
        torch.cuda.synchronize()
    fwd = [(s, e) for kind, s, e in rec.forwards if kind == "decode"]
    kinds = [kind for kind, _, _ in rec.forwards]
    fin = [p for p, k in zip(rec.samples, kinds, strict=False) if k == "decode"]
    commits = [(t, n) for t, kind, n in rec.commits if kind == "decode"]
    full = [b - a for (a, n1), (b, n2) in itertools.pairwise(commits) if n1 == n2 == streams]
    host = rec.host
    out_tokens = sum(r.metrics.output_tokens for r in results)
    if task == "detect":  # count decode steps: 3 per box
        out_tokens = 3 * sum(len(r.boxes) for r in results)
    row = {
        "streams": streams,
        "depth": depth,
        "graphs": graphs,
        "tokens": tokens,
        "task": task,
        "fused_decode": rt.fused_decode,
        "launch_overlap": rt.launch_overlap,
        "early_steps": rt.steps.early_steps,
        "forward_ms": _median(_elapsed(fwd)),
        "sampling_ms": _median(_elapsed(fin)),
        "period_ms": _median(full) * 1e3,
        "wall_s": wall,
        "tokens_per_s": out_tokens / wall,
        "host_commit_ms": _median([h[0] for h in host]) * 1e3,
        "host_finalize_ms": _median([h[1] for h in host]) * 1e3,
        "host_launch_ms": _median([h[2] for h in host]) * 1e3,
        # The tick's own work: its three parts less the commit's wait for the step's results
        # (what must stay under the forward for the GPU never to wait on the host).
        "host_wait_ms": _median([h[3] for h in host]) * 1e3,
        "host_busy_ms": _median([h[0] + h[1] + h[2] - h[3] for h in host]) * 1e3,
        "output_tokens": out_tokens,
    }
    row["gpu_idle_ms"] = row["period_ms"] - row["forward_ms"] - row["sampling_ms"]
    await engine.close()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def _add_floors(loaded: LoadedModel, rows: list[dict], tokens: int) -> None:
    """Each row's bandwidth floor (bench/decode_floor.py) beside its period: the bytes of the
    decoder's weights, the experts its rows route to and the KV they attend to (an image
    prefix, the prompt and half the answer per row), at the measured copy bandwidth."""
    from bench.decode_floor import copy_bandwidth, step_bytes
    from vlm_server.engine.device.model_entry import ModelEntryPoints

    bw = copy_bandwidth()
    moe = getattr(loaded.config.text, "moe", None)
    per_position = ModelEntryPoints(loaded.model).kv_page_bytes(1)
    context = loaded.config.image_prefix_len + 16 + tokens // 2
    for r in rows:
        nbytes = step_bytes(
            loaded.model.text,
            r["streams"],
            context,
            per_position,
            moe.n_experts if moe else 0,
            moe.top_k if moe else 0,
        )
        r["floor_ms"] = nbytes / bw * 1e3
        r["copy_tb_s"] = bw / 1e12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="moondream2")
    ap.add_argument(
        "--model",
        default=None,
        help="time this checkpoint (e.g. Moondream 3 with FP8 experts) instead of random "
        "weights of --preset",
    )
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument(
        "--weights",
        default=None,
        choices=["bf16", "int8", "int4"],
        help="the decoder's linears in 8 or 4 bits (quantized at load) [default: the model's]",
    )
    ap.add_argument("--kv-gib", type=float, default=8.0)
    ap.add_argument(
        "--task",
        default="caption",
        choices=["caption", "detect"],
        help="detect: constrained boundary masks and region values every step; "
        "the random model is biased so every stream runs to max_objects",
    )
    ap.add_argument(
        "--fused-decode",
        nargs="+",
        default=["true"],
        choices=["true", "false"],
        help="run every case with each setting of --fused-decode (true false: A/B, alternated)",
    )
    ap.add_argument(
        "--launch-overlap",
        nargs="+",
        default=[EngineConfig.launch_overlap],
        choices=list(LAUNCH_OVERLAP_MODES),
        help="run every case with each setting of --launch-overlap (off idle: A/B, alternated)",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    if args.model:
        loaded = load_model(args.model, dtype=dtype, device=device, weights=args.weights)
    else:
        loaded = random_model(
            preset(args.preset), seed=0, dtype=dtype, device=device, weights=args.weights
        )
    if args.task == "detect":
        coord = loaded.config.tokens.coord_id
        if coord is not None:
            with torch.no_grad():
                loaded.model.text.lm_head.bias[coord] += 1e4
    kv = int(args.kv_gib * (1 << 30)) if args.kv_gib else None
    rows = []
    for streams in args.streams:
        cases = itertools.product(args.depths, args.fused_decode, args.launch_overlap)
        for depth, fused, overlap in cases:
            row = asyncio.run(
                run_case(
                    loaded,
                    streams,
                    args.tokens,
                    depth,
                    not args.no_graphs,
                    kv,
                    args.task,
                    fused == "true",
                    launch_overlap=overlap,
                )
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
    if device == "cuda":
        _add_floors(loaded, rows, args.tokens)
    first = rows[0]
    by = {
        (r["streams"], r["depth"]): r
        for r in rows
        if (r["fused_decode"], r["launch_overlap"])
        == (first["fused_decode"], first["launch_overlap"])
    }
    for streams in args.streams:
        if (streams, 1) in by and (streams, 2) in by:
            b, p = by[(streams, 1)], by[(streams, 2)]
            z = 1.0 / args.tokens if streams == 1 else 0.0
            b["observed_speedup"] = p["observed_speedup"] = b["wall_s"] / p["wall_s"] - 1
            p["predicted_speedup"] = b["period_ms"] / p["period_ms"] * (1 - z) - 1
    out = args.out or Path("bench/results") / name.replace(" ", "_")
    out.mkdir(parents=True, exist_ok=True)
    name_json = "step_bench.json" if args.task == "caption" else f"step_bench_{args.task}.json"
    if args.weights in ("int8", "int4"):  # beside the 16-bit figures, not over them
        name_json = name_json.replace(".json", f"_{args.weights}.json")
    meta = {"device": name, "preset": args.preset, "dtype": args.dtype, "weights": args.weights}
    (out / name_json).write_text(json.dumps({**meta, "rows": rows}, indent=2))
    head = (
        f"{'streams':>7} {'depth':>5} {'fused':>5} {'pdl':>6} {'fwd ms':>7} {'samp ms':>7} "
        f"{'period':>7} "
        f"{'idle':>6} {'commit':>7} {'final':>6} {'launch':>6} {'tok/s':>8} {'speedup':>8} "
        f"{'floor':>6} {'busy':>6}"
    )
    model_name = args.model or args.preset
    print(f"\n{name}, {model_name} {args.dtype}, {args.tokens} tokens per stream")
    print(head)
    for r in rows:
        sp = r.get("observed_speedup")
        print(
            f"{r['streams']:>7} {r['depth']:>5} {r['fused_decode']!s:>5} "
            f"{r['launch_overlap']!s:>6} "
            f"{r['forward_ms']:>7.3f} "
            f"{r['sampling_ms']:>7.3f} {r['period_ms']:>7.3f} {r['gpu_idle_ms']:>6.3f} "
            f"{r['host_commit_ms']:>7.3f} {r['host_finalize_ms']:>6.3f} "
            f"{r['host_launch_ms']:>6.3f} {r['tokens_per_s']:>8.1f} "
            f"{'' if sp is None else f'{sp:+.1%}':>8} {r.get('floor_ms', float('nan')):>6.3f} "
            f"{r['host_busy_ms']:>6.3f}"
        )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for depth in args.depths:
            pts = [(r["streams"], r["period_ms"]) for r in rows if r["depth"] == depth]
            ax.plot(
                *zip(*pts, strict=True), marker="o", label="blocking" if depth == 1 else "pipelined"
            )
        ax.set_xlabel("streams")
        ax.set_ylabel("decode period (ms)")
        ax.set_title(f"{args.preset} on {name}")
        ax.legend()
        fig.savefig(
            out / name_json.replace(".json", ".png").replace("step_bench", "step_period"),
            dpi=120,
            bbox_inches="tight",
        )
    except ImportError:
        pass


if __name__ == "__main__":
    main()
