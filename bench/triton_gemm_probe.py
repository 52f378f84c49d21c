"""The vision tower's four products as a persistent Triton GEMM (TMA descriptors, bias and GELU
in the epilogue) against cuBLAS, at the tower's shapes (CUDA, compute capability 9.0+).

    python -m bench.triton_gemm_probe [--crops 9] [--json OUT.json]

Each product (QKV, projection, fc1 with its GELU, fc2; M = crops x 729 rows, bf16, fp32
accumulation) is timed as cuBLAS runs it in the tower (``F.linear``, or cuBLASLt's bias + GELU
epilogue for fc1) and as the Triton kernel at every launch shape of a small sweep (tile sizes,
pipeline depth, with and without warp specialization), after checking the kernel's output
against cuBLAS's. Prints the best of each and the TFLOP/s, and writes every row to ``--json``.
The question it answers: is there a product kernel within reach that beats cuBLAS at these
shapes (the bf16 tower's floor is its products, docs/performance.md)?
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # the CPU has no use for it
    triton = None


@dataclass(frozen=True)
class Shape:
    """One launch shape of the persistent kernel."""

    bm: int
    bn: int
    bk: int
    stages: int
    warps: int
    ws: bool  # warp specialization of the tile loop


if triton is not None:

    @triton.jit
    def _gelu_tanh(v):
        u = 0.7978845608028654 * (v + 0.044715 * v * v * v)
        return 0.5 * v * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))

    @triton.jit
    def _persistent_mm(
        a_desc,
        w_desc,
        c_desc,
        bias_ptr,
        M,
        N,
        K,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        GROUP_M: tl.constexpr,
        NUM_SMS: tl.constexpr,
        GELU: tl.constexpr,
        WS: tl.constexpr,
    ):
        # out[M, N] = a[M, K] @ w[N, K]^T + bias, tiles visited in groups of GROUP_M rows so
        # that consecutive programs share their weight tiles in L2.
        num_m = tl.cdiv(M, BM)
        num_n = tl.cdiv(N, BN)
        k_tiles = tl.cdiv(K, BK)
        per_group = GROUP_M * num_n
        for tile in tl.range(
            tl.program_id(0), num_m * num_n, NUM_SMS, flatten=True, warp_specialize=WS
        ):
            group = tile // per_group
            first_m = group * GROUP_M
            size_m = min(num_m - first_m, GROUP_M)
            pid_m = first_m + (tile % per_group) % size_m
            pid_n = (tile % per_group) // size_m
            om = pid_m * BM
            on = pid_n * BN
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for ki in range(k_tiles):
                a = a_desc.load([om, ki * BK])
                w = w_desc.load([on, ki * BK])
                acc = tl.dot(a, w.T, acc)
            cols = on + tl.arange(0, BN)
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            if GELU:
                acc = _gelu_tanh(acc)
            c_desc.store([om, on], acc.to(c_desc.dtype))


def triton_linear(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, shape: Shape, gelu: bool = False
) -> torch.Tensor:
    """``x @ w.T + b`` (then GELU) by the persistent kernel at launch shape ``shape``."""
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    a_desc = TensorDescriptor.from_tensor(x, [shape.bm, shape.bk])
    w_desc = TensorDescriptor.from_tensor(w, [shape.bn, shape.bk])
    c_desc = TensorDescriptor.from_tensor(out, [shape.bm, shape.bn])
    tiles = triton.cdiv(m, shape.bm) * triton.cdiv(n, shape.bn)
    _persistent_mm[(min(sms, tiles),)](
        a_desc, w_desc, c_desc, b, m, n, k,
        BM=shape.bm, BN=shape.bn, BK=shape.bk, GROUP_M=8, NUM_SMS=sms, GELU=gelu, WS=shape.ws,
        num_stages=shape.stages, num_warps=shape.warps,
    )  # fmt: skip
    return out


SHAPES = [
    Shape(bm, bn, 64, st, wp, ws)
    for (bm, bn), st, wp, ws in itertools.product(
        [(128, 128), (128, 256), (256, 128)], [3, 4], [8], [False, True]
    )
    if not (bm * bn >= 128 * 256 and st > 3)  # four stages of the wide tiles overflow SMEM
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--crops", type=int, default=9)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if triton is None or not torch.cuda.is_available():
        print("triton_gemm_probe needs Triton and a CUDA device", file=sys.stderr)
        return 1
    if torch.cuda.get_device_capability() < (9, 0):
        print("triton_gemm_probe needs compute capability 9.0+ (TMA)", file=sys.stderr)
        return 1
    from bench.graph_timing import graph_ms
    from vlm_server.models.moondream2.config import VisionConfig

    vc, dt, dev = VisionConfig(), torch.bfloat16, "cuda"
    m, d, f = args.crops * vc.n_patches, vc.enc_dim, vc.enc_ff_dim
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*s: int) -> torch.Tensor:
        return (torch.randn(*s, device=dev, generator=g) * 0.05).to(dt)

    products = {  # name: (input, weight, bias, gelu)
        "qkv": (rnd(m, d), rnd(3 * d, d), rnd(3 * d), False),
        "proj": (rnd(m, d), rnd(d, d), rnd(d), False),
        "fc1+gelu": (rnd(m, d), rnd(f, d), rnd(f), True),
        "fc2": (rnd(m, f), rnd(d, f), rnd(d), False),
    }
    rows, table = [], []
    with torch.inference_mode():
        for name, (x, w, b, gelu) in products.items():
            flops = 2 * m * w.shape[0] * w.shape[1]
            if gelu:
                ref = torch._addmm_activation(b, x, w.t(), use_gelu=True)
                cublas_ms = graph_ms(lambda x=x, w=w, b=b: torch._addmm_activation(
                    b, x, w.t(), use_gelu=True))  # fmt: skip
            else:
                ref = F.linear(x, w, b)
                cublas_ms = graph_ms(lambda x=x, w=w, b=b: F.linear(x, w, b))
            rows.append({"product": name, "kernel": "cublas", "ms": cublas_ms})
            best: tuple[float, Shape] | None = None
            for shape in SHAPES:
                try:
                    got = triton_linear(x, w, b, shape, gelu)
                    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
                    ms = graph_ms(lambda x=x, w=w, b=b, s=shape, g_=gelu: triton_linear(
                        x, w, b, s, g_))  # fmt: skip
                except Exception as exc:  # a shape the compiler or the chip refuses
                    print(f"  {name} {shape}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
                    continue
                rows.append({"product": name, "kernel": "triton", **asdict(shape), "ms": ms})
                print(f"  {name} {shape}: {ms * 1e3:.1f} us", flush=True)
                if best is None or ms < best[0]:
                    best = (ms, shape)
            tf = flops / 1e9
            line = [name, cublas_ms * 1e3, tf / cublas_ms]
            line += [best[0] * 1e3, tf / best[0], str(best[1])] if best else [None, None, "-"]
            table.append(line)
    print(
        f"\n{'product':<10} {'cuBLAS us':>10} {'TF/s':>6} {'Triton us':>10} {'TF/s':>6}  best shape"
    )
    for name, cu, cu_tf, tr, tr_tf, shape in table:
        tr_s = f"{tr:>10.1f} {tr_tf:>6.0f}" if tr is not None else f"{'-':>10} {'-':>6}"
        print(f"{name:<10} {cu:>10.1f} {cu_tf:>6.0f} {tr_s}  {shape}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "rows_m": m, "rows": rows}, fh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
