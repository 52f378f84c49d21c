"""Where the caption streams' step-gap tail comes from while new images arrive.

The arrivals target (`bench.arrival_itl`) reads the server's step intervals: with S caption
streams running, phase B's p99 over phase A's p50. This reads a step trace of the same two
phases (`--step-trace`, vlm_server/engine/step_trace.py) and tells each gap's parts apart:

- ``forward_ms`` / ``sample_ms``: the step's forward and sampling on the device;
- ``bubble_ms``: the compute stream idle before the forward began (the host launched late);
- ``prefill``: whether an image prefix batch was in flight when the step was launched;
- the scheduler's tick: its commit (with the wait for outputs), finalize and launch, its
  thread's wall and CPU time since the previous commit, and garbage collections.

A gap is the time between the host reading two consecutive steps with decode rows, as the
server's ``vlm_step_interval_seconds``. Two ways to get a trace:

    # a served run: the server writes the trace when it stops
    python -m bench.arrival_itl --spawn --out DIR -- --model M --step-trace DIR/trace.json
    python -m bench.step_gaps --trace DIR/trace.json --phases DIR/arrival_itl.json

    # an in-process engine (random weights): S captions, then Poisson arrivals at --rate
    python -m bench.step_gaps [--streams 16] [--rate 20] [--seconds 8] [--prefill-sms 96
        --prefill-sms-when-streaming 16] [--out DIR]

The in-process engine shares its interpreter with the clients' event loop, which a server's
engine process does not: its host figures are an upper bound. Prints each phase's gaps and
what the slowest 1% of them were made of, by step kind and prefill; writes
``step_gaps.json`` and ``step_gaps.png`` (gaps over time, coloured by prefill) under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench import plotting
from bench.synth_images import parse_size, unique_images
from image_pipeline import ImagePreparer
from vlm_server.engine import step_trace
from vlm_server.engine.api import GenerationRequest, Task
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.engine import BatchedEngine
from vlm_server.models.registry import preset, random_model
from vlm_server.server.in_process import InProcessEngine

PARTS = ("forward_ms", "sample_ms", "bubble_ms", "wait_ms", "host_ms", "tick_cpu_ms", "gc_ms")


def gap_rows(trace: list[dict[str, Any]], phases: dict[str, tuple[float, float]]) -> list[dict]:
    """One row per gap between steps with decode rows inside a phase, with its parts."""
    rows: list[dict] = []
    prev_t: float | None = None
    prev_end: float | None = None
    for s in trace:
        fwd_at, fwd = s["forward_start_ms"], s["forward_ms"]
        smp_at, smp = s["sample_start_ms"], s["sample_ms"]
        bubble = None
        if fwd_at is not None and prev_end is not None:
            bubble = max(0.0, fwd_at - prev_end)
        if fwd_at is not None:
            ends = [fwd_at + fwd] + ([smp_at + smp] if smp_at is not None else [])
            prev_end = max(ends + ([prev_end] if prev_end is not None else []))
        if not s["decode_rows"]:
            continue
        if prev_t is not None:
            phase = next((p for p, (a, b) in phases.items() if a <= s["t"] < b), None)
            if phase is not None:
                rows.append(
                    {
                        **s,
                        "phase": phase,
                        "gap_ms": (s["t"] - prev_t) * 1e3,
                        "bubble_ms": bubble,
                        "host_ms": s["commit_ms"] + s["finalize_ms"] + s["launch_ms"],
                    }
                )
        prev_t = s["t"]
    return rows


def _mean(rows: list[dict], key: str) -> float | None:
    xs = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.fmean(xs), 3) if xs else None


def _share(rows: list[dict], test: Any) -> float:
    return round(sum(1 for r in rows if test(r)) / max(len(rows), 1), 3)


def phase_summary(rows: list[dict], phase: str, a_p50: float) -> dict[str, Any]:
    """A phase's gap percentiles, and the means of each part over all gaps, over the slowest
    1%, and per step kind with and without a prefix in flight."""
    mine = [r for r in rows if r["phase"] == phase]
    gaps = [r["gap_ms"] for r in mine]
    if not gaps:
        return {"gaps": 0}
    cut = float(np.percentile(gaps, 99))
    tail = [r for r in mine if r["gap_ms"] >= cut]
    groups = {}
    for kind in ("decode", "mixed"):
        for busy in (False, True):
            g = [r for r in mine if r["kind"] == kind and r["prefill"] is busy]
            if g:
                key = f"{kind}/{'prefill' if busy else 'idle'}"
                groups[key] = {
                    "gaps": len(g),
                    "gap_p50_ms": round(float(np.percentile([r["gap_ms"] for r in g], 50)), 3),
                    "gap_p99_ms": round(float(np.percentile([r["gap_ms"] for r in g], 99)), 3),
                    **{k: _mean(g, k) for k in ("forward_ms", "host_ms")},
                }
    return {
        "gaps": len(gaps),
        "p50_ms": round(float(np.percentile(gaps, 50)), 3),
        "p90_ms": round(float(np.percentile(gaps, 90)), 3),
        "p99_ms": round(cut, 3),
        "p99_over_a_p50": round(cut / a_p50, 3),
        "prefill_share": _share(mine, lambda r: r["prefill"]),
        "mixed_share": _share(mine, lambda r: r["kind"] == "mixed"),
        "all": {k: _mean(mine, k) for k in ("gap_ms", *PARTS)},
        "tail": {
            "gaps": len(tail),
            "prefill_share": _share(tail, lambda r: r["prefill"]),
            "mixed_share": _share(tail, lambda r: r["kind"] == "mixed"),
            **{k: _mean(tail, k) for k in ("gap_ms", *PARTS)},
        },
        "by_kind": groups,
        "worst": sorted(mine, key=lambda r: -r["gap_ms"])[:12],
    }


def analyse(trace: list[dict], phases: dict[str, tuple[float, float]]) -> dict[str, Any]:
    rows = gap_rows(trace, phases)
    a = [r["gap_ms"] for r in rows if r["phase"] == "A"]
    if not a:
        raise SystemExit("no steps with decode rows in phase A: is this the run's trace?")
    a_p50 = float(np.percentile(a, 50))
    t0 = phases["A"][0]
    for r in rows:
        r["t"] = round(r["t"] - t0, 4)
    return {
        "A": phase_summary(rows, "A", a_p50),
        "B": phase_summary(rows, "B", a_p50),
        "rows": rows,
    }


# ---- the in-process run ---------------------------------------------------------------------


async def drive(args: argparse.Namespace, engine: InProcessEngine) -> dict[str, Any]:
    """Warm-up, phase A (captions), phase B (captions and arrivals); the phases' wall times."""
    host = ImagePreparer(device="cpu")
    w, h = parse_size(args.size)
    n_arrivals = int(args.rate * args.seconds * 1.5) + 8
    pictures = unique_images(w, h, list(range(n_arrivals + 1)), seed=args.seed, threads=8)
    caption_picture = host.decode_host(pictures[0])
    arrivals = [host.decode_host(p) for p in pictures[1:]]
    stop = False

    async def consume(req: GenerationRequest) -> None:
        async for _ in await engine.submit(req):
            pass

    caption = GenerationRequest(
        Task.CAPTION, caption_picture, max_tokens=args.caption_tokens, temperature=0
    )
    await consume(caption)  # the captions' prefix enters the cache
    for pic in arrivals[:4]:  # the arrivals' path runs once before the clock
        await consume(GenerationRequest(Task.QUERY, pic, question="What?", max_tokens=3))

    async def stream(delay: float) -> None:
        await asyncio.sleep(delay)
        while not stop:
            await consume(caption)

    streams = [
        asyncio.create_task(stream(i * args.warmup_s / 2 / args.streams))
        for i in range(args.streams)
    ]
    await asyncio.sleep(args.warmup_s)
    t_a = time.time()
    await asyncio.sleep(args.seconds)
    t_b = time.time()
    rng, pending = random.Random(args.seed), []
    q = "What is the title of this chart?"
    next_at = t_b
    for pic in arrivals[4:]:
        next_at += rng.expovariate(args.rate)
        if next_at >= t_b + args.seconds:
            break
        await asyncio.sleep(max(0.0, next_at - time.time()))
        req = GenerationRequest(Task.QUERY, pic, question=q, max_tokens=3, temperature=0)
        pending.append(asyncio.create_task(consume(req)))
    await asyncio.sleep(max(0.0, t_b + args.seconds - time.time()))
    t_end = time.time()
    stop = True
    await asyncio.gather(*pending, *streams)
    return {"A": (t_a, t_b), "B": (t_b, t_end), "arrivals": len(pending)}


