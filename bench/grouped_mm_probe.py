"""cuBLAS's grouped FP8 products for Moondream 3's expert layer, piece by piece (CUDA, sm_90).

    python -m bench.grouped_mm_probe [--tokens 730 2920 5840] [--block-m 128 16 1]
        [--json OUT.json] [--plot-from OUT.json]

At full size with FP8 expert weights (dim 2048, 64 experts of width 1024, top-8), for each
token count, times by CUDA-graph replay (median; bench/tower_probe.py's `replay_us`) the
Triton layer as `MoeMLP.forward` runs it with FP8 activations (router to combine), and the
pieces a layer built on ``torch._scaled_grouped_mm`` (row-scaled FP8 x FP8, the (token,
expert) pairs sorted by expert in groups padded to ``block_m`` rows) would run:

- ``gather``: each sorted row's FP8 input and scale (the tokens quantized once);
- ``gmm1`` / ``gmm2``: the grouped products for fc1 and fc2 (``_fast``: fast accumulation);
- ``act`` and ``quant_h``: the expert activation and fc2's input quantizer, now passes of
  their own (the grouped product writes its 16-bit output);
- ``unsort_combine``: the rows back in pair order, then the combine.

Each layer is checked against the Triton layer's output (``rel_err``). Writes the rows as
JSON and a PNG beside it and prints a table.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench import plotting
from bench.moe_probe import DIM, log, make_layer
from bench.tower_probe import replay_us
from vlm_server.models.moondream3 import act_quant, moe_routing, moe_triton
from vlm_server.models.moondream3.moe import MoeMLP

TOKENS = (730, 2920, 5840)
BLOCK_M = (128, 16, 1)
PIECES = ("gather", "gmm1", "gmm1_fast", "act", "quant_h", "gmm2", "gmm2_fast", "unsort_combine")


def group_ends(routing: moe_routing.Routing, n_experts: int) -> torch.Tensor:
    """Each expert's end row in the sorted layout [E] int32: the blocks up to it, capped at
    the rows in use (the unused trailing blocks carry the last expert's id)."""
    experts = torch.arange(n_experts, device=routing.block_expert.device, dtype=torch.int32)
    ends = torch.searchsorted(routing.block_expert, experts, right=True).to(torch.int32)
    return torch.minimum(ends * routing.block_m, routing.used)


def grouped_row(mlp: MoeMLP, x: torch.Tensor, want: torch.Tensor, bm: int) -> dict:
    """The grouped layer's pieces on ``x`` [N, D], groups padded to ``bm`` rows, each timed;
    its output against ``want`` (the Triton layer's)."""
    w1, s1, w2, s2 = mlp.fc1.weight, mlp.fc1.scale, mlp.fc2.weight, mlp.fc2.scale
    n_experts, two_width, _ = w1.shape
    n, width, top_k = x.shape[0], two_width // 2, mlp.top_k
    b1, b2 = w1.transpose(-2, -1), w2.transpose(-2, -1)  # column-major, as cuBLAS takes them
    weights, _, routing = moe_routing.route_align(mlp.router(x), top_k, bm)
    ends = group_ends(routing, n_experts)
    pairs = routing.pair_ids
    token = torch.where(pairs < n * top_k, pairs // top_k, n).long()  # n: a zero row
    xq, xs = act_quant.quant_rows(x)
    xq = torch.cat([xq.view(torch.uint8), xq.new_zeros(1, DIM).view(torch.uint8)])
    xs = torch.cat([xs, xs.new_ones(1)])
    inv = moe_triton._row_of_pair(pairs, n * top_k)
    state: dict[str, torch.Tensor] = {}

    def gather() -> None:
        state["a"] = xq[token].view(torch.float8_e4m3fn)
        state["sa"] = xs[token]

    def gmm1(fast: bool = False) -> None:
        state["z"] = torch._scaled_grouped_mm(
            state["a"], b1, state["sa"], s1, offs=ends, out_dtype=torch.bfloat16,
            use_fast_accum=fast,
        )  # fmt: skip

    def act() -> None:
        a, b = state["z"].chunk(2, dim=-1)
        state["h"] = F.gelu(a) * (b + 1)

    def quant_h() -> None:
        state["hq"], state["hs"] = act_quant.quant_rows(state["h"], pairs, n * top_k)

    def gmm2(fast: bool = False) -> None:
        state["y"] = torch._scaled_grouped_mm(
            state["hq"], b2, state["hs"], s2, offs=ends, out_dtype=torch.bfloat16,
            use_fast_accum=fast,
        )  # fmt: skip

    def unsort_combine() -> None:
        state["out"] = moe_routing.combine_fused(state["y"][inv].view(n, top_k, DIM), weights)

    steps = {"gather": gather, "gmm1": gmm1, "gmm1_fast": lambda: gmm1(True), "act": act,
             "quant_h": quant_h, "gmm2": gmm2, "gmm2_fast": lambda: gmm2(True),
             "unsort_combine": unsort_combine}  # fmt: skip
    for name in PIECES:  # in order, so each piece's inputs exist when it is timed
        steps[name]()
    err = ((state["out"].float() - want).norm() / want.norm()).item()
    row = {"tokens": n, "variant": f"grouped bm{bm}", "rows": pairs.shape[0],
           "rel_err": round(err, 4)}  # fmt: skip
    for name in PIECES:
        row[name] = round(replay_us(steps[name]), 1)
    flops = {"gmm1": 2 * n * top_k * DIM * two_width, "gmm2": 2 * n * top_k * width * DIM}
    for name in ("gmm1", "gmm1_fast", "gmm2", "gmm2_fast"):
        row[f"{name}_tflops"] = round(flops[name[:4]] / row[name] / 1e6, 1)
    fast = min(row["gmm1"], row["gmm1_fast"]) + min(row["gmm2"], row["gmm2_fast"])
    rest = sum(row[p] for p in ("gather", "act", "quant_h", "unsort_combine"))
    row["us"] = round(fast + rest, 1)
    return row


def probe(tokens: list[int], block_ms: list[int]) -> list[dict]:
    mlp = make_layer(fp8=True)
    mlp.fp8_act = True
    rows = []
    for n in tokens:
        x = torch.randn(n, DIM, device="cuda", dtype=torch.bfloat16)
        want = mlp(x[None])[0].float()
        layer_us = replay_us(lambda x=x: mlp(x[None]))
        rows.append({"tokens": n, "variant": "triton layer", "us": round(layer_us, 1)})
        log(f"{n:5d} triton layer {layer_us:8.1f} us")
        for bm in block_ms:
            row = grouped_row(mlp, x, want, bm)
            rows.append(row)
            log(f"{n:5d} {row['variant']:<14} {row['us']:8.1f} us (pieces summed), "
                f"rel err {row['rel_err']:.4f}")  # fmt: skip
    return rows


def summary(rows: list[dict]) -> None:
    print(f"\n{'tokens':>6} {'variant':<16} {'us':>8} " + " ".join(f"{p:>14}" for p in PIECES))
    for r in rows:
        pieces = " ".join(f"{r.get(p, '-'):>14}" for p in PIECES)
        print(f"{r['tokens']:6d} {r['variant']:<16} {r['us']:8.1f} {pieces}")


def plot(out: dict, path: str) -> bool:
    rows = out["rows"]
    tokens = sorted({r["tokens"] for r in rows})
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    bars = {
        v: [next((r["us"] for r in rows if r["tokens"] == n and r["variant"] == v), 0.0)
            for n in tokens]
        for v in variants
    }  # fmt: skip
    return plotting.grouped_bars(
        bars, [str(n) for n in tokens], path, xlabel="tokens in the step",
        ylabel="expert layer, us (grouped: pieces summed)",
        title=f"Triton layer vs cuBLAS grouped FP8 ({out['device']})",
    )  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--block-m", type=int, nargs="+", default=list(BLOCK_M))
    ap.add_argument("--json", default=None, help="write the rows here (and a PNG beside)")
    ap.add_argument("--plot-from", default=None, help="redraw the PNG of saved rows")
    args = ap.parse_args()
    if args.plot_from:
        return plotting.replot(args.plot_from, plot)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        log("needs a CUDA device of compute capability 9.0 or more")
        return 1
    rows = probe(args.tokens, args.block_m)
    summary(rows)
    out = {"device": torch.cuda.get_device_name(), "rows": rows}
    if args.json:
        plotting.write_rows(args.json, out, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
