"""Where a graphed decode step's device time goes: per kernel kind, and the idle time between
kernels inside the graph, beside the step's bandwidth floor.

    python -m bench.step_profile [--preset moondream3-preview --fp8-experts] [--batch 1 32]
        [--context 760] [--replays 20] [--set MODULE:NAME=VALUE ...] [--out DIR]

Captures the runtime's decode graphs on a random model (bench.profile_decode's set-up), then
replays each batch's graph (and, where the chip launches kernels early, the early-launch
graph an idle engine replays: rows "B early") ``--replays`` times under the profiler,
waiting for each replay before launching the next, so every kernel of a replay runs between
its graph launch and the next one (bench.kernel_timeline). Per replay: the span (first
kernel's start to last kernel's end), the time kernels ran (busy) and the gaps between
consecutive kernels (idle: launch latency, dependent-launch waits, tails of narrow kernels);
per kernel kind the count and time; and which transitions the idle time sits at. Medians over
the replays are printed, with the floor (the bytes the step reads over the measured copy
bandwidth, bench.decode_floor), and written to ``step_profile.json`` and ``step_profile.png``
under --out.

``--set`` changes a module constant before the model is built (an A/B of one choice, e.g.
``vlm_server.models.moondream3.text:FUSED_COMBINE=False``); the JSON records it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench import plotting
from bench.kernel_timeline import profiled_replays, summarize


def report(results: dict[str, Any], top: int = 8) -> None:
    """The table: per batch the span, busy, idle and floor, then kinds and idle spots."""
    for batch, r in results["batches"].items():
        span = r["span_us"]
        floor = r.get("floor_us")
        print(
            f"\n=== batch {batch}: span {span / 1e3:.3f} ms, kernels {r['kernels']:.0f}, busy "
            f"{r['busy_us'] / 1e3:.3f} ms, idle {r['idle_us'] / 1e3:.3f} ms "
            f"({100 * r['idle_us'] / max(span, 1e-9):.0f} %)"
            + (f", floor {floor / 1e3:.3f} ms" if floor else "")
        )
        print(f"{'kind':<38} {'count':>6} {'ms':>7} {'share':>6}")
        for kind, k in sorted(r["kinds"].items(), key=lambda kv: -kv[1]["us"]):
            share = 100 * k["us"] / max(span, 1e-9)
            print(f"{kind:<38} {k['count']:>6.0f} {k['us'] / 1e3:>7.3f} {share:>5.0f}%")
        print(f"{'idle before / after':<58} {'ms':>7}")
        for where, us in list(r["idle_at"].items())[:top]:
            print(f"{where:<58} {us / 1e3:>7.3f}")


def plot(results: dict[str, Any], path: str) -> bool:
    """Stacked bars per batch: each kind's time and the idle time, beside the floor."""
    plt = plotting.pyplot()
    if plt is None:
        return False
    batches = list(results["batches"])
    kinds = sorted({k for r in results["batches"].values() for k in r["kinds"]})
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.6 * len(batches)))
    for i, b in enumerate(batches):
        r, left = results["batches"][b], 0.0
        for j, kind in enumerate([*kinds, "idle"]):
            ms = (r["idle_us"] if kind == "idle" else r["kinds"].get(kind, {"us": 0})["us"]) / 1e3
            color = "lightgrey" if kind == "idle" else plt.cm.tab20(j % 20)
            ax.barh(i, ms, left=left, color=color, label=kind if i == 0 else None)
            left += ms
        if r.get("floor_us"):
            ax.plot([r["floor_us"] / 1e3] * 2, [i - 0.4, i + 0.4], "k--")
    ax.set_yticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_xlabel("ms (kernels by kind, then idle; dashed: bandwidth floor)")
    ax.legend(fontsize=6, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    plotting.save(plt, fig, path)
    return True


def profile_batch(
    rt: Any, batch: int, context: int, replays: int, early: bool = False
) -> dict[str, Any]:
    """`summarize` of ``replays`` replays of the decode graph of ``batch`` rows, each row at
    ``context`` positions (``early``: the graph whose kernels launch early, which an idle
    engine's decode steps replay where the chip has them)."""
    import torch

    buf = rt.buffers.slots[0]
    buf.launch_dev[:batch, 0] = torch.arange(batch)
    buf.launch_dev[:batch, 1] = context
    graphs = rt.steps.early_decode_graphs if early else rt.steps.decode_graphs
    return summarize(
        profiled_replays(lambda: graphs.replay((0, batch)), rt.dev.compute_stream, replays)
    )


def set_constant(setting: str) -> None:
    """``MODULE:NAME=VALUE``: set a module's constant (VALUE a Python literal) that exists."""
    import ast
    import importlib

    where, _, literal = setting.partition("=")
    module, _, name = where.partition(":")
    if not (module and name and literal):
        raise SystemExit(f"--set {setting!r}: expected MODULE:NAME=VALUE")
    mod = importlib.import_module(module)
    if not hasattr(mod, name):
        raise SystemExit(f"--set {setting!r}: {module} has no {name}")
    setattr(mod, name, ast.literal_eval(literal))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="moondream3-preview")
    ap.add_argument("--fp8-experts", action="store_true", help="experts in FP8 (md3's layout)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=760)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--set", action="append", default=[], metavar="MODULE:NAME=VALUE")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    for setting in args.set:
        set_constant(setting)
    from bench.decode_floor import copy_bandwidth, step_bytes
    from bench.profile_decode import decode_runtime
    from vlm_server.engine.device.model_entry import ModelEntryPoints

    rt, _, loaded = decode_runtime(args.preset, args.fp8_experts, max(args.batch), args.context)
    rt.capture_graphs(progress=False)
    bandwidth = copy_bandwidth()
    per_position = ModelEntryPoints(loaded.model).kv_page_bytes(1)
    moe = getattr(loaded.config.text, "moe", None)
    results: dict[str, Any] = {"settings": vars(args), "bandwidth_gb_s": bandwidth / 1e9}
    results["batches"] = {}
    for b in args.batch:
        nbytes = step_bytes(
            loaded.model.text, b, args.context, per_position,
            n_experts=moe.n_experts if moe else 0, top_k=moe.top_k if moe else 0,
        )  # fmt: skip
        for early in (False, True):
            if early and (0, b) not in rt.steps.early_decode_graphs:
                continue
            r = profile_batch(rt, b, args.context, args.replays, early)
            r["floor_us"] = nbytes / bandwidth * 1e6
            results["batches"][f"{b} early" if early else str(b)] = r
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plotting.write_rows(str(out / "step_profile.json"), results, plot)
    report(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
