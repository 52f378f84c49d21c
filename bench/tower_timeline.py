"""The vision tower's CUDA graph, kernel by kernel: what each kind of kernel takes per replay and
what the GPU spends between kernels (CUDA only).

    python -m bench.tower_timeline [--crops 9] [--replays 3] [--out DIR]

Captures the bf16 tower (random weights) as one graph, times replays with CUDA events, then
records a few replays with the profiler and reads the kernels' start and end times from its
trace: per kind of kernel (cuBLAS products, cuDNN attention, the fused add + LayerNorm,
memsets, ...) the count and time per replay, and the idle time between consecutive kernels by
the pair of kinds it lies between. Writes ``tower_timeline.json`` and a plot to ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

# Kernel kinds by a word of their name, first match wins.
KINDS = (
    ("nvjet", "cuBLAS product"),
    ("gemm", "cuBLAS product"),
    ("cudnn", "cuDNN attention"),
    ("flash", "flash attention"),
    ("_add_layernorm", "add + LayerNorm"),
    ("layer_norm", "LayerNorm"),
    ("memset", "memset"),
    ("memcpy", "copy"),
    ("elementwise", "elementwise"),
)


def kind_of(name: str) -> str:
    """The kind a kernel's name belongs to (the name's first 40 characters otherwise)."""
    low = name.lower()
    for word, kind in KINDS:
        if word in low:
            return kind
    return name[:40]


def summarize(events: Sequence[dict], replays: int) -> dict:
    """Kernel events (``name``, ``ts`` and ``dur`` in us) of ``replays`` back-to-back replays
    -> per-replay busy time, span and idle time, per kind and per pair of kinds."""
    if replays < 1:
        raise ValueError("replays must be >= 1")
    ev = sorted(events, key=lambda e: e["ts"])
    if not ev:
        raise ValueError("no kernel events")
    kinds: dict[str, list[float]] = defaultdict(list)
    for e in ev:
        kinds[kind_of(e["name"])].append(e["dur"])
    gaps: dict[str, list[float]] = defaultdict(list)
    for a, b in itertools.pairwise(ev):
        idle = b["ts"] - (a["ts"] + a["dur"])
        gaps[f"{kind_of(a['name'])} -> {kind_of(b['name'])}"].append(max(0.0, idle))
    span = ev[-1]["ts"] + ev[-1]["dur"] - ev[0]["ts"]
    busy = sum(e["dur"] for e in ev)
    return {
        "kernels_per_replay": len(ev) / replays,
        "span_us": span / replays,
        "busy_us": busy / replays,
        "idle_us": (span - busy) / replays,
        "kinds": _per_replay(kinds, replays),
        "gaps": _per_replay(gaps, replays),
    }


def _per_replay(times: dict[str, list[float]], replays: int) -> dict[str, dict]:
    """Count, total and median of each key's times per replay, largest total first."""
    return {
        k: {"count": len(v) / replays, "us": sum(v) / replays, "median_us": statistics.median(v)}
        for k, v in sorted(times.items(), key=lambda kv: -sum(kv[1]))
    }


def _kernel_events(trace_path: str) -> list[dict]:
    with open(trace_path) as f:
        trace = json.load(f)
    cats = ("kernel", "gpu_memset", "gpu_memcpy")
    return [e for e in trace["traceEvents"] if e.get("cat") in cats and "dur" in e]


def measure(crops: int, replays: int) -> dict:
    """Event-timed replays and the profiled timeline of the bf16 tower at ``crops`` crops."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.graph_timing import graph_ms
    from vlm_server.models.common.vision import VisionEncoder
    from vlm_server.models.moondream2.config import VisionConfig

    torch.manual_seed(0)
    dt = torch.bfloat16
    enc = VisionEncoder(VisionConfig()).to("cuda", dt).eval()
    for p in enc.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(crops, 3, 378, 378, device="cuda", dtype=dt)
    with torch.inference_mode():
        replay_ms = graph_ms(lambda: enc.encode(x), reps=20)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            enc.encode(x)
        side.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
            enc.encode(x)
        graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                graph.replay()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        events = _kernel_events(path)
    out = summarize(events, replays)
    out.update(device=torch.cuda.get_device_name(), crops=crops, replay_ms=replay_ms)
    return out


def print_table(out: dict, top: int = 8) -> None:
    print(
        f"\ntower, {out['crops']} crops, {out['device']}: event-timed replay "
        f"{out['replay_ms']:.3f} ms; profiled span {out['span_us'] / 1e3:.3f} ms = kernels "
        f"{out['busy_us'] / 1e3:.3f} + idle {out['idle_us'] / 1e3:.3f} "
        f"({out['kernels_per_replay']:.0f} kernels a replay)"
    )
    print(f"{'kind':<24} {'count':>6} {'ms':>8} {'median us':>10}")
    for k, v in out["kinds"].items():
        print(f"{k:<24} {v['count']:>6.0f} {v['us'] / 1e3:>8.3f} {v['median_us']:>10.1f}")
    print(f"\n{'idle between':<40} {'count':>6} {'us':>8} {'median us':>10}")
    for k, v in list(out["gaps"].items())[:top]:
        print(f"{k:<40} {v['count']:>6.0f} {v['us']:>8.1f} {v['median_us']:>10.2f}")


def plot(out: dict, path: Path) -> bool:
    """Per-replay time by kernel kind, and the idle time, as bars; False without matplotlib."""
    from bench import plotting

    plt = plotting.pyplot()
    if plt is None:
        return False
    labels = [*out["kinds"], "idle between kernels"]
    values = [v["us"] / 1e3 for v in out["kinds"].values()] + [out["idle_us"] / 1e3]
    fig, ax = plt.subplots(figsize=(7, 0.8 + 0.3 * len(labels)))
    ax.barh(labels, values)
    ax.invert_yaxis()
    ax.set(
        xlabel="ms a replay",
        title=f"tower graph, {out['crops']} crops, {out['device']}, "
        f"replay {out['replay_ms']:.2f} ms",
    )
    ax.grid(alpha=0.3, axis="x")
    plotting.save(plt, fig, str(path))
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--crops", type=int, default=9)
    ap.add_argument("--replays", type=int, default=3, help="profiled replays")
    ap.add_argument("--out", type=Path, default=None, help="folder for the JSON and the plot")
    args = ap.parse_args()
    if args.crops < 1 or args.replays < 1:
        ap.error("--crops and --replays must be >= 1")
    import torch

    if not torch.cuda.is_available():
        print("tower_timeline needs a CUDA device", file=sys.stderr)
        return 1
    out = measure(args.crops, args.replays)
    print_table(out)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tower_timeline.json").write_text(json.dumps(out, indent=1))
        drawn = plot(out, args.out / "tower_timeline.png")
        print(f"wrote {args.out / 'tower_timeline.json'}" + (" and its plot" if drawn else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
