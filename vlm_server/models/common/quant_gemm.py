"""Matrix products over 8- and 4-bit weights, dequantized in registers (Triton, CUDA).

The weight layouts (the quantizer writes them; the format follows ``qweight``'s dtype):

- INT8, a scale per output channel: ``qweight`` int8 [N, K], ``scale`` [N];
  ``w = qweight * scale[:, None]``.
- INT4, a scale per `GROUP` consecutive input columns of each output row (K a multiple of
  `GROUP`): q in [-8, 7] packed two a byte along K, ``qweight`` uint8 [N, K / 2], column 2j
  in the low nibble and 2j + 1 in the high one, each two's complement; ``scale``
  [N, K / GROUP]; ``w[n, k] = q[n, k] * scale[n, k // GROUP]``.

Each weight tile is widened in registers as the plain path's dequantization rounds it (the
product q * scale, exact in fp32, rounded once to the scale's dtype, then to the
activations'), so a product here equals "dequantize, then the 16-bit product" up to the order
of its fp32 sums. A K step reads two halves of the tile: for INT4 the even and the odd
columns (the low and the high nibbles of the same bytes, no interleaving in registers), for
INT8 the first and the second half of the step.

Two launchers: `quant_skinny_linear` for decode steps (1 to `MAX_ROWS` rows; one program
owns a block of columns for every row, K optionally split into slices that a second kernel
adds in a fixed order, as skinny_gemm does, with its epilogue) and `quant_linear` for prefill
(tiles of rows by columns, grouped so that neighbouring programs share weight tiles in L2).
Launch shapes start from skinny_gemm's, measured for 16-bit weights; quantized ones are yet
to be measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlm_server.chip_features import device_spec
from vlm_server.chips import ChipSpec, Launch
from vlm_server.models.common import skinny_gemm
from vlm_server.models.common.skinny_gemm import SkinnyConfig

try:
    import triton
    import triton.language as tl

    from vlm_server.models.common.skinny_gemm import _epilogue
except ImportError:  # the CPU path needs no Triton
    triton = None
    tl = None

AVAILABLE = triton is not None
GROUP = 128  # INT4: input columns sharing a scale
MAX_ROWS = 64  # the skinny launcher's rows; more take `quant_linear`


@dataclass(frozen=True)
class PrefillConfig:
    """`quant_linear`'s tile of rows by columns, its K step, warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 3


def default_config(rows: int, n: int, k: int, itemsize: int = 2) -> SkinnyConfig:
    """`quant_skinny_linear`'s launch shape: skinny_gemm's for the same sizes."""
    return skinny_gemm.default_config(rows, n, k, itemsize)


def prefill_config(rows: int) -> PrefillConfig:
    """`quant_linear`'s tiles: 128 rows where there are that many, else 64."""
    if rows > 64:
        return PrefillConfig(128, 128, 64, warps=8, stages=3)
    return PrefillConfig(64, 128, 64, warps=4, stages=3)