async def run_in_process(args: argparse.Namespace, trace_path: Path) -> dict[str, Any]:
    cuda = args.device == "cuda"
    print(f"building a random {args.preset} engine ...", flush=True)
    loaded = random_model(
        preset(args.preset), dtype=torch.bfloat16 if cuda else torch.float32, device=args.device
    )
    cfg = EngineConfig(
        max_batch_size=args.max_batch,
        prefill_sms=args.prefill_sms,
        prefill_sms_when_streaming=args.prefill_sms_when_streaming,
    )
    trace = step_trace.StepTrace(trace_path)
    batched = BatchedEngine(
        loaded, cfg, observer=trace, image_preparer=ImagePreparer(device=args.device)
    )
    trace.prefill_busy = batched.runtime.prefill_busy
    engine = InProcessEngine(batched)
    await engine.start()
    phases = await drive(args, engine)
    await engine.close()  # writes the trace
    return phases


def plot(out: dict, path: str) -> bool:
    plt = plotting.pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(11, 4))
    rows = out["rows"]
    for busy, colour in ((False, "tab:blue"), (True, "tab:red")):
        xs = [r["t"] for r in rows if r["prefill"] is busy]
        ys = [r["gap_ms"] for r in rows if r["prefill"] is busy]
        ax.scatter(xs, ys, s=3, c=colour, label="prefix in flight" if busy else "no prefix")
    ax.axhline(2 * out["A"]["p50_ms"], color="k", lw=0.8, ls="--", label="2x phase A p50")
    ax.set_xlabel("s from phase A's start (B from its middle)")
    ax.set_ylabel("step gap (ms)")
    ax.set_title(f"step gaps: captions, then captions + arrivals ({out['source']})")
    ax.legend(loc="upper left", markerscale=4)
    plotting.save(plt, fig, path)
    return True


