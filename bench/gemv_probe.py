"""The decode layer's matrix products at few rows: cuBLAS's four kernels against the two fused
skinny products (QKV + fc1 with the GELU epilogue; proj + fc2 over the two inputs side by
side), over a model's worth of distinct weights (so nothing is served from L2), graphed.

    python -m bench.gemv_probe [--rows 1 8 32] [--sweep] [--json out.json]

Prints, per row count, the GPU time of all layers' products each way and the weight bytes
read over that time (effective bandwidth), and with ``--sweep`` the best launch shape per
product (the source of `skinny_gemm.default_config`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

from bench.graph_timing import graph_ms
from vlm_server.models.common.skinny_gemm import SkinnyConfig, default_config, skinny_linear


class _Layers:
    """All layers' products at one row count, the plain way and the fused way."""

    def __init__(self, d, w_in, b_in, w_out, b_out, b_proj, xs, att, hid) -> None:
        self.d, self.w_in, self.b_in, self.w_out = d, w_in, b_in, w_out
        self.b_out, self.b_proj, self.xs, self.att, self.hid = b_out, b_proj, xs, att, hid
        self.c_in: SkinnyConfig | None = None
        self.c_out: SkinnyConfig | None = None
        self.which = "both"

    def cublas(self) -> None:
        d = self.d
        for i, (w, wo) in enumerate(zip(self.w_in, self.w_out, strict=True)):
            torch.addmm(self.b_in[i][: 3 * d], self.xs, w[: 3 * d].t())
            torch._addmm_activation(self.b_in[i][3 * d :], self.xs, w[3 * d :].t(), use_gelu=True)
            torch.addmm(self.b_proj[i], self.att, wo[:, :d].t())
            torch.addmm(self.b_out[i], self.hid, wo[:, d:].t())

    def fused(self) -> None:
        for i, (w, wo) in enumerate(zip(self.w_in, self.w_out, strict=True)):
            if self.which != "out":
                skinny_linear(self.xs, w, self.b_in[i], gelu_from=3 * self.d, config=self.c_in)
            if self.which != "in":
                skinny_linear(self.att, wo, self.b_out[i], x2=self.hid, config=self.c_out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--ff", type=int, default=8192)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gemv_probe: needs a CUDA device")
    dev, dt = "cuda", torch.bfloat16
    d, ff, L = args.dim, args.ff, args.layers
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=dev, generator=g) * 0.02).to(dt)

    # Per layer: one [qkv; fc1] weight and one [proj | fc2] weight; the plain path uses views.
    w_in = [rnd(3 * d + ff, d) for _ in range(L)]
    b_in = [rnd(3 * d + ff) for _ in range(L)]
    w_out = [rnd(d, d + ff) for _ in range(L)]
    b_out = [rnd(d) for _ in range(L)]
    b_proj = [rnd(d) for _ in range(L)]
    weight_bytes = sum(w.numel() * 2 for w in w_in + w_out)

    # Correctness first: the fused products against PyTorch in fp32.
    x = rnd(3, d)
    h = torch.nn.functional.gelu(
        x.float() @ w_in[0][3 * d :].float().t() + b_in[0][3 * d :].float(), approximate="tanh"
    )
    got = skinny_linear(x, w_in[0], b_in[0], gelu_from=3 * d)
    torch.testing.assert_close(got[:, 3 * d :].float(), h, atol=3e-2, rtol=3e-2)
    a = rnd(3, d)
    want = torch.cat([a, got[:, 3 * d :]], 1).float() @ w_out[0].float().t() + b_out[0].float()
    got2 = skinny_linear(a, w_out[0], b_out[0], x2=got[:, 3 * d :])
    torch.testing.assert_close(got2.float(), want, atol=3e-2, rtol=3e-2)

    results: dict = {
        "device": torch.cuda.get_device_name(),
        "weight_bytes": weight_bytes,
        "rows": [],
    }
    for m in args.rows:
        xs, att, hid = rnd(m, d), rnd(m, d), rnd(m, ff)
        layer = _Layers(d, w_in, b_in, w_out, b_out, b_proj, xs, att, hid)
        row = {"rows": m, "cublas_ms": graph_ms(layer.cublas), "fused_ms": graph_ms(layer.fused)}
        if args.sweep:
            best: dict[str, tuple[float, SkinnyConfig]] = {}
            for which, (n, k) in {"in": (3 * d + ff, d), "out": (d, d + ff)}.items():
                if which == "in":
                    space = itertools.product([64, 128], [128, 256], [4, 8], [3, 4], [1, 2, 4])
                else:
                    space = itertools.product([32, 64, 128], [128, 256], [4], [3, 4, 5], [2, 4, 8])
                configs = [SkinnyConfig(*shape) for shape in space]
                if m <= 8:  # on the CUDA cores: one fp32 lane per row, column and K element
                    configs += [
                        SkinnyConfig(bn, bk, wp, 1, sk, fma=True)
                        for bn, bk, wp, sk in itertools.product(
                            [1, 2, 4], [512, 1024, 2048], [4, 8], [1, 2, 4, 8]
                        )
                        if m * bn * bk <= 64 * 32 * wp and (which == "out" or sk <= 2)
                    ]
                for cfg in configs:
                    layer.c_in = layer.c_out = cfg
                    layer.which = which
                    try:
                        ms = graph_ms(layer.fused, reps=10)
                    except Exception as exc:  # a shape the compiler refuses (registers)
                        print(f"  rows {m} {which} {cfg}: {type(exc).__name__}", flush=True)
                        continue
                    if which not in best or ms < best[which][0]:
                        best[which] = (ms, cfg)
                print(
                    f"  rows {m} {which}: best {best[which][1]} ({best[which][0]:.3f} ms; "
                    f"default {default_config(m, n, k)})",
                    flush=True,
                )
            row["best_in"] = vars(best["in"][1])
            row["best_out"] = vars(best["out"][1])
            layer.c_in, layer.c_out, layer.which = best["in"][1], best["out"][1], "both"
            row["tuned_ms"] = graph_ms(layer.fused)
        for key in ("cublas", "fused", "tuned"):
            if f"{key}_ms" in row:
                row[f"{key}_tb_s"] = weight_bytes / row[f"{key}_ms"] / 1e9
        results["rows"].append(row)
        print(json.dumps(row), flush=True)

    print(f"\n{'rows':>5} {'cuBLAS ms':>10} {'fused ms':>9} {'tuned ms':>9} {'TB/s c/f/t':>18}")
    for r in results["rows"]:
        print(
            f"{r['rows']:>5} {r['cublas_ms']:>10.3f} {r['fused_ms']:>9.3f} "
            f"{r.get('tuned_ms', float('nan')):>9.3f} "
            f"{r['cublas_tb_s']:>6.2f}/{r['fused_tb_s']:.2f}/"
            f"{r.get('tuned_tb_s', float('nan')):.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
