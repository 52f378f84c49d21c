"""Moondream 3's tau scaling in Triton (`tau_kernel.tau_scale`) at full size, per token count
and launch constants, graphed (CUDA only).

    python -m bench.tau_probe [--tokens 1 8 32 730 2920 5840] [--json OUT]
    python -m bench.tau_probe --plot-from OUT.json     # the plot again, from saved rows

Times one layer's tau (logits + scale launches) per token count for each combination of the
module's constants (splits over the projection's columns, its columns per step, heads per
scaling program), next to the PyTorch ops; checks each against the default launch. The
fastest combination per token count comes last; with ``--json``, the rows and a plot
(``OUT.png``: per token count, the PyTorch ops, the chosen launch and the fastest).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
from collections.abc import Iterator

import torch

from bench import plotting
from bench.tower_probe import replay_us
from vlm_server.models.moondream3 import tau_kernel
from vlm_server.models.moondream3.config import TextConfig
from vlm_server.models.moondream3.tau import Tau

# Each knob has a decode and a wide form (MAX_SPLITS and MAX_SPLITS_WIDE ...): each token count
# sweeps both alike, so each sees the one it uses.
KNOBS = {
    "MAX_SPLITS": (4, 8, 16, 48),
    "BLOCK_K": (64, 128, 256),
    "SCALE_H": (1, 2, 4, 8),
}


@contextlib.contextmanager
def constants(values: dict[str, int]) -> Iterator[None]:
    """`tau_kernel`'s module constants set to ``values`` inside the block."""
    saved = {k: getattr(tau_kernel, k) for k in values}
    for k, v in values.items():
        setattr(tau_kernel, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(tau_kernel, k, v)


def chosen(n: int) -> dict[str, int]:
    """The constants `tau_kernel` launches ``n`` tokens with."""
    wide = "_WIDE" if n > tau_kernel.DECODE_M else ""
    return {k: getattr(tau_kernel, k + wide) for k in KNOBS}


def plot(out: dict, path: str) -> bool:
    """Per token count: the PyTorch ops, the chosen launch, the fastest; False without
    matplotlib."""
    rows = out["rows"]
    counts = sorted({r["tokens"] for r in rows})
    mine = [[r for r in rows if r["tokens"] == n] for n in counts]
    bars = {
        "PyTorch ops": [m[0]["torch_us"] for m in mine],
        "chosen launch": [
            next(r["us"] for r in m if all(r.get(k) == v for k, v in chosen(n).items()))
            for n, m in zip(counts, mine, strict=True)
        ],
        "fastest swept": [min(r["us"] for r in m) for m in mine],
    }
    return plotting.grouped_bars(
        bars, [str(n) for n in counts], path, xlabel="tokens",
        ylabel="us a layer (logits + scale)", title=f"Moondream 3 tau, {out['device']}",
    )  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 730, 2920, 5840])
    ap.add_argument("--json", default=None, help="write every row here (and a plot beside)")
    ap.add_argument("--plot-from", default=None, help="only plot these saved rows")
    args = ap.parse_args()
    if args.plot_from:
        return plotting.replot(args.plot_from, plot)
    if not (torch.cuda.is_available() and tau_kernel.triton is not None):
        print("tau_probe needs a CUDA device and Triton")
        return 1
    heads, hd = 32, 64
    cfg = TextConfig(dim=heads * hd, n_heads=heads, n_kv_heads=heads)
    tau = Tau(cfg, "tanh", "fp32").to("cuda", torch.bfloat16)  # type: ignore[arg-type]
    for p in tau.parameters():
        torch.nn.init.normal_(p, std=0.02)
    tau.requires_grad_(False)
    rows: list[dict] = []
    for n in args.tokens:
        qkv = torch.randn(1, n, 3 * heads * hd, device="cuda").bfloat16()
        pos = torch.arange(n, device="cuda")[None] + 700
        tau.use_kernel(False)
        torch_us = replay_us(lambda q=qkv, p=pos: tau.scale(q, p, heads))
        tau.use_kernel(True)
        want = tau.scale(qkv, pos, heads)
        print(f"tokens {n}: PyTorch ops {torch_us:.1f} us", flush=True)
        for combo in itertools.product(*KNOBS.values()):
            values = dict(zip(KNOBS, combo, strict=True))
            wide = {
                "MAX_SPLITS_WIDE": values["MAX_SPLITS"],
                "BLOCK_K_WIDE": values["BLOCK_K"],
                "SCALE_H_WIDE": values["SCALE_H"],
            }
            with constants({**values, **wide}):
                got = tau.scale(qkv, pos, heads)
                us = replay_us(lambda q=qkv, p=pos: tau.scale(q, p, heads))
            err = float((got.float() - want.float()).abs().max())
            rows.append({"tokens": n, **values, "us": us, "max_diff": err, "torch_us": torch_us})
    print(f"\n{'tokens':>6} {'torch':>7} {'default':>8} {'best':>7}  best constants")
    for n in args.tokens:
        mine = [r for r in rows if r["tokens"] == n]
        default = next(r for r in mine if all(r.get(k) == v for k, v in chosen(n).items()))
        best = min(mine, key=lambda r: r["us"])
        knobs = " ".join(f"{k}={best[k]}" for k in KNOBS)
        print(
            f"{n:>6} {best['torch_us']:>7.1f} {default['us']:>8.1f} {best['us']:>7.1f}  {knobs} "
            f"(max diff {best['max_diff']:.3g})"
        )
    if args.json:
        out = {"device": torch.cuda.get_device_name(), "rows": rows}
        plotting.write_rows(args.json, out, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