def report(out: dict) -> None:
    print(f"\n{out['source']}")
    print(
        "phase  gaps    p50    p90    p99 p99/A50 | tail: prefill mixed   gap   fwd  bubble"
        "  wait  host  cpu   gc"
    )
    for name in ("A", "B"):
        s = out[name]
        if not s["gaps"]:
            continue
        t = s["tail"]
        cols = " ".join(
            f"{t[k] if t[k] is not None else '-':>5}"
            for k in ("gap_ms", *PARTS)
            if k != "sample_ms"
        )
        print(
            f"{name:5s} {s['gaps']:5d} {s['p50_ms']:6.2f} {s['p90_ms']:6.2f} {s['p99_ms']:6.2f}"
            f" {s['p99_over_a_p50']:7.2f} | {t['prefill_share']:13.2f} {t['mixed_share']:5.2f} "
            + cols
        )
        for key, g in s["by_kind"].items():
            print(
                f"    {key:15s} {g['gaps']:5d} gaps, p50 {g['gap_p50_ms']:.2f} p99 "
                f"{g['gap_p99_ms']:.2f} ms, forward {g['forward_ms']} ms, host {g['host_ms']} ms"
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", help="a server's --step-trace file (else: run in process)")
    ap.add_argument("--phases", help="with --trace: the run's arrival_itl JSON (phases_unix)")
    ap.add_argument("--preset", default="moondream2")
    ap.add_argument("--device", default="cuda", help="cpu: a check of this script only")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--rate", type=float, default=20.0, help="phase B arrivals a second")
    ap.add_argument("--seconds", type=float, default=8.0, help="length of each phase")
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--caption-tokens", type=int, default=256)
    ap.add_argument("--size", default="800x600")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--prefill-sms", type=int, default=0)
    ap.add_argument("--prefill-sms-when-streaming", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.trace:
        if not args.phases:
            ap.error("--trace needs --phases (the arrival_itl JSON of the same run)")
        phases = {
            k: tuple(v) for k, v in json.loads(Path(args.phases).read_text())["phases_unix"].items()
        }
        trace_path, source = Path(args.trace), f"server trace {Path(args.trace).name}"
    else:
        trace_path = out_dir / "step_trace.json"
        phases = asyncio.run(run_in_process(args, trace_path))
        source = (
            f"in-process {args.preset}, {args.streams} captions, {phases.pop('arrivals')} arrivals"
        )
    out = {"source": source, **analyse(step_trace.load(trace_path), phases)}
    plotting.write_rows(str(out_dir / "step_gaps.json"), out, plot)
    report(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
