"""Matrix products for few rows (decode steps), with their epilogues fused (Triton, CUDA).

A decode step multiplies a handful of rows by each weight matrix: the product is bound by
reading the weights once, and at one row cuBLAS's kernels and the launches between them leave
a third of the memory bandwidth unused. One program here owns a block of output columns for
every row, streams its slice of the weight through once, and finishes in its epilogue what
separate kernels did before: the bias, the tanh GELU on the columns from ``gelu_from`` on (so
the attention's QKV and the MLP's fc1 are one product over the same normed input), and the
residual add (so the attention's output projection and fc2 are one product over the two
inputs laid side by side, added to the residual stream).

Rows and columns are independent programs, sums run in a fixed order: the result is
deterministic. fp32 inputs multiply in IEEE fp32 (no TF32), so fp32 parity checks hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path needs no Triton
    triton = None
    tl = None

AVAILABLE = triton is not None
MAX_ROWS = 64  # above this cuBLAS's tiled kernels win; callers fall back to them


@dataclass(frozen=True)
class SkinnyConfig:
    """Launch shape: columns per program, the K step, warps and pipeline stages."""

    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 3


def default_config(rows: int, n: int, k: int) -> SkinnyConfig:
    """The launch shape chosen by measurement (bench/gemv_probe.py) for these sizes."""
    if rows == 1:
        return SkinnyConfig(block_n=16 if n <= 4096 else 32, block_k=256, warps=4, stages=4)
    return SkinnyConfig(block_n=32 if n <= 4096 else 64, block_k=128, warps=4, stages=4)


if triton is not None:

    @triton.jit
    def _gelu_tanh(v):
        # 0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3))), tanh via exp for fp32 precision.
        u = 0.7978845608028654 * (v + 0.044715 * v * v * v)
        t = 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)
        return 0.5 * v * (1.0 + t)

    @triton.jit
    def _skinny_kernel(
        x1_ptr,
        x2_ptr,
        w_ptr,
        b_ptr,
        r_ptr,
        y_ptr,
        M,
        N,
        K1,
        K2,
        stride_x1,
        stride_x2,
        stride_w,
        stride_r,
        stride_y,
        gelu_from,
        HAS_X2: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_RES: tl.constexpr,
        HAS_GELU: tl.constexpr,
        IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid = tl.program_id(0)
        ns = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = ns < N
        w_rows = w_ptr + ns.to(tl.int64)[:, None] * stride_w
        if BLOCK_M == 1:
            acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            for k0 in range(0, K1, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                kmask = ks < K1
                x = tl.load(x1_ptr + ks, mask=kmask, other=0.0).to(tl.float32)
                w = tl.load(w_rows + ks[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
                acc2 += w.to(tl.float32) * x[None, :]
            if HAS_X2:
                for k0 in range(0, K2, BLOCK_K):
                    ks = k0 + tl.arange(0, BLOCK_K)
                    kmask = ks < K2
                    x = tl.load(x2_ptr + ks, mask=kmask, other=0.0).to(tl.float32)
                    w = tl.load(
                        w_rows + (K1 + ks)[None, :],
                        mask=nmask[:, None] & kmask[None, :],
                        other=0.0,
                    )
                    acc2 += w.to(tl.float32) * x[None, :]
            acc = tl.sum(acc2, axis=1)[None, :]
            ms = tl.arange(0, 1)
        else:
            ms = tl.arange(0, BLOCK_M)
            mmask = ms < M
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K1, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                kmask = ks < K1
                x = tl.load(
                    x1_ptr + ms.to(tl.int64)[:, None] * stride_x1 + ks[None, :],
                    mask=mmask[:, None] & kmask[None, :],
                    other=0.0,
                )
                w = tl.load(w_rows + ks[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
                if IEEE:
                    acc += tl.dot(x, tl.trans(w), input_precision="ieee")
                else:
                    acc += tl.dot(x, tl.trans(w))
            if HAS_X2:
                for k0 in range(0, K2, BLOCK_K):
                    ks = k0 + tl.arange(0, BLOCK_K)
                    kmask = ks < K2
                    x = tl.load(
                        x2_ptr + ms.to(tl.int64)[:, None] * stride_x2 + ks[None, :],
                        mask=mmask[:, None] & kmask[None, :],
                        other=0.0,
                    )
                    w = tl.load(
                        w_rows + (K1 + ks)[None, :],
                        mask=nmask[:, None] & kmask[None, :],
                        other=0.0,
                    )
                    if IEEE:
                        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
                    else:
                        acc += tl.dot(x, tl.trans(w))
        out_mask = (ms < M)[:, None] & nmask[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + ns, mask=nmask, other=0.0).to(tl.float32)[None, :]
        if HAS_GELU:
            acc = tl.where((ns >= gelu_from)[None, :], _gelu_tanh(acc), acc)
        if HAS_RES:
            # Rounded to the activation dtype first: the unfused code adds a rounded branch.
            acc = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
            r = tl.load(
                r_ptr + ms.to(tl.int64)[:, None] * stride_r + ns[None, :], mask=out_mask, other=0.0
            )
            acc += r.to(tl.float32)
        tl.store(
            y_ptr + ms.to(tl.int64)[:, None] * stride_y + ns[None, :],
            acc.to(y_ptr.dtype.element_ty),
            mask=out_mask,
        )


def supported(x: torch.Tensor) -> bool:
    """Whether `skinny_linear` runs for activations like ``x`` (else use the plain ops)."""
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    return (
        AVAILABLE
        and x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and 0 < rows <= MAX_ROWS
    )


def skinny_linear(
    x1: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    x2: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    gelu_from: int | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """``[x1 | x2] @ weight^T + bias``, GELU on columns >= ``gelu_from``, plus ``residual``.

    x1 [..., K1] (x2 [..., K2]: the weight's remaining input columns); weight [N, K1 + K2]
    with unit column stride; returns [..., N] in x1's dtype.
    """
    lead = x1.shape[:-1]
    k1 = x1.shape[-1]
    a = x1.reshape(-1, k1)
    if a.stride(-1) != 1:
        a = a.contiguous()
    m = a.shape[0]
    k2 = 0
    b2 = a
    if x2 is not None:
        k2 = x2.shape[-1]
        b2 = x2.reshape(-1, k2)
        if b2.stride(-1) != 1:
            b2 = b2.contiguous()
    n = weight.shape[0]
    if weight.shape[1] != k1 + k2 or weight.stride(1) != 1:
        raise ValueError(f"weight {tuple(weight.shape)} does not take inputs of {k1} + {k2}")
    y = torch.empty(m, n, device=a.device, dtype=a.dtype)
    res = residual.reshape(-1, n) if residual is not None else y
    cfg = config or default_config(m, n, k1 + k2)
    block_m = 1 if m == 1 else max(16, triton.next_power_of_2(m))
    _skinny_kernel[(triton.cdiv(n, cfg.block_n),)](
        a,
        b2,
        weight,
        bias if bias is not None else weight,
        res,
        y,
        m,
        n,
        k1,
        k2,
        a.stride(0),
        b2.stride(0),
        weight.stride(0),
        res.stride(0),
        y.stride(0),
        gelu_from if gelu_from is not None else n,
        HAS_X2=x2 is not None,
        HAS_BIAS=bias is not None,
        HAS_RES=residual is not None,
        HAS_GELU=gelu_from is not None,
        IEEE=a.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.warps,
        num_stages=cfg.stages,
    )
    return y.view(*lead, n)
