"""Where the vision tower's time goes, one GEMM shape and layout at a time (CUDA only).

    python -m bench.tower_probe [--crops 9] [--json OUT.json]
    python -m bench.tower_probe --tower-only --tower-crops 1 5 9 13 64 --json OUT.json
    python -m bench.tower_probe --attention-only --json OUT.json


Times, at the tower's real shapes (M = crops x 729 patches, moondream2 widths, bf16), each
linear layer as the tower runs it and in the alternatives a faster tower could use: no bias
epilogue, the residual add inside the GEMM (``beta = 1``), the MLP's inner width padded to a
multiple of 128, the row count padded, and cuBLAS against cuBLASLt. Then the attention alone
(per SDPA backend and layout) and the fused add + LayerNorm and the FP8 quantizers alone.
Each time is the median of CUDA-event-timed graph replays (ten calls a replay, so launches are
out of the numbers), over inputs drawn at random. The whole
tower, bf16 and FP8 (and FP8 with cuBLAS applying fc1's and fc2's scales, mode "fp8 scales in
GEMM": the FP8 tower before `fp8_vision.Unscaled`), is timed per crop count in
``--tower-crops`` (with crops per second), and plotted next to the JSON.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from tqdm import tqdm

from bench.graph_timing import graph_ms
from vlm_server.models.moondream2.config import VisionConfig


def replay_us(fn: Callable[[], object], calls: int = 10, reps: int = 30) -> float:
    """Median time of one ``fn()`` call in microseconds, from graph replays of ``calls`` calls."""
    return graph_ms(fn, reps, calls=calls) * 1e3


def _blas(name: str) -> None:
    torch.backends.cuda.preferred_blas_library(name)


def gemm_rows(m: int, vc: VisionConfig, dt: torch.dtype) -> list[dict]:
    """Each of the block's four linears in its variants, at M = m rows."""
    d, f = vc.enc_dim, vc.enc_ff_dim
    fp = -(-f // 128) * 128
    mp = -(-m // 128) * 128
    dev = "cuda"

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=dt) * 0.05

    h, hp = rnd(m, d), rnd(mp, d)
    w_qkv, b_qkv = rnd(3 * d, d), rnd(3 * d)
    w_proj, b_proj = rnd(d, d), rnd(d)
    w1, b1 = rnd(f, d), rnd(f)
    w1p = torch.cat([w1, torch.zeros(fp - f, d, device=dev, dtype=dt)])
    b1p = torch.cat([b1, torch.zeros(fp - f, device=dev, dtype=dt)])
    w2, b2 = rnd(d, f), rnd(d)
    w2p = torch.cat([w2, torch.zeros(d, fp - f, device=dev, dtype=dt)], dim=1).contiguous()
    a_inner, a_innerp = rnd(m, f), rnd(m, fp)
    resid = rnd(m, d)
    flops = {
        "qkv": 2 * m * d * 3 * d,
        "proj": 2 * m * d * d,
        "fc1": 2 * m * d * f,
        "fc2": 2 * m * f * d,
    }

    variants: list[tuple[str, str, Callable[[], object]]] = [
        ("qkv", "linear+bias", lambda: F.linear(h, w_qkv, b_qkv)),
        ("qkv", "mm", lambda: torch.mm(h, w_qkv.t())),
        ("qkv", "linear+bias rows padded", lambda: F.linear(hp, w_qkv, b_qkv)),
        ("proj", "linear+bias", lambda: F.linear(h, w_proj, b_proj)),
        ("proj", "mm", lambda: torch.mm(h, w_proj.t())),
        ("proj", "addmm_ residual", lambda: resid.addmm_(h, w_proj.t())),
        ("proj", "linear+bias rows padded", lambda: F.linear(hp, w_proj, b_proj)),
        (
            "fc1",
            "addmm+gelu",
            lambda: torch._addmm_activation(b1, h, w1.t(), use_gelu=True),
        ),
        ("fc1", "linear+bias", lambda: F.linear(h, w1, b1)),
        ("fc1", "mm", lambda: torch.mm(h, w1.t())),
        (
            "fc1",
            "addmm+gelu N padded",
            lambda: torch._addmm_activation(b1p, h, w1p.t(), use_gelu=True),
        ),
        ("fc1", "linear+bias N padded", lambda: F.linear(h, w1p, b1p)),
        ("fc2", "linear+bias", lambda: F.linear(a_inner, w2, b2)),
        ("fc2", "mm", lambda: torch.mm(a_inner, w2.t())),
        ("fc2", "addmm_ residual", lambda: resid.addmm_(a_inner, w2.t())),
        ("fc2", "linear+bias K padded", lambda: F.linear(a_innerp, w2p, b2)),
        ("fc2", "addmm_ residual K padded", lambda: resid.addmm_(a_innerp, w2p.t())),
    ]
    rows = []
    for lib in ("cublaslt", "cublas"):
        _blas(lib)
        for gemm, name, fn in variants:
            us = replay_us(fn)
            scale = mp / m if "rows padded" in name else 1.0
            rows.append(
                {
                    "gemm": gemm,
                    "variant": name,
                    "blas": lib,
                    "us": us,
                    "tflops": flops[gemm] * scale / us / 1e6,
                }
            )
            print(
                f"{gemm:>5} {name:<26} {lib:<9} {us:8.1f} us {rows[-1]['tflops']:6.0f} TF/s",
                flush=True,
            )
    _blas("cublaslt")
    return rows


def fp8_rows(m: int, vc: VisionConfig, dt: torch.dtype) -> list[dict]:
    """The block's linears as FP8 (e4m3) GEMMs with bf16 output: one scale per tensor, or
    one per activation row and weight column; plain and fast accumulation."""
    d, f = vc.enc_dim, vc.enc_ff_dim
    fp = -(-f // 128) * 128
    e4m3 = torch.float8_e4m3fn
    shapes = {
        "qkv": (d, 3 * d),
        "proj": (d, d),
        "fc1": (d, f),
        "fc2": (f, d),
        "fc2 K padded": (fp, d),
    }
    rows = []
    for gemm, (k, n) in shapes.items():
        a = (torch.randn(m, k, device="cuda") * 0.5).to(e4m3)
        w = (torch.randn(n, k, device="cuda") * 0.5).to(e4m3)
        bias = torch.randn(n, device="cuda", dtype=dt)
        one = torch.ones((), device="cuda")
        sa, sb = torch.ones(m, 1, device="cuda"), torch.ones(1, n, device="cuda")
        flops = 2 * m * k * n
        for scales, (x, y) in (("tensor", (one, one)), ("row", (sa, sb))):
            for fast in (False, True):
                for with_bias in (False, True):

                    def fn(a=a, w=w, x=x, y=y, fast=fast, b=bias if with_bias else None) -> object:
                        return torch._scaled_mm(
                            a, w.t(), x, y, bias=b, out_dtype=dt, use_fast_accum=fast
                        )

                    try:
                        us = replay_us(fn)
                    except RuntimeError as err:
                        print(f"fp8 {gemm} {scales}: {str(err).splitlines()[0][:90]}")
                        continue
                    name = f"fp8 {scales}{' fast' if fast else ''}{' bias' if with_bias else ''}"
                    rows.append(
                        {"gemm": gemm, "variant": name, "us": us, "tflops": flops / us / 1e6}
                    )
                    print(
                        f"{gemm:>12} {name:<24} {us:8.1f} us {rows[-1]['tflops']:6.0f} TF/s",
                        flush=True,
                    )
    return rows


def attention_rows(crops: int, vc: VisionConfig, dt: torch.dtype) -> list[dict]:
    """The tower's attention alone, from the QKV output's views as the tower runs it and
    from contiguous tensors, per SDPA backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    t, d, nh = vc.n_patches, vc.enc_dim, vc.enc_n_heads
    qkv = torch.randn(crops, t, 3 * d, device="cuda", dtype=dt)
    q, k, v = (c.view(crops, t, nh, d // nh).transpose(1, 2) for c in qkv.chunk(3, dim=-1))
    qc, kc, vc_ = (x.contiguous() for x in (q, k, v))
    # q, k, v each its own [crops, t, heads, head_dim] tensor (three GEMMs' outputs)
    qs, ks, vs = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    rows = []
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        for layout, args in (
            ("qkv views", (q, k, v)),
            ("contiguous", (qc, kc, vc_)),
            ("bshd", (qs, ks, vs)),
        ):
            with sdpa_kernel([backend]):
                try:
                    us = replay_us(lambda a=args: F.scaled_dot_product_attention(*a))
                except RuntimeError as err:
                    print(f"attention {backend.name} {layout}: {str(err).splitlines()[0][:80]}")
                    continue
            rows.append({"backend": backend.name, "layout": layout, "us": us})
            print(f"attention {backend.name:<16} {layout:<10} {us:8.1f} us", flush=True)
    return rows


def norm_rows(m: int, vc: VisionConfig, dt: torch.dtype) -> list[dict]:
    """The fused add + LayerNorm as the tower runs it, and plain LayerNorm (one read, one
    write) for the floor of a norm whose add happened in the GEMM."""
    from vlm_server.models.common.fused_norm import add_layernorm
    from vlm_server.models.common.layers import LayerNorm

    d = vc.enc_dim
    norm = LayerNorm(d).to("cuda", dt)
    x, a = (torch.randn(m, d, device="cuda", dtype=dt) for _ in range(2))
    from vlm_server.models.common.fp8_vision import Unscaled, gelu_fp8, layernorm_fp8

    u = torch.randn(m, vc.enc_ff_dim, device="cuda", dtype=dt) * 3
    inner = -(-vc.enc_ff_dim // 128) * 128

    def unscaled(raw: torch.Tensor) -> Unscaled:
        """``raw`` as an FP8 product whose scales and bias its consumer applies."""
        n = raw.shape[1]
        row, col = torch.rand(m, 1, device="cuda"), torch.rand(1, n, device="cuda")
        return Unscaled(raw, row, col, torch.randn(n, device="cuda", dtype=dt))

    a_raw, u_raw = unscaled(a), unscaled(u)
    rows = [
        {"variant": "add_layernorm", "us": replay_us(lambda: add_layernorm(x, a, None, norm))},
        {"variant": "layer_norm", "us": replay_us(lambda: norm(x))},
        *(
            {
                "variant": f"add_layernorm_fp8{name} warps {w}",
                "us": replay_us(lambda add=add, w=w: layernorm_fp8(x, add, norm, w)),
            }
            for name, add in (("", a), (" unscaled", a_raw))
            for w in (4, 8)
        ),
        *(
            {
                "variant": f"gelu_fp8{name} {'tail' if split else 'block'} warps {w}",
                "us": replay_us(lambda src=src, launch=(split, w): gelu_fp8(src, inner, launch)),
            }
            for name, src in (("", u), (" unscaled", u_raw))
            for split, w in ((True, 4), (True, 8), (False, 8))
        ),
        {"variant": "gelu bf16 (torch)", "us": replay_us(lambda: F.gelu(u, approximate="tanh"))},
    ]
    for r in rows:
        print(f"norm {r['variant']:<28} {r['us']:8.1f} us", flush=True)
    return rows


def tower_rows(counts: Sequence[int], dt: torch.dtype, profile_dir: str | None) -> list[dict]:
    """The whole tower (random weights), graph-replayed, bf16, FP8, and FP8 with cuBLAS
    applying fc1's and fc2's scales, per crop count; each FP8 tower's deviation from the bf16
    one (at the first count); a kernel table of each mode at the first count when
    ``profile_dir``."""
    from torch.profiler import ProfilerActivity, profile

    from vlm_server.models.common import fp8_vision
    from vlm_server.models.common.vision import VisionEncoder
    from vlm_server.models.moondream2.config import VisionConfig as VC

    enc = VisionEncoder(VC()).to("cuda", dt).eval()
    for p in enc.parameters():
        torch.nn.init.normal_(p, std=0.02)
    rows, outs = [], {}
    modes = ("bf16", "fp8", "fp8 scales in GEMM")
    saved = fp8_vision.DEFER_SCALES
    for crops in tqdm(counts, desc="tower", unit="count"):
        x = torch.randn(crops, 3, 378, 378, device="cuda", dtype=dt)
        for mode in modes:
            enc.use_fp8(mode.startswith("fp8"))
            fp8_vision.DEFER_SCALES = mode != "fp8 scales in GEMM"
            try:
                us = replay_us(lambda x=x: enc.encode(x), calls=1, reps=20)
                if crops == counts[0]:
                    outs[mode] = enc.encode(x).float()
                    if profile_dir:
                        with profile(activities=[ProfilerActivity.CUDA]) as prof:
                            enc.encode(x)
                            torch.cuda.synchronize()
                        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14)
                        with open(f"{profile_dir}/tower_{mode.replace(' ', '_')}.txt", "w") as f:
                            f.write(table)
            finally:
                fp8_vision.DEFER_SCALES = saved
            rows.append(
                {"crops": crops, "mode": mode, "ms": us / 1e3, "crops_per_s": crops / us * 1e6}
            )
            tqdm.write(f"tower {crops:3d} crops {mode:<18} {us / 1e3:8.3f} ms")
        del x
    enc.use_fp8(False)
    base = outs["bf16"]
    deviation: dict = {"crops": counts[0]}
    for mode in modes[1:]:
        cos = F.cosine_similarity(outs[mode].flatten(0, 1), base.flatten(0, 1), dim=-1)
        key = mode.replace(" ", "_")
        deviation[f"{key}_vs_bf16_rel_err"] = float((outs[mode] - base).norm() / base.norm())
        deviation[f"{key}_vs_bf16_min_cos"] = float(cos.min())
    by = {(r["crops"], r["mode"]): r for r in rows}
    print(f"\n{'crops':>5}" + "".join(f" {m + ' ms':>22}" for m in modes))
    for c in sorted(counts):
        print(f"{c:>5}" + "".join(f" {by[c, m]['ms']:>22.3f}" for m in modes))
    for mode in modes[1:]:
        key = mode.replace(" ", "_")
        print(
            f"{mode} vs bf16 at {counts[0]} crops: rel err "
            f"{deviation[key + '_vs_bf16_rel_err']:.4f}, min cosine "
            f"{deviation[key + '_vs_bf16_min_cos']:.5f}"
        )
    return [*rows, deviation]


def plot_towers(rows: list[dict], path: str, device: str) -> bool:
    """Tower time and crops per second against crop count, per mode; False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    modes = list(dict.fromkeys(r["mode"] for r in rows if "mode" in r))
    for mode in modes:
        mine = sorted((r for r in rows if r.get("mode") == mode), key=lambda r: r["crops"])
        crops = [r["crops"] for r in mine]
        left.plot(crops, [r["ms"] for r in mine], marker="o", label=mode)
        right.plot(crops, [r["crops_per_s"] for r in mine], marker="o", label=mode)
    left.set(xlabel="crops", ylabel="tower ms (graph replay)", title="vision tower time")
    right.set(xlabel="crops", ylabel="crops / s", title="vision tower throughput")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"moondream2 vision tower, random weights, {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--crops", type=int, default=9, help="crops of the per-kernel rows")
    ap.add_argument(
        "--tower-crops",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="crop counts of the whole-tower rows (default: --crops)",
    )
    ap.add_argument("--skip-bf16", action="store_true", help="leave out the bf16 GEMM rows")
    ap.add_argument("--tower-only", action="store_true", help="only the whole-tower rows")
    ap.add_argument("--attention-only", action="store_true", help="only the attention rows")
    ap.add_argument("--profile-dir", default=None, help="write kernel tables of the tower here")
    ap.add_argument("--json", default=None, help="write every row here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("tower_probe needs a CUDA device")
        return 1
    torch.manual_seed(0)
    vc, dt = VisionConfig(), torch.bfloat16
    m = args.crops * vc.n_patches
    out = {"device": torch.cuda.get_device_name(), "crops": args.crops, "rows": m}
    with torch.inference_mode():
        if args.attention_only:
            out["attention"] = attention_rows(args.crops, vc, dt)
            return _dump(out, args.json)
        out["norms"] = norm_rows(m, vc, dt)
        counts = args.tower_crops or [args.crops]
        if min(counts) < 1:
            ap.error("--tower-crops must be >= 1")
        out["tower"] = tower_rows(counts, dt, args.profile_dir)
        if args.tower_only:
            return _dump(out, args.json)
        if not args.skip_bf16:
            out["gemms"] = gemm_rows(m, vc, dt)
        out["attention"] = attention_rows(args.crops, vc, dt)
        out["fp8"] = fp8_rows(m, vc, dt)
    return _dump(out, args.json)


def plot_attention(rows: list[dict], path: str, device: str) -> bool:
    """Each attention row's time, fastest first; False without matplotlib."""
    from bench import plotting

    plt = plotting.pyplot()
    if plt is None:
        return False
    rows = sorted(rows, key=lambda r: r["us"])
    fig, ax = plt.subplots(figsize=(7, 0.8 + 0.25 * len(rows)))
    ax.barh([f"{r['backend']} ({r['layout']})" for r in rows], [r["us"] for r in rows])
    ax.invert_yaxis()
    ax.set(xlabel="us a layer", title=f"tower attention, {device}")
    ax.grid(alpha=0.3, axis="x")
    plotting.save(plt, fig, path)
    return True


def _dump(out: dict, path: str | None) -> int:
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        png = path.removesuffix(".json") + ".png"
        if "tower" in out:
            drawn = plot_towers(out["tower"], png, out["device"])
        else:
            drawn = plot_attention(out["attention"], png, out["device"])
        if drawn:
            print(f"wrote {path}, {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