def stages_for(block_m: int, block_n: int, block_k: int, stages: int, shared: int) -> int:
    """``stages`` less where a stage would not fit ``shared`` bytes: the activations' tile,
    the packed weight's and the widened weight's (16-bit) a stage."""
    per_stage = (block_m + block_n) * block_k * 2 + block_n * block_k
    return max(1, min(stages, shared // per_stage - 1))


def _block_m(rows: int, cfg: SkinnyConfig) -> int:
    # Tensor-core tiles take 16 rows at least; the CUDA cores take the rows as they are.
    block = 1 << max(0, rows - 1).bit_length()
    return block if cfg.fma else max(16, block)


def _check_step(block_k: int, fma: bool) -> None:
    # A step is two halves of a power of two columns; a tensor-core half takes 16 at least.
    least = 2 if fma else 32
    if block_k < least or block_k & (block_k - 1):
        raise ValueError(f"block_k must be a power of two of at least {least}, not {block_k}")


def _weight_types(int4: bool) -> dict[str, str]:
    return {"w_ptr": "*u8" if int4 else "*i8"}


def launch_configs(chip: ChipSpec) -> list[Launch]:
    """Every launch `quant_skinny_linear` and `quant_linear` may pick on ``chip`` for 16-bit
    activations, both formats: `default_config`'s shapes at 1 to `MAX_ROWS` rows (whole
    and split K), `prefill_config`'s tiles, and the split sums' kernel."""
    shared = chip.limits.shared_per_block
    blocks = set()
    for rows in range(1, MAX_ROWS + 1):
        for n in (4096, 4097):
            cfg = default_config(rows, n, 1 << 14)
            blocks.add((_block_m(rows, cfg), cfg))
    out: list[Launch] = []
    for int4 in (False, True):
        types = _weight_types(int4)
        for block_m, cfg in sorted(blocks, key=str):
            stages = stages_for(block_m, cfg.block_n, cfg.block_k, cfg.stages, shared)
            for split in (True, False) if cfg.split_k == 1 else (True,):
                consts = {"BLOCK_M": block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k}
                consts |= {"SPLIT": split, "FMA": cfg.fma, "INT4": int4}
                launch = Launch("_quant_skinny_kernel", consts, cfg.warps, stages, types)
                if launch not in out:
                    out.append(launch)
        for rows in (64, 128):
            p = prefill_config(rows)
            stages = stages_for(p.block_m, p.block_n, p.block_k, p.stages, shared)
            consts = {"BLOCK_M": p.block_m, "BLOCK_N": p.block_n, "BLOCK_K": p.block_k}
            consts |= {"INT4": int4}
            out.append(Launch("_quant_gemm_kernel", consts, p.warps, stages, types))
    splits = max(c.split_k for _, c in blocks)
    out.append(Launch("_quant_split_sum_kernel", {"SPLITS": splits, "BLOCK_M": 16, "BLOCK_N": 128}))
    return out


if triton is not None:

    @triton.jit
    def _widen(q, s, dtype: tl.constexpr):
        # q * s is exact in fp32 (|q| <= 128, a 16-bit scale): one rounding, to the scale's
        # dtype, as the dequantized weight has it; then to the activations'.
        return (q.to(tl.float32) * s.to(tl.float32)).to(s.dtype).to(dtype)

    @triton.jit
    def _halves(x_rows, w_rows, s_rows, s8, mmask, nmask, k0, k_lim, INT4: tl.constexpr,
                GROUP: tl.constexpr, HALF: tl.constexpr):  # fmt: skip
        # One K step of 2 HALF columns as two halves (inputs [M, HALF], widened weights
        # [N, HALF]): INT4's even and odd columns, INT8's first and second half.
        js = tl.arange(0, HALF)
        if INT4:
            ka = k0 + 2 * js
            kb = ka + 1
        else:
            ka = k0 + js
            kb = ka + HALF
        ma = ka < k_lim
        mb = kb < k_lim
        xa = tl.load(x_rows + ka[None, :], mask=mmask[:, None] & ma[None, :], other=0.0)
        xb = tl.load(x_rows + kb[None, :], mask=mmask[:, None] & mb[None, :], other=0.0)
        if INT4:
            wmask = nmask[:, None] & ma[None, :]
            packed = tl.load(
                w_rows + (k0 // 2 + js)[None, :],
                mask=wmask,
                other=0,
                eviction_policy="evict_first",
            ).to(tl.int32)
            # Sign-extend each nibble: move it to the top of the word, shift back arithmetically.
            qa = (packed << 28) >> 28
            qb = (packed << 24) >> 28
            s = tl.load(s_rows[:, None] + (ka // GROUP)[None, :], mask=wmask, other=0.0)
            wa = _widen(qa, s, xa.dtype)
            wb = _widen(qb, s, xa.dtype)
        else:
            qa = tl.load(
                w_rows + ka[None, :],
                mask=nmask[:, None] & ma[None, :],
                other=0,
                eviction_policy="evict_first",
            )
            qb = tl.load(
                w_rows + kb[None, :],
                mask=nmask[:, None] & mb[None, :],
                other=0,
                eviction_policy="evict_first",
            )
            wa = _widen(qa, s8[:, None], xa.dtype)
            wb = _widen(qb, s8[:, None], xa.dtype)
        return xa, wa, xb, wb

    @triton.jit
    def _accumulate(x_rows, w_rows, s_rows, mmask, nmask, k_lo, k_stop, k_lim,
                    INT4: tl.constexpr, GROUP: tl.constexpr, IEEE: tl.constexpr,
                    FMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):  # fmt: skip
        # The sum over K steps k_lo.. (< k_stop; columns past k_lim masked) of the inputs
        # times the widened weight rows; pointers named without "_ptr": inlined, not launched.
        HALF: tl.constexpr = BLOCK_K // 2
        if INT4:
            s8 = tl.zeros((BLOCK_N,), dtype=tl.float32)  # unused: INT4's scales vary along K
        else:
            s8 = tl.load(s_rows, mask=nmask, other=0.0)  # the rows' scales, loaded once
        if FMA:
            # On the CUDA cores: products summed per lane across K steps, reduced once.
            acc3 = tl.zeros((BLOCK_M, BLOCK_N, HALF), dtype=tl.float32)
            for k0 in range(k_lo, k_stop, BLOCK_K):
                xa, wa, xb, wb = _halves(x_rows, w_rows, s_rows, s8, mmask, nmask, k0, k_lim,
                                         INT4, GROUP, HALF)  # fmt: skip
                acc3 += xa.to(tl.float32)[:, None, :] * wa.to(tl.float32)[None, :, :]
                acc3 += xb.to(tl.float32)[:, None, :] * wb.to(tl.float32)[None, :, :]
            acc = tl.sum(acc3, axis=2)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(k_lo, k_stop, BLOCK_K):
                xa, wa, xb, wb = _halves(x_rows, w_rows, s_rows, s8, mmask, nmask, k0, k_lim,
                                         INT4, GROUP, HALF)  # fmt: skip
                if IEEE:
                    acc += tl.dot(xa, tl.trans(wa), input_precision="ieee")
                    acc += tl.dot(xb, tl.trans(wb), input_precision="ieee")
                else:
                    acc += tl.dot(xa, tl.trans(wa))
                    acc += tl.dot(xb, tl.trans(wb))
        return acc

    @triton.jit
    def _quant_skinny_kernel(
        x_ptr,
        w_ptr,
        s_ptr,
        b_ptr,
        r_ptr,
        y_ptr,
        part_ptr,
        M,
        N,
        K,
        k_per_split,
        stride_x,
        stride_w,
        stride_s,
        stride_r,
        stride_y,
        gelu_from,
        INT4: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_RES: tl.constexpr,
        HAS_GELU: tl.constexpr,
        IEEE: tl.constexpr,
        SPLIT: tl.constexpr,
        FMA: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP: tl.constexpr = 128,
    ):
        # Axis 0: blocks of columns (every row); axis 1: slices of K (SPLIT: fp32 sums).
        pid = tl.program_id(0)
        split = tl.program_id(1)
        ms = tl.arange(0, BLOCK_M)
        mmask = ms < M
        ns = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = ns < N
        x_rows = x_ptr + ms.to(tl.int64)[:, None] * stride_x
        w_rows = w_ptr + ns.to(tl.int64)[:, None] * stride_w
        s_rows = s_ptr + ns.to(tl.int64) * stride_s
        k_lo = split * k_per_split
        acc = _accumulate(x_rows, w_rows, s_rows, mmask, nmask, k_lo, k_lo + k_per_split, K,
                          INT4, GROUP, IEEE, FMA, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
        out_mask = mmask[:, None] & nmask[None, :]
        if SPLIT:
            offs = (split * M + ms.to(tl.int64))[:, None] * N + ns[None, :]
            tl.store(part_ptr + offs, acc, mask=out_mask)
        else:
            _epilogue(acc, ns, nmask, out_mask, ms, b_ptr, r_ptr, y_ptr, stride_r, stride_y,
                      gelu_from, HAS_BIAS, HAS_RES, HAS_GELU)  # fmt: skip

    @triton.jit
    def _quant_split_sum_kernel(
        part_ptr,
        b_ptr,
        r_ptr,
        y_ptr,
        M,
        N,
        stride_r,
        stride_y,
        gelu_from,
        SPLITS: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_RES: tl.constexpr,
        HAS_GELU: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        # The slices of K summed in split order: deterministic, unlike atomics.
        ns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        ms = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        nmask = ns < N
        out_mask = (ms < M)[:, None] & nmask[None, :]
        offs = ms.to(tl.int64)[:, None] * N + ns[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            acc += tl.load(part_ptr + s * M * N + offs, mask=out_mask, other=0.0)
        _epilogue(acc, ns, nmask, out_mask, ms, b_ptr, r_ptr, y_ptr, stride_r, stride_y,
                  gelu_from, HAS_BIAS, HAS_RES, HAS_GELU)  # fmt: skip

    @triton.jit
    def _quant_gemm_kernel(
        x_ptr,
        w_ptr,
        s_ptr,
        b_ptr,
        r_ptr,
        y_ptr,
        M,
        N,
        K,
        stride_x,
        stride_w,
        stride_s,
        stride_r,
        stride_y,
        gelu_from,
        INT4: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_RES: tl.constexpr,
        HAS_GELU: tl.constexpr,
        IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr = 8,
        GROUP: tl.constexpr = 128,
    ):
        # Programs walk GROUP_M blocks of rows down one block of columns before the next, so
        # that the weight tiles they widen are read from memory once per group, not per block.
        pid = tl.program_id(0)
        blocks_m = tl.cdiv(M, BLOCK_M)
        blocks_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * blocks_n
        first_m = (pid // per_group) * GROUP_M
        group_m = tl.minimum(blocks_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_m
        pid_n = (pid % per_group) // group_m
        ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = ms < M
        ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = ns < N
        x_rows = x_ptr + ms.to(tl.int64)[:, None] * stride_x
        w_rows = w_ptr + ns.to(tl.int64)[:, None] * stride_w
        s_rows = s_ptr + ns.to(tl.int64) * stride_s
        acc = _accumulate(x_rows, w_rows, s_rows, mmask, nmask, 0, K, K,
                          INT4, GROUP, IEEE, False, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
        out_mask = mmask[:, None] & nmask[None, :]
        _epilogue(acc, ns, nmask, out_mask, ms, b_ptr, r_ptr, y_ptr, stride_r, stride_y,
                  gelu_from, HAS_BIAS, HAS_RES, HAS_GELU)  # fmt: skip


def _checked(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> tuple[bool, int]:
    """(INT4, K) of a weight that takes inputs like ``x``; a clear error where it does not."""
    k = x.shape[-1]
    n = qweight.shape[0]
    if qweight.dim() != 2 or qweight.stride(1) != 1:
        raise ValueError(f"qweight must be 2-D with unit column stride, not {tuple(qweight.shape)}")
    if qweight.dtype == torch.int8:
        if qweight.shape[1] != k:
            raise ValueError(f"qweight {tuple(qweight.shape)} does not take inputs of {k}")
        if scale.shape != (n,):
            raise ValueError(f"INT8 scale must be [{n}], not {tuple(scale.shape)}")
        return False, k
    if qweight.dtype == torch.uint8:
        if k % GROUP or qweight.shape[1] * 2 != k:
            raise ValueError(
                f"qweight {tuple(qweight.shape)} (INT4, packed) does not take inputs of {k}: "
                f"K must be twice its columns and a multiple of {GROUP}"
            )
        if scale.shape != (n, k // GROUP) or scale.stride(1) != 1:
            raise ValueError(f"INT4 scale must be [{n}, {k // GROUP}], not {tuple(scale.shape)}")
        return True, k
    raise ValueError(f"qweight must be int8 (INT8) or uint8 (packed INT4), not {qweight.dtype}")


def supported(x: torch.Tensor) -> bool:
    """Whether these kernels run for activations like ``x`` (else dequantize and use torch)."""
    return (
        AVAILABLE
        and x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and x.numel() > 0
    )


def _shared(device: torch.device) -> int | None:
    return device_spec(device.index or 0).limits.shared_per_block if device.type == "cuda" else None


def _epilogue_args(
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    gelu_from: int | None,
    y: torch.Tensor,
    n: int,
) -> tuple[torch.Tensor, torch.Tensor, int, dict[str, bool]]:
    res = residual.reshape(-1, n) if residual is not None else y
    if res.stride(-1) != 1:
        res = res.contiguous()
    flags = {
        "HAS_BIAS": bias is not None,
        "HAS_RES": residual is not None,
        "HAS_GELU": gelu_from is not None,
    }
    return (bias if bias is not None else y), res, gelu_from if gelu_from is not None else n, flags


def quant_skinny_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    gelu_from: int | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """``x @ w^T + bias``, GELU on columns >= ``gelu_from``, plus ``residual``, with ``w`` the
    dequantized ``qweight``/``scale`` (module docstring), for 1 to `MAX_ROWS` rows of ``x``
    [..., K]; returns [..., N] in x's dtype."""
    int4, k = _checked(x, qweight, scale)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], qweight.shape[0]
    if not 0 < m <= MAX_ROWS:
        raise ValueError(f"x has {m} rows: the skinny product takes 1 to {MAX_ROWS}")
    cfg = config or default_config(m, n, k, x2.element_size())
    _check_step(cfg.block_k, cfg.fma)
    block_m = _block_m(m, cfg)
    split = max(1, cfg.split_k)
    # Each split's slice of K is a whole number of K steps.
    k_per_split = triton.cdiv(triton.cdiv(k, split), cfg.block_k) * cfg.block_k
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    part = torch.empty(split, m, n, device=x.device, dtype=torch.float32) if split > 1 else y
    b, res, gelu, flags = _epilogue_args(bias, residual, gelu_from, y, n)
    shared = _shared(x.device)
    stages = cfg.stages
    if shared is not None:
        stages = stages_for(block_m, cfg.block_n, cfg.block_k, cfg.stages, shared)
    _quant_skinny_kernel[(triton.cdiv(n, cfg.block_n), split)](
        x2, qweight, scale, b, res, y, part, m, n, k, k_per_split,
        x2.stride(0), qweight.stride(0), scale.stride(0), res.stride(0), y.stride(0), gelu,
        INT4=int4, IEEE=x.dtype == torch.float32, SPLIT=split > 1, FMA=cfg.fma,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP=GROUP,
        num_warps=cfg.warps, num_stages=stages, **flags,
    )  # fmt: skip
    if split > 1:
        _quant_split_sum_kernel[(triton.cdiv(n, 128), triton.cdiv(m, 16))](
            part, b, res, y, m, n, res.stride(0), y.stride(0), gelu,
            SPLITS=split, BLOCK_M=16, BLOCK_N=128, **flags,
        )  # fmt: skip
    return y.view(*lead, n)


def quant_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    gelu_from: int | None = None,
    config: PrefillConfig | None = None,
) -> torch.Tensor:
    """`quant_skinny_linear` for any number of rows (prefill), in tiles of rows by columns,
    the weight tile widened in registers each K step."""
    int4, k = _checked(x, qweight, scale)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], qweight.shape[0]
    cfg = config or prefill_config(m)
    _check_step(cfg.block_k, False)
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return y.view(*lead, n)
    b, res, gelu, flags = _epilogue_args(bias, residual, gelu_from, y, n)
    shared = _shared(x.device)
    stages = cfg.stages
    if shared is not None:
        stages = stages_for(cfg.block_m, cfg.block_n, cfg.block_k, cfg.stages, shared)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _quant_gemm_kernel[grid](
        x2, qweight, scale, b, res, y, m, n, k,
        x2.stride(0), qweight.stride(0), scale.stride(0), res.stride(0), y.stride(0), gelu,
        INT4=int4, IEEE=x.dtype == torch.float32, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP=GROUP, num_warps=cfg.warps, num_stages=stages, **flags,
    )  # fmt: skip
    return y.view(*lead, n)
