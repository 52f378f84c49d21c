"""Where one request's latency goes inside the engine, on the GPU: unique-image query
requests sent one at a time (c=1) to an in-process engine that takes the server's
engine-process image path (host decode here, crops made by the engine on its prefill stream).

Per request, host stamps: the decode, the submit, the first token, the end; the engine's
own queue / prefill / first-token times. For ``--profile`` requests (after the timed ones)
a torch.profiler trace is read back: each stream's kernel time inside the request, the GPU's
idle gaps (with the kernels either side) and what the scheduler thread did in the biggest
of them.

    python -m bench.request_timeline [--requests 40] [--profile 3] [--out DIR]

Writes ``request_timeline.json`` (and the first profiled request's chrome trace) under
``--out``, and prints the tables.

With ``--concurrency N`` (N > 1) it answers where a saturated engine's GPU time goes
instead: N clients send unique-image queries (decoded ahead, so the clients cost the engine
nothing), and after ``--warmup-s`` a ``--window-ms`` profile gives each stream's busy time and
idle gaps and the requests completed in it: GPU milliseconds per image, per stream.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.synth_images import parse_size, unique_images
from image_pipeline import ImagePreparer
from vlm_server.engine.api import Finished, GenerationRequest, Task
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.engine import BatchedEngine
from vlm_server.models.capabilities import need
from vlm_server.models.registry import preset, random_model
from vlm_server.server.in_process import InProcessEngine

# A gap in the GPU's work shorter than this is launch jitter, not worth listing.
GAP_US = 50.0
# Kernels listed per stream in the saturated view.
TOP_KERNELS = 25


@dataclass
class Stamps:
    decode_ms: float = 0.0
    submit_ms: float = 0.0  # decode end -> submit returned
    first_ms: float = 0.0  # submit returned -> first event
    rest_ms: float = 0.0  # first event -> finished
    total_ms: float = 0.0
    engine: dict[str, float] = field(default_factory=dict)


async def one_request(
    engine: InProcessEngine, preparer: ImagePreparer, data: bytes, question: str
) -> Stamps:
    t0 = time.perf_counter()
    image = preparer.decode_host(data)
    t1 = time.perf_counter()
    stream = await engine.submit(
        GenerationRequest(Task.QUERY, image, question=question, max_tokens=3, temperature=0)
    )
    t2 = time.perf_counter()
    first = None
    done: Finished | None = None
    async for event in stream:
        if first is None:
            first = time.perf_counter()
        if isinstance(event, Finished):
            done = event
    t3 = time.perf_counter()
    assert first is not None and done is not None
    m = done.metrics
    return Stamps(
        (t1 - t0) * 1e3,
        (t2 - t1) * 1e3,
        (first - t2) * 1e3,
        (t3 - first) * 1e3,
        (t3 - t0) * 1e3,
        {
            "queue_wait_ms": m.queue_wait_ms,
            "ttft_ms": m.time_to_first_token_ms,
            "prefill_ms": m.prefill_ms,
            "decode_ms": m.decode_ms,
        },
    )


def gpu_view(trace: dict, window: tuple[float, float]) -> dict:
    """Kernel time per stream, busy time and idle gaps of the GPU inside ``window`` (us)."""
    lo, hi = window
    kernels = sorted(
        (e for e in trace["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy")),
        key=lambda e: e["ts"],
    )
    kernels = [e for e in kernels if lo <= e["ts"] <= hi]
    per_stream: dict[str, float] = {}
    for e in kernels:
        key = f"stream {e.get('args', {}).get('stream', '?')}"
        per_stream[key] = per_stream.get(key, 0.0) + e["dur"]
    gaps, busy, end, prev = [], 0.0, None, None
    for e in kernels:
        s, d = e["ts"], e["dur"]
        if end is not None and s - end > GAP_US:
            gaps.append(
                {
                    "at_us": round(end - lo, 1),
                    "gap_us": round(s - end, 1),
                    "after": prev["name"][:60] if prev else "",
                    "before": e["name"][:60],
                }
            )
        if end is None or s > end:
            busy += d
            end, prev = s + d, e
        elif s + d > end:
            busy += s + d - end
            end, prev = s + d, e
    cpu = [
        e
        for e in trace["traceEvents"]
        if e.get("cat") == "cuda_runtime" and lo <= e.get("ts", 0) <= hi
    ]
    launches = {}
    for e in cpu:
        launches[e["name"]] = launches.get(e["name"], 0) + 1
    first_k = kernels[0]["ts"] - lo if kernels else None
    return {
        "window_us": round(hi - lo, 1),
        "first_kernel_at_us": round(first_k, 1) if first_k is not None else None,
        "gpu_busy_us": round(busy, 1),
        "kernel_us_per_stream": {k: round(v, 1) for k, v in per_stream.items()},
        "gaps": sorted(gaps, key=lambda g: -g["gap_us"])[:12],
        "gaps_total_us": round(sum(g["gap_us"] for g in gaps), 1),
        "runtime_calls": dict(sorted(launches.items(), key=lambda kv: -kv[1])[:12]),
    }


def stream_view(trace: dict, window: tuple[float, float]) -> dict:
    """Per stream inside ``window`` (us): kernel time, busy time (kernels merged) and the
    idle gaps between its kernels, with the longest ones."""
    lo, hi = window
    by_stream: dict[str, list[dict]] = {}
    for e in trace["traceEvents"]:
        if e.get("cat") in ("kernel", "gpu_memcpy") and lo <= e["ts"] <= hi:
            by_stream.setdefault(str(e.get("args", {}).get("stream", "?")), []).append(e)
    out = {}
    for name, events in by_stream.items():
        events.sort(key=lambda e: e["ts"])
        by_kernel: dict[str, list[float]] = {}
        for e in events:
            by_kernel.setdefault(e["name"][:70], []).append(e["dur"])
        busy, end, gaps = 0.0, None, []
        for e in events:
            s, d = e["ts"], e["dur"]
            if end is not None and s > end:
                gaps.append((s - end, e["name"][:50]))
            if end is None or s > end:
                busy += d
                end = s + d
            elif s + d > end:
                busy += s + d - end
                end = s + d
        out[name] = {
            "kernels": len(events),
            "kernel_us": round(sum(e["dur"] for e in events), 1),
            "busy_us": round(busy, 1),
            "idle_us": round(sum(g for g, _ in gaps), 1),
            "longest_gaps": [(round(g, 1), k) for g, k in sorted(gaps, reverse=True)[:5]],
            # Where the stream's time goes: kernel name, total us, calls.
            "top_kernels": [
                (k, round(sum(d), 1), len(d))
                for k, d in sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))[:TOP_KERNELS]
            ],
        }
    return out


async def saturated(args: argparse.Namespace, engine: InProcessEngine, pictures: list) -> dict:
    """N clients in a loop over unique decoded pictures; a profile of one window."""
    q = "What is the title of this chart?"
    stop, done, next_pic = False, [], iter(range(len(pictures)))

    async def client() -> None:
        while not stop:
            i = next(next_pic, None)
            if i is None:
                return
            stream = await engine.submit(
                GenerationRequest(Task.QUERY, pictures[i], question=q, max_tokens=3, temperature=0)
            )
            async for _ in stream:
                pass
            done.append(time.perf_counter())

    tasks = [asyncio.create_task(client()) for _ in range(args.concurrency)]
    await asyncio.sleep(args.warmup_s)
    cuda = args.device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0, n0 = time.perf_counter(), len(done)
        await asyncio.sleep(args.window_ms / 1e3)
        # And until --window-requests completed in it: on a slow machine (a check on a busy
        # CPU) a fixed window may see none.
        while len(done) - n0 < args.window_requests and not all(t.done() for t in tasks):
            await asyncio.sleep(0.01)
        t1, n1 = time.perf_counter(), len(done)
    stop = True
    await asyncio.gather(*tasks)
    path = Path(args.out) / "saturated_trace.json"
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    path.unlink()  # hundreds of MB: the tables keep what matters
    ts = [e["ts"] for e in trace["traceEvents"] if e.get("cat") == "kernel"]
    window = (min(ts), max(ts)) if ts else (0.0, 0.0)  # no kernels on the CPU
    images = n1 - n0
    streams = stream_view(trace, window)
    return {
        "concurrency": args.concurrency,
        "window_ms": round((t1 - t0) * 1e3, 1),
        "completed": images,
        "req_per_s": round(images / (t1 - t0), 2),
        "streams": streams,
        "busy_ms_per_image": {
            k: round(v["busy_us"] / 1e3 / max(images, 1), 3) for k, v in streams.items()
        },
        "gpu": gpu_view(trace, window),
    }


def summary(rows: list[Stamps]) -> dict[str, float]:
    def p50(xs: list[float]) -> float:
        return round(statistics.median(xs), 3)

    out = {
        k: p50([getattr(r, k) for r in rows])
        for k in ("decode_ms", "submit_ms", "first_ms", "rest_ms", "total_ms")
    }
    for k in rows[0].engine:
        out[f"engine_{k}"] = p50([r.engine[k] for r in rows])
    return out


async def run(args: argparse.Namespace) -> dict:
    w, h = parse_size(args.size)
    n = args.warmup + args.requests + args.profile
    if args.concurrency > 1:  # enough unique pictures for the warm-up and the window
        n = int(80 * (args.warmup_s + args.window_ms / 1e3)) + 2 * args.concurrency
    pictures = unique_images(w, h, list(range(n)), seed=args.seed, threads=8)
    print(f"building a random {args.preset} engine ...", flush=True)
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    loaded = random_model(preset(args.preset), dtype=dtype, device=args.device)
    if args.fp8_experts:
        need(loaded.model.capabilities.fp8_experts, "fp8_experts", loaded.model).use_fp8_experts()
    cfg = EngineConfig(
        max_batch_size=args.max_batch,
        vision_fp8=args.vision_fp8,
        experts_fp8_activations=args.experts_fp8_activations,
    )
    engine = InProcessEngine(
        BatchedEngine(loaded, cfg, image_preparer=ImagePreparer(device=args.device))
    )
    await engine.start()
    host = ImagePreparer(device="cpu")
    if args.concurrency > 1:
        decoded = [host.decode_host(data) for data in pictures]
        result = await saturated(args, engine, decoded)
        await engine.close()
        name = torch.cuda.get_device_name() if cuda else "cpu"
        return {"device": name, "size": args.size, "saturated": result}
    q = "What is the title of this chart?"
    for data in pictures[: args.warmup]:
        await one_request(engine, host, data, q)
    timed = pictures[args.warmup : args.warmup + args.requests]
    rows = [await one_request(engine, host, data, q) for data in timed]
    profiled = []
    traces = []
    for i, data in enumerate(pictures[args.warmup + args.requests :]):
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            stamps = await one_request(engine, host, data, q)
        path = Path(args.out) / f"request_trace_{i}.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
        if i:
            path.unlink()
        # The window: from the first event the profiler saw to the last.
        ts = [e["ts"] for e in trace["traceEvents"] if "ts" in e and e.get("ph") == "X"]
        view = gpu_view(trace, (min(ts), max(ts)))
        view["stamps"] = stamps.__dict__
        profiled.append(view)
        traces.append(path)
    await engine.close()
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "preset": args.preset,
        "size": args.size,
        "requests": args.requests,
        "timed_p50": summary(rows),
        "timed": [r.__dict__ for r in rows],
        "profiled": profiled,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="moondream2")
    ap.add_argument("--size", default="800x600")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--profile", type=int, default=3)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--device", default="cuda", help="cpu: a check of this script only")
    ap.add_argument("--out", default=".")
    ap.add_argument("--concurrency", type=int, default=1, help=">1: the saturated view")
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--window-ms", type=float, default=500.0)
    ap.add_argument(
        "--window-requests",
        type=int,
        default=0,
        help="keep the window open until this many requests completed in it",
    )
    ap.add_argument(
        "--fp8-experts",
        action="store_true",
        help="hold a mixture-of-experts model's expert weights in FP8 (as its checkpoints do)",
    )
    ap.add_argument("--vision-fp8", action="store_true", help="the server's --vision-fp8 true")
    ap.add_argument(
        "--experts-fp8-activations",
        action="store_true",
        help="the server's --experts-fp8-activations true (with --fp8-experts)",
    )
    args = ap.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result = asyncio.run(run(args))
    if "saturated" in result:
        sat = result["saturated"]
        (Path(args.out) / "saturated_timeline.json").write_text(json.dumps(result, indent=1))
        print(
            f"\nc={sat['concurrency']}: {sat['completed']} requests in {sat['window_ms']} ms "
            f"({sat['req_per_s']} req/s); GPU busy {sat['gpu']['gpu_busy_us'] / 1e3:.1f} ms"
        )
        for name, v in sat["streams"].items():
            print(
                f"  stream {name}: {v['kernels']} kernels, busy {v['busy_us'] / 1e3:.1f} ms "
                f"({sat['busy_ms_per_image'][name]:.2f} ms per request), idle between its "
                f"kernels {v['idle_us'] / 1e3:.1f} ms; longest gaps {v['longest_gaps'][:3]}"
            )
            for kname, us, calls in v["top_kernels"][:12]:
                per = us / 1e3 / max(sat["completed"], 1)
                print(f"    {per:7.3f} ms/request  {calls:6d} calls  {kname}")
        return 0
    (Path(args.out) / "request_timeline.json").write_text(json.dumps(result, indent=1))
    print("\nc=1, p50 over", args.requests, "requests (ms)")
    for k, v in result["timed_p50"].items():
        print(f"  {k:24s} {v:8.3f}")
    for i, view in enumerate(result["profiled"]):
        print(
            f"\nprofiled request {i}: window {view['window_us'] / 1e3:.2f} ms, GPU busy "
            f"{view['gpu_busy_us'] / 1e3:.2f} ms, first kernel at "
            f"{(view['first_kernel_at_us'] or 0) / 1e3:.2f} ms, gaps "
            f"{view['gaps_total_us'] / 1e3:.2f} ms"
        )
        for k, v in view["kernel_us_per_stream"].items():
            print(f"  {k}: {v / 1e3:.2f} ms of kernels")
        for g in view["gaps"][:8]:
            print(
                f"  gap {g['gap_us']:8.1f} us at {g['at_us'] / 1e3:6.2f} ms: "
                f"{g['after']} -> {g['before']}"
            )
        print("  runtime calls:", view["runtime_calls"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
