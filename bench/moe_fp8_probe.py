"""Moondream 3's expert layer with FP8 activations against 16-bit ones, on the GPU.

    python -m bench.moe_fp8_probe [--tokens 730 1460 2920 5840] [--json OUT.json]

At full size with FP8 expert weights (dim 2048, 64 experts of width 1024, top-8), for each
token count (an image prefix is 730; the engine batches up to 8), times by CUDA-graph replay
(median; bench/tower_probe.py's `replay_us`) one layer as `MoeMLP.forward` runs it, router to
combine: with 16-bit activations (the default path, `moe_triton.TILES`), both again in the
grouped kernels' other launch order (`moe_triton.COLUMNS_FIRST`), and with FP8 activations for
each candidate tile (``fp8_act``, `moe_triton.FP8_ACT_TILES` and the
candidates below), plus the row quantizer alone. Each FP8 row gives its relative error against
the 16-bit path's output. Writes the rows as JSON and a PNG beside it, prints a table and the
winner as a `moe_triton.FP8_ACT_TILES` row.
"""

from __future__ import annotations

import argparse

import torch

from bench import plotting
from bench.moe_probe import DIM, log, make_layer, table
from bench.tower_probe import replay_us
from vlm_server.models.moondream3 import act_quant, moe_triton
from vlm_server.models.moondream3.moe_triton import ExpertTiles, Tile

TOKENS = (730, 1460, 2920, 5840)
CANDIDATES = (
    ExpertTiles(128, Tile(128, 128, 8, 3), Tile(128, 128, 8, 3)),
    ExpertTiles(128, Tile(128, 128, 8, 4), Tile(128, 128, 8, 4)),
    ExpertTiles(128, Tile(64, 128, 4, 4), Tile(128, 128, 8, 3)),
    ExpertTiles(128, Tile(128, 64, 8, 4), Tile(128, 64, 8, 4)),
    ExpertTiles(128, Tile(256, 128, 8, 3), Tile(256, 128, 8, 3)),
    ExpertTiles(64, Tile(128, 128, 4, 4), Tile(128, 128, 4, 4)),
    ExpertTiles(64, Tile(128, 128, 8, 3), Tile(128, 128, 8, 3)),
    ExpertTiles(128, Tile(128, 256, 8, 3), Tile(128, 256, 8, 3)),
)


def probe(tokens: list[int]) -> list[dict]:
    mlp = make_layer(fp8=True)
    rows = []
    for n in tokens:
        x = torch.randn(1, n, DIM, device="cuda", dtype=torch.bfloat16)
        mlp.fp8_act = False
        want = mlp(x).float()
        us = replay_us(lambda x=x: mlp(x))
        rows.append({"tokens": n, "variant": "bf16 act", "tiles": str(moe_triton.pick_tiles(n)),
                     "us": round(us, 1), "rel_err": 0.0})  # fmt: skip
        log(f"{n:5d} bf16 act {rows[-1]['tiles']:<40} {us:8.1f} us")
        flat = x.view(n, -1)
        q_us = replay_us(lambda flat=flat: act_quant.quant_rows(flat))
        rows.append({"tokens": n, "variant": "quant x", "tiles": "-", "us": round(q_us, 1),
                     "rel_err": 0.0})  # fmt: skip
        for fp8 in (False, True):  # the kernels' other launch order, with the chosen tiles
            mlp.fp8_act = fp8
            moe_triton.COLUMNS_FIRST = not moe_triton.COLUMNS_FIRST
            try:
                us = replay_us(lambda x=x: mlp(x))
            finally:
                moe_triton.COLUMNS_FIRST = not moe_triton.COLUMNS_FIRST
            variant = f"{'fp8' if fp8 else 'bf16'} act, other order"
            rows.append({"tokens": n, "variant": variant, "tiles": "-", "us": round(us, 1),
                         "rel_err": None})  # fmt: skip
            log(f"{n:5d} {variant:<24} {us:8.1f} us")
        mlp.fp8_act = True
        for tiles in CANDIDATES:
            with table(tiles, "FP8_ACT_TILES"):
                try:
                    got = mlp(x).float()
                    us = replay_us(lambda x=x: mlp(x))
                except Exception as err:  # a tile that does not compile or fit
                    log(f"{n:5d} fp8 act {tiles}: {str(err).splitlines()[0][:80]}")
                    continue
            rel = ((got - want).norm() / want.norm()).item()
            rows.append({"tokens": n, "variant": "fp8 act", "tiles": str(tiles),
                         "us": round(us, 1), "rel_err": round(rel, 5)})  # fmt: skip
            log(f"{n:5d} fp8 act  {tiles!s:<40} {us:8.1f} us  rel err {rel:.4f}")
        mlp.fp8_act = False
    return rows


def best(rows: list[dict], n: int) -> dict | None:
    fp8 = [r for r in rows if r["tokens"] == n and r["variant"] == "fp8 act"]
    return min(fp8, key=lambda r: r["us"]) if fp8 else None


def summary(rows: list[dict]) -> None:
    print("\ntokens  bf16 act us  best fp8 act us   x     rel err  best tiles")
    for n in sorted({r["tokens"] for r in rows}):
        base = next(r for r in rows if r["tokens"] == n and r["variant"] == "bf16 act")
        b = best(rows, n)
        if b is None:
            continue
        print(f"{n:6d} {base['us']:12.1f} {b['us']:16.1f} {base['us'] / b['us']:5.2f} "
              f"{b['rel_err']:9.4f}  {b['tiles']}")  # fmt: skip


def plot(out: dict, path: str) -> bool:
    plt = plotting.pyplot()
    if plt is None:
        return False
    rows = out["rows"]
    tokens = sorted({r["tokens"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, pick in (
        ("16-bit activations", lambda n: next(
            r for r in rows if r["tokens"] == n and r["variant"] == "bf16 act")),
        ("FP8 activations (best tile)", lambda n: best(rows, n)),
    ):  # fmt: skip
        ys = [(n, pick(n)) for n in tokens]
        ax.plot([n for n, r in ys if r], [r["us"] for _, r in ys if r], marker="o", label=label)
    ax.set_xlabel("tokens in the step")
    ax.set_ylabel("expert layer, us")
    ax.set_title(f"Moondream 3 expert layer, FP8 weights ({out['device']})")
    ax.grid(alpha=0.3)
    ax.legend()
    plotting.save(plt, fig, path)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--json", default=None, help="write the rows here (and a PNG beside)")
    ap.add_argument("--plot-from", default=None, help="redraw the PNG of saved rows")
    args = ap.parse_args()
    if args.plot_from:
        return plotting.replot(args.plot_from, plot)
    if not torch.cuda.is_available():
        log("needs a CUDA device")
        return 1
    rows = probe(args.tokens)
    summary(rows)
    out = {"device": torch.cuda.get_device_name(), "rows": rows}
    if args.json:
        plotting.write_rows(args.json, out, plot)
    n = max(args.tokens)
    b = best(rows, n)
    if b is not None:
        print(f"\n# FP8_ACT_TILES from the winner at {n} tokens: {b['tiles']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
