"""Does pacing a new image's prefix work bound the decode steps' tail? (CUDA only)

    python -m bench.prefix_pacing [--streams 16] [--rate 20] [--seconds 4] [--slices 2 4 8 16]
        [--green-sms 96 112] [--json OUT.json]

An emulation at moondream2's shapes, outside the engine, to decide before building: a loop of
decode-shaped steps (each layer's four products at M = streams rows, attention over 800
cached positions, the LM head) runs back to back on a high-priority stream, at most two in
flight as the engine's pipeline keeps them, while images arrive at ``--rate`` a second. Each
image's work is the real vision tower (9 crops, bf16) followed by a prefix-shaped forward
(M = 730 rows through 24 decoder-shaped layers) on a low-priority stream. Modes:

- ``whole``: an image's work is queued the moment it arrives (what the engine does today);
- ``slices:K``: the work is cut into graphs of K layers each, and one slice is queued per
  step, only when the previous slice has finished, so at most one slice runs beside a step;
- ``green:N:capture`` / ``green:N:replay``: the whole work on a stream of a CUDA green context
  of N SMs, its graphs captured on that stream, or captured outside and only replayed there.

Reported per mode: the step interval (between consecutive step ends, as the server's
``vlm_step_interval_seconds``) p50 / p99 and p99 over the no-arrival p50 (the target is 2),
and how long an image waited from arrival to its last slice (its prefix latency).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from vlm_server.models.common.fused_norm import add_layernorm
from vlm_server.models.common.vision import VisionEncoder
from vlm_server.models.registry import preset


def _graph(fn: Callable[[], None], stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        fn()
    return g


class DecoderShapes:
    """Random weights of a decoder's shapes: the per-layer products and an attention."""

    def __init__(self, dim: int, ff: int, heads: int, layers: int, vocab: int) -> None:
        def w(*s: int) -> torch.Tensor:
            return torch.randn(*s, device="cuda", dtype=torch.bfloat16) * 0.02

        self.layers = [
            (w(3 * dim, dim), w(dim, dim), w(ff, dim), w(dim, ff)) for _ in range(layers)
        ]
        self.head = w(vocab, dim)
        self.heads = heads

    def layer(
        self, i: int, x: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        qkv_w, o_w, fc1_w, fc2_w = self.layers[i]
        m, d = x.shape
        qkv = F.linear(x, qkv_w)
        q = qkv[:, :d].view(m, self.heads, d // self.heads).transpose(0, 1)[None]
        if kv is None:  # a prefix: its rows attend to each other
            k = qkv[:, d : 2 * d].view(m, self.heads, -1).transpose(0, 1)[None]
            v = qkv[:, 2 * d :].view(m, self.heads, -1).transpose(0, 1)[None]
            a = F.scaled_dot_product_attention(q, k, v)[0].transpose(0, 1).reshape(m, d)
        else:  # decode rows: one query each over their cached positions
            k, v = kv
            a = F.scaled_dot_product_attention(q.transpose(0, 2), k, v).transpose(0, 2)
            a = a[0].transpose(0, 1).reshape(m, d)
        h = F.linear(a, o_w)
        return x + h + F.linear(F.gelu(F.linear(x, fc1_w), approximate="tanh"), fc2_w)


def build(args: argparse.Namespace) -> dict:
    cfg = preset("moondream2")
    tc, vc = cfg.text, cfg.vision
    torch.manual_seed(0)
    dec = DecoderShapes(tc.dim, tc.ff_dim, tc.n_heads, tc.n_layers, tc.vocab_size)
    enc = VisionEncoder(vc).cuda().to(torch.bfloat16).eval()
    for p in enc.parameters():
        torch.nn.init.normal_(p, std=0.02)
    hd = tc.dim // tc.n_heads
    kv = tuple(
        torch.randn(args.streams, tc.n_heads, 800, hd, device="cuda", dtype=torch.bfloat16)
        for _ in range(2)
    )
    step_in = torch.randn(args.streams, tc.dim, device="cuda", dtype=torch.bfloat16)
    step_out = torch.empty(args.streams, tc.vocab_size, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        x = step_in
        for i in range(tc.n_layers):
            x = dec.layer(i, x, kv)
        step_out.copy_(F.linear(x, dec.head))

    crops = torch.randn(9, 3, vc.crop_size, vc.crop_size, device="cuda", dtype=torch.bfloat16)
    n_patch = 9 * vc.n_patches
    x_buf = torch.empty(n_patch, vc.enc_dim, device="cuda", dtype=torch.bfloat16)
    h_buf = torch.empty_like(x_buf)
    p_buf = torch.randn(730, tc.dim, device="cuda", dtype=torch.bfloat16)

    # The image's work as units: patch embedding, each tower layer, each prefix layer.
    def embed() -> None:
        x = (enc.patch_emb(enc.patchify(crops)) + enc.pos_emb).reshape(n_patch, -1)
        x_buf.copy_(x)
        h_buf.copy_(enc.blocks[0].ln1(x))

    def tower_layer(i: int) -> Callable[[], None]:
        def run() -> None:
            b = enc.blocks[i]
            x, h = x_buf.view(9, vc.n_patches, -1), h_buf.view(9, vc.n_patches, -1)
            x, h = add_layernorm(x, b.attn(h), None, b.ln2)
            after = enc.blocks[i + 1].ln1 if i + 1 < len(enc.blocks) else enc.post_ln
            x, h = add_layernorm(x, b.mlp(h), None, after)
            x_buf.copy_(x.view(n_patch, -1))
            h_buf.copy_(h.view(n_patch, -1))

        return run

    def prefix_layer(i: int) -> Callable[[], None]:
        def run() -> None:
            p_buf.copy_(dec.layer(i, p_buf, None))

        return run

    units = [embed] + [tower_layer(i) for i in range(len(enc.blocks))]
    units += [prefix_layer(i) for i in range(tc.n_layers)]
    return {"step": step, "units": units}


def run_mode(
    mode: str,
    g_step: torch.cuda.CUDAGraph,
    slices: list[torch.cuda.CUDAGraph],
    args: argparse.Namespace,
    hi: torch.cuda.Stream,
    lo: torch.cuda.Stream,
) -> dict:
    """Steps for ``args.seconds`` with arrivals; returns the step intervals and image waits."""
    ends: list[torch.cuda.Event] = []
    inflight: deque[torch.cuda.Event] = deque()
    pending: deque[tuple[int, int]] = deque()  # (image, next slice)
    arrivals: list[float] = []
    image_done: dict[int, torch.cuda.Event] = {}
    last_slice: torch.cuda.Event | None = None
    done_at: dict[int, float] = {}
    period = 1.0 / args.rate if args.rate > 0 and mode != "none" else None
    t0 = time.perf_counter()
    next_arrival = t0 + (period or 0) * 0.5
    while time.perf_counter() - t0 < args.seconds:
        now = time.perf_counter()
        if period is not None and now >= next_arrival:
            img = len(arrivals)
            arrivals.append(now)
            next_arrival += period
            if mode == "whole" or mode.startswith("green"):
                with torch.cuda.stream(lo):
                    for g in slices:
                        g.replay()
                    e = torch.cuda.Event()
                    e.record(lo)
                image_done[img] = e
            else:
                pending.append((img, 0))
        with torch.cuda.stream(hi):
            g_step.replay()
            e = torch.cuda.Event(enable_timing=True)
            e.record(hi)
        ends.append(e)
        inflight.append(e)
        if pending and (last_slice is None or last_slice.query()):
            img, j = pending.popleft()
            with torch.cuda.stream(lo):
                slices[j].replay()
                last_slice = torch.cuda.Event()
                last_slice.record(lo)
            if j + 1 < len(slices):
                pending.appendleft((img, j + 1))
            else:
                image_done[img] = last_slice
        if len(inflight) >= 2:  # the pipeline's depth: wait for the older step
            inflight.popleft().synchronize()
        for img in [i for i, ev in image_done.items() if i not in done_at and ev.query()]:
            done_at[img] = time.perf_counter()
    torch.cuda.synchronize()
    counted = ends[args.skip :]
    gaps = sorted(a.elapsed_time(b) for a, b in itertools.pairwise(counted))

    def q(f: float) -> float:
        return gaps[min(len(gaps) - 1, int(f * len(gaps)))]

    waits = sorted((done_at[i] - arrivals[i]) * 1e3 for i in done_at)
    return {
        "steps": len(gaps),
        "p50_ms": q(0.5),
        "p90_ms": q(0.9),
        "p99_ms": q(0.99),
        "max_ms": gaps[-1],
        "images": len(arrivals),
        "images_done": len(done_at),
        "image_wait_p50_ms": statistics.median(waits) if waits else None,
        "image_wait_max_ms": waits[-1] if waits else None,
    }


_GREEN_CONTEXTS: list[object] = []


def green_stream(num_sms: int) -> torch.cuda.Stream | None:
    """A stream whose kernels may use only ``num_sms`` SMs (a CUDA green context), if this
    torch and driver have them."""
    try:
        from torch.cuda.green_contexts import GreenContext

        ctx = GreenContext.create(num_sms=num_sms, device_id=torch.cuda.current_device())
        _GREEN_CONTEXTS.append(ctx)  # a collected context destroys its streams
        if hasattr(ctx, "Stream"):
            return ctx.Stream()
        ctx.set_context()
        try:
            return torch.cuda.Stream()
        finally:
            ctx.pop_context()
    except Exception as err:  # beta API: absent or refused on this setup
        print(f"green contexts unavailable: {err!r}")
        return None


def plot(rows: dict, path: Path) -> None:
    """Step-interval p50 / p99 and image wait p50 per mode, side by side."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    modes = list(rows)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    xs = range(len(modes))
    a.bar([x - 0.2 for x in xs], [rows[m]["p50_ms"] for m in modes], 0.4, label="p50")
    a.bar([x + 0.2 for x in xs], [rows[m]["p99_ms"] for m in modes], 0.4, label="p99")
    a.axhline(2 * rows["none"]["p50_ms"], color="k", ls="--", lw=1, label="2x idle p50")
    a.set_xticks(list(xs), modes, rotation=30)
    a.set_ylabel("step interval (ms)")
    a.legend()
    b.bar(list(xs), [rows[m]["image_wait_p50_ms"] or 0 for m in modes])
    b.set_xticks(list(xs), modes, rotation=30)
    b.set_ylabel("image prefix wait p50 (ms)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.prefix_pacing", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--rate", type=float, default=20.0, help="images a second")
    ap.add_argument("--seconds", type=float, default=4.0, help="per mode")
    ap.add_argument("--skip", type=int, default=20, help="first steps not counted")
    ap.add_argument("--slices", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument(
        "--green-sms",
        type=int,
        nargs="*",
        default=[],
        help="also run the whole work on a green context of this many SMs (CUDA green contexts)",
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    hi = torch.cuda.Stream(priority=-1)
    lo = torch.cuda.Stream(priority=0)
    parts = build(args)
    with torch.inference_mode():
        g_step = _graph(parts["step"], hi)
        units = parts["units"]
        per_unit = [_graph(u, lo) for u in units]
        graphs: dict[str, list[torch.cuda.CUDAGraph]] = {"none": per_unit, "whole": per_unit}
        for k in args.slices:

            def group(fns: list[Callable[[], None]]) -> Callable[[], None]:
                return lambda: [f() for f in fns]

            graphs[f"slices:{k}"] = [
                _graph(group(units[i : i + k]), lo) for i in range(0, len(units), k)
            ]
        rows = {}
        for mode, slices in graphs.items():
            rows[mode] = run_mode(mode, g_step, slices, args, hi, lo)
            print(f"{mode:<10} {rows[mode]}", flush=True)
        for n in args.green_sms:
            green = green_stream(n)
            if green is None:
                break
            for how, gl in (("replay", per_unit), ("capture", [_graph(u, green) for u in units])):
                mode = f"green:{n}:{how}"
                graphs[mode] = gl
                rows[mode] = run_mode(mode, g_step, gl, args, hi, green)
                print(f"{mode:<10} {rows[mode]}", flush=True)
    base = rows["none"]["p50_ms"]
    print(
        f"\n{'mode':<10} {'slices':>6} {'p50':>6} {'p90':>6} {'p99':>6} {'p99/idle p50':>12} "
        f"{'images':>8} {'wait p50':>8} {'wait max':>8}"
    )
    for mode, r in rows.items():
        r["p99_over_idle_p50"] = r["p99_ms"] / base
        w50, wmax = (r[k] or float("nan") for k in ("image_wait_p50_ms", "image_wait_max_ms"))
        print(
            f"{mode:<10} {len(graphs[mode]):>6} {r['p50_ms']:>6.2f} {r['p90_ms']:>6.2f} "
            f"{r['p99_ms']:>6.2f} {r['p99_over_idle_p50']:>12.2f} "
            f"{r['images_done']:>3}/{r['images']:<4} {w50:>8.1f} {wmax:>8.1f}"
        )
    if args.json:
        plot(rows, args.json.with_suffix(".png"))
        args.json.write_text(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name(),
                    "args": vars(args) | {"json": str(args.json)},
                    "rows": rows,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
