"""The vision tower's CUDA graph, kernel by kernel: what each kind of kernel takes per replay and
what the GPU spends between kernels (CUDA only).

    python -m bench.tower_timeline [--crops 9] [--replays 3] [--out DIR]

Captures the bf16 tower (random weights) as one graph, times replays with CUDA events, then
records a few replays with the profiler and reads the kernels' start and end times from its
trace (bench.kernel_timeline): per kind of kernel (cuBLAS products, attention, norms, copies,
...) the count and time per replay, and the idle time between consecutive kernels by the pair
of kinds it lies between, medians over the replays. Writes ``tower_timeline.json`` and a plot
to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.kernel_timeline import profiled_replays, summarize


def measure(crops: int, replays: int) -> dict:
    """Event-timed replays and the profiled timeline of the bf16 tower at ``crops`` crops."""
    import torch

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
        out = summarize(profiled_replays(graph.replay, side, replays))
    out.update(device=torch.cuda.get_device_name(), crops=crops, replay_ms=replay_ms)
    return out


def print_table(out: dict, top: int = 8) -> None:
    print(
        f"\ntower, {out['crops']} crops, {out['device']}: event-timed replay "
        f"{out['replay_ms']:.3f} ms; profiled span {out['span_us'] / 1e3:.3f} ms = kernels "
        f"{out['busy_us'] / 1e3:.3f} + idle {out['idle_us'] / 1e3:.3f} "
        f"({out['kernels']:.0f} kernels a replay)"
    )
    print(f"{'kind':<40} {'count':>6} {'ms':>8}")
    for k, v in sorted(out["kinds"].items(), key=lambda kv: -kv[1]["us"]):
        print(f"{k:<40} {v['count']:>6.0f} {v['us'] / 1e3:>8.3f}")
    print(f"\n{'idle between':<60} {'us':>8}")
    for k, us in list(out["idle_at"].items())[:top]:
        print(f"{k:<60} {us:>8.1f}")


def plot(out: dict, path: Path) -> bool:
    """Per-replay time by kernel kind, and the idle time, as bars; False without matplotlib."""
    from bench import plotting

    plt = plotting.pyplot()
    if plt is None:
        return False
    kinds = sorted(out["kinds"].items(), key=lambda kv: -kv[1]["us"])
    labels = [k for k, _ in kinds] + ["idle between kernels"]
    values = [v["us"] / 1e3 for _, v in kinds] + [out["idle_us"] / 1e3]
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
    ap.add_argument("--replays", type=int, default=5, help="profiled replays")
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
