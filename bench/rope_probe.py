"""The fused rotary + paged KV write at a model's widths, per token count and tokens per
program, graphed (CUDA only).

    python -m bench.rope_probe [--tokens 1 32 730 1460] [--blocks 1 4 8 16 32 64] [--json OUT]
    python -m bench.rope_probe --plot-from OUT.json     # the plot again, from saved rows

Prints, per token count, the GPU time of one launch with each block of tokens per program,
and the block `triton_attention.rope_block` picks (the source of ``ROPE_BLOCKS``); with
``--json``, the rows and a plot of them (``OUT.png``).
"""

from __future__ import annotations

import argparse

import torch

from bench import plotting
from bench.tower_probe import replay_us
from vlm_server.engine.device.kernels import triton_attention as ta


def probe(tokens: int, blocks: list[int], heads: int, kv_heads: int, head_dim: int) -> dict:
    """One token count's times (us) per tokens-per-program block."""
    half, page = head_dim // 2, 16
    dev = "cuda"
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=dev).bfloat16()
    cos, sin = torch.rand(4096, half, device=dev), torch.rand(4096, half, device=dev)
    pos = torch.arange(tokens, device=dev, dtype=torch.int32)[:, None]
    pages = -(-tokens // page)
    table = torch.arange(pages, device=dev, dtype=torch.int32)[None]
    rows = torch.zeros(tokens, 1, device=dev, dtype=torch.int32)
    k_pool = torch.zeros(pages, page, kv_heads, head_dim, device=dev).bfloat16()
    v_pool = torch.zeros_like(k_pool)
    k_out = torch.empty(tokens, kv_heads, head_dim, device=dev).bfloat16()
    times = {}
    chosen = ta.ROPE_BLOCKS
    try:
        for block in blocks:
            ta.ROPE_BLOCKS = ((1 << 62, block),)
            times[block] = replay_us(
                lambda: ta.rope_and_store_kv(
                    qkv, cos, sin, pos, table, rows, k_pool, v_pool, heads, k_out=k_out
                ),
                calls=20,
            )
    finally:
        ta.ROPE_BLOCKS = chosen
    return {"tokens": tokens, "us_by_block": times, "picked": ta.rope_block(tokens)}


def plot(out: dict, path: str) -> bool:
    """Time per launch against tokens per program, one line per token count; False without
    matplotlib."""
    plt = plotting.pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in out["rows"]:
        blocks = sorted(int(b) for b in r["us_by_block"])
        times = [r["us_by_block"].get(b, r["us_by_block"].get(str(b))) for b in blocks]
        ax.plot(blocks, times, marker="o", label=f"{r['tokens']} tokens (picks {r['picked']})")
    ax.set(xscale="log", yscale="log", xlabel="tokens per program", ylabel="us per launch")
    ax.set_xticks(blocks, [str(b) for b in blocks])
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"rotary + paged KV write, {out['device']}")
    plotting.save(plt, fig, path)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 64, 730, 1460])
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    ap.add_argument("--heads", type=int, default=32, help="query heads (moondream2: 32)")
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--json", default=None, help="write the rows here (and a plot beside)")
    ap.add_argument("--plot-from", default=None, help="only plot these saved rows")
    args = ap.parse_args()
    if args.plot_from:
        return plotting.replot(args.plot_from, plot)
    if not (torch.cuda.is_available() and ta.AVAILABLE):
        print("rope_probe needs a CUDA device and Triton")
        return 1
    if any(b < 1 or b & (b - 1) for b in args.blocks):
        ap.error("--blocks must be powers of two")
    rows = []
    print(f"{'tokens':>7} " + " ".join(f"{'b' + str(b):>8}" for b in args.blocks) + "  picked")
    for n in args.tokens:
        r = probe(n, args.blocks, args.heads, args.kv_heads, args.head_dim)
        rows.append(r)
        cells = " ".join(f"{r['us_by_block'][b]:>8.1f}" for b in args.blocks)
        print(f"{n:>7} {cells}  b{r['picked']}", flush=True)
    if args.json:
        out = {"device": torch.cuda.get_device_name(), "shape": vars(args), "rows": rows}
        plotting.write_rows(args.json, out, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
