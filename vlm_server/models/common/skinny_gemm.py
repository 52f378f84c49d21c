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

from vlm_server.chip_features import device_spec
from vlm_server.chips import ChipSpec, Launch
from vlm_server.models.common import launch_overlap
from vlm_server.models.common.quant_stack import QuantWeight
from vlm_server.models.quant.formats import GROUP_SIZE

try:
    import triton
    import triton.language as tl

    from vlm_server.models.common.launch_overlap import gdc_launch_dependents, gdc_wait
except ImportError:  # the CPU path needs no Triton
    triton = None
    tl = None

AVAILABLE = triton is not None
# Above this cuBLAS's tiled kernels are as fast (bench/gemv_probe.py); callers fall back to
# them. (fp32 blocks of 64 rows also gave wrong sums on an H100 under Triton 3.6.)
MAX_ROWS = 32


@dataclass(frozen=True)
class SkinnyConfig:
    """Launch shape: columns per program, the K step, warps, pipeline stages, the number of
    programs sharing one block of columns (each sums a slice of K; a second kernel adds the
    slices in a fixed order and applies the epilogue), and whether the products run on the
    CUDA cores (``fma``: no tensor-core tile, so no row padding to 16 and no staging of the
    weight through shared memory; the weight goes straight from memory to registers)."""

    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 4
    split_k: int = 1
    fma: bool = False


# Rows up to which the default launch multiplies on the CUDA cores. One row: moondream2's
# decode products stream at 2.65 TB/s that way against 2.35 in tensor-core tiles padded to
# 16 rows (H100, bench/gemv_probe.py).
FMA_MAX_ROWS = 1
# The CUDA-core launch's K step: long contiguous runs of each weight row per program.
FMA_BLOCK_K = 1024
# K per program where few columns split it. Wider slices cost the product nothing
# (bench/gemv_probe.py) and leave its consumer fewer split sums to add: at one row the
# norm after the branch adds them in one program, on the decode step's critical path.
FMA_K_PER_SPLIT = 2048


def default_config(rows: int, n: int, k: int, itemsize: int = 2) -> SkinnyConfig:
    """The launch shape chosen by measurement (bench/gemv_probe.py, an H100 and an H200,
    moondream2's products at 1 and 32 rows) for these sizes; fp32 tiles are halved along K."""
    if rows <= FMA_MAX_ROWS and itemsize == 2:
        # Two weight rows a program, FMA_BLOCK_K of K a step: few columns split K into
        # slices of about FMA_K_PER_SPLIT (fc2's 8192 in four), at most eight, none empty.
        block_k = min(FMA_BLOCK_K, 1 << max(0, k - 1).bit_length())
        steps = -(-k // block_k)
        per = max(1, FMA_K_PER_SPLIT // block_k, -(-steps // 8))
        split = 1 if n > 4096 else -(-steps // per)
        return SkinnyConfig(block_n=2, block_k=block_k, warps=4, stages=1, split_k=split, fma=True)
    shrink = 2 if itemsize > 2 else 1
    if n <= 4096:  # few columns: split K so every SM streams its share of the weight
        return SkinnyConfig(block_n=64, block_k=256 // shrink, warps=4, stages=4, split_k=4)
    return SkinnyConfig(block_n=128, block_k=128 // shrink, warps=4, stages=4)


def stages_for(cfg: SkinnyConfig, block_m: int, itemsize: int, shared_per_block: int) -> int:
    """The config's pipeline depth, less where a stage's tiles would not fit
    ``shared_per_block`` bytes (consumer and Ada chips have under half of Hopper's)."""
    per_stage = (cfg.block_n + block_m) * cfg.block_k * itemsize
    return max(1, min(cfg.stages, shared_per_block // per_stage - 1))


def _stages(cfg: SkinnyConfig, block_m: int, itemsize: int, device: torch.device) -> int:
    if device.type != "cuda":
        return cfg.stages
    shared = device_spec(device.index or 0).limits.shared_per_block
    return stages_for(cfg, block_m, itemsize, shared)


def launch_configs(chip: ChipSpec) -> list[Launch]:
    """Every launch `skinny_linear` (and the shrink beside it) may pick on ``chip`` in 16-bit
    activations: `default_config`'s shapes at 1 to `MAX_ROWS` rows (the CUDA cores' at its
    widest K step, every narrower one a smaller tile), with and without split sums and the
    shrink's extra columns, over 16-bit weights and 8- and 4-bit ones; and the split sums'
    kernel."""
    shapes = {(FMA_MAX_ROWS, default_config(FMA_MAX_ROWS, n, 1 << 14)) for n in (4096, 4097)}
    for rows in range(FMA_MAX_ROWS + 1, MAX_ROWS + 1):
        block_m = max(16, 1 << (rows - 1).bit_length())
        for n in (4096, 4097):
            shapes.add((block_m, default_config(rows, n, 1 << 14)))
    out: list[Launch] = []
    for block_m, cfg in sorted(shapes, key=str):
        stages = stages_for(cfg, block_m, 2, chip.limits.shared_per_block)
        for split in (True, False) if cfg.split_k == 1 else (True,):  # sums_out: split sums
            tiles = {"BLOCK_M": block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k}
            for extra in (False, True):
                flags = {"SPLIT": split, "EXTRA": extra, "FMA": cfg.fma}
                launch = Launch("_skinny_kernel", {**tiles, **flags}, cfg.warps, stages)
                if launch not in out:
                    out.append(launch)
            for qbits, stored in ((8, "*i8"), (4, "*u8")):  # quantized: no shrink rides them
                flags = {"SPLIT": split, "EXTRA": False, "FMA": cfg.fma, "QBITS": qbits}
                types = {"w_ptr": stored}
                launch = Launch("_skinny_kernel", {**tiles, **flags}, cfg.warps, stages, types)
                if launch not in out:
                    out.append(launch)
    splits = max(c.split_k for _, c in shapes)
    out.append(Launch("_split_sum_kernel", {"SPLITS": splits, "BLOCK_M": 16, "BLOCK_N": 128}))
    return out


if triton is not None:

    @triton.jit
    def _gelu_tanh(v):
        # 0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3))), tanh via exp for fp32 precision.
        u = 0.7978845608028654 * (v + 0.044715 * v * v * v)
        t = 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)
        return 0.5 * v * (1.0 + t)

    @triton.jit
    def _epilogue(acc, ns, nmask, out_mask, ms, bias, res, out, stride_r, stride_y,
                  gelu_from, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                  HAS_GELU: tl.constexpr):  # fmt: skip
        # Pointers named without "_ptr": a helper inlined into the kernels, not launched.
        if HAS_BIAS:
            acc += tl.load(bias + ns, mask=nmask, other=0.0).to(tl.float32)[None, :]
        if HAS_GELU:
            acc = tl.where((ns >= gelu_from)[None, :], _gelu_tanh(acc), acc)
        if HAS_RES:
            # Rounded to the activation dtype first: the unfused code adds a rounded branch.
            acc = acc.to(out.dtype.element_ty).to(tl.float32)
            r = tl.load(
                res + ms.to(tl.int64)[:, None] * stride_r + ns[None, :], mask=out_mask, other=0.0
            )
            acc += r.to(tl.float32)
        tl.store(
            out + ms.to(tl.int64)[:, None] * stride_y + ns[None, :],
            acc.to(out.dtype.element_ty),
            mask=out_mask,
        )

    @triton.jit
    def _input_block(x1_rows, x2_rows, mmask, ks, kmask, K1):
        # The input row is [x1 | x2]: each K block takes its columns from either side.
        x = tl.load(x1_rows + ks[None, :], mask=mmask[:, None] & (ks < K1)[None, :], other=0.0)
        x += tl.load(
            x2_rows + ks[None, :], mask=mmask[:, None] & ((ks >= K1) & kmask)[None, :], other=0.0
        )
        return x

    @triton.jit
    def _weight_block(w_rows, s_rows, s_lo, s_hi, wmask, ks, K1, dtype: tl.constexpr,
                      QBITS: tl.constexpr, GROUP: tl.constexpr,
                      EVICT: tl.constexpr):  # fmt: skip
        # The weight rows' columns ks in ``dtype``: 16-bit as stored; 8- or 4-bit widened in
        # registers as quant_gemm widens them (q * s exact in fp32, rounded once to the
        # scale's dtype, then to the activations'). INT8's scale per row is s_lo before
        # column K1 and s_hi from it (a stack of two layers side by side); INT4's per group.
        if QBITS == 16:
            w = tl.load(w_rows + ks[None, :], mask=wmask, other=0.0, eviction_policy=EVICT)
        elif QBITS == 8:
            q = tl.load(w_rows + ks[None, :], mask=wmask, other=0, eviction_policy=EVICT)
            s = tl.where((ks < K1)[None, :], s_lo[:, None], s_hi[:, None])
            w = (q.to(tl.float32) * s.to(tl.float32)).to(s_lo.dtype).to(dtype)
        else:
            packed = tl.load(
                w_rows + (ks // 2)[None, :], mask=wmask, other=0, eviction_policy=EVICT
            ).to(tl.int32)
            # Sign-extend the column's nibble: to the top of the word, back arithmetically.
            q = (packed << (28 - 4 * (ks % 2))[None, :]) >> 28
            s = tl.load(s_rows[:, None] + (ks // GROUP)[None, :], mask=wmask, other=0.0)
            w = (q.to(tl.float32) * s.to(tl.float32)).to(s.dtype).to(dtype)
        return w

    @triton.jit
    def _accumulate(x1_rows, x2_rows, w_rows, s_rows, s_lo, s_hi, nmask, mmask, K1, k_lo,
                    k_stop, k_lim, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, QBITS: tl.constexpr,
                    GROUP: tl.constexpr):  # fmt: skip
        # One program's sum over K blocks k_lo.. (< k_stop) of [x1 | x2] times its weight rows
        # (columns past k_lim masked); pointers named without "_ptr": inlined, not launched.
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_stop, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < k_lim
            x = _input_block(x1_rows, x2_rows, mmask, ks, kmask, K1)
            w = _weight_block(w_rows, s_rows, s_lo, s_hi, nmask[:, None] & kmask[None, :], ks,
                              K1, x.dtype, QBITS, GROUP, "")  # fmt: skip
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        return acc

    @triton.jit
    def _accumulate_fma(x1_rows, x2_rows, w_rows, s_rows, s_lo, s_hi, nmask, mmask, K1, k_lo,
                        k_stop, k_lim, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, QBITS: tl.constexpr,
                        GROUP: tl.constexpr):  # fmt: skip
        # `_accumulate` on the CUDA cores: products summed per lane across K blocks, reduced
        # over K once at the end; the weight is read once, so it is not kept in cache.
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(k_lo, k_stop, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < k_lim
            x = _input_block(x1_rows, x2_rows, mmask, ks, kmask, K1)
            w = _weight_block(w_rows, s_rows, s_lo, s_hi, nmask[:, None] & kmask[None, :], ks,
                              K1, x.dtype, QBITS, GROUP, "evict_first")  # fmt: skip
            acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        return tl.sum(acc, axis=2)

    @triton.jit
    def _skinny_kernel(
        x1_ptr,
        x2_ptr,
        w_ptr,
        s_ptr,
        b_ptr,
        r_ptr,
        y_ptr,
        part_ptr,
        e_ptr,
        ext_ptr,
        M,
        N,
        K1,
        K2,
        k_per_split,
        stride_x1,
        stride_x2,
        stride_w,
        stride_s,
        stride_s1,
        stride_r,
        stride_y,
        gelu_from,
        NB,
        NE,
        RS,
        e_koff,
        ke_per_split,
        stride_es,
        stride_er,
        HAS_BIAS: tl.constexpr,
        HAS_RES: tl.constexpr,
        HAS_GELU: tl.constexpr,
        IEEE: tl.constexpr,
        SPLIT: tl.constexpr,
        EXTRA: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        FMA: tl.constexpr = False,
        PDL: tl.constexpr = False,
        QBITS: tl.constexpr = 16,
        GROUP: tl.constexpr = 128,
    ):
        # Axis 0: the weight's NB blocks of columns, then (EXTRA) NE extra columns: row j of
        # e's [slots, RS, K] (slot j // RS) times the input's columns from e_koff on, written
        # apart (fp32 split sums, no epilogue): a LoRA shrink over every slot riding the
        # product, so that x is read once and the shrink streams at the product's bandwidth.
        if PDL:  # launched early (launch_overlap.py): wait for the predecessor first
            gdc_wait()
            gdc_launch_dependents()
        pid = tl.program_id(0)
        split = tl.program_id(1)
        ms = tl.arange(0, BLOCK_M)
        mmask = ms < M
        x1_rows = x1_ptr + ms.to(tl.int64)[:, None] * stride_x1
        x2_rows = x2_ptr + ms.to(tl.int64)[:, None] * stride_x2 - K1
        k_total = K1 + K2
        ns = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = ns < N
        w_rows = w_ptr + ns.to(tl.int64)[:, None] * stride_w
        # QBITS < 16: s_ptr holds the scales (module docstring of quant_stack.py).
        s_rows = s_ptr + ns.to(tl.int64) * stride_s
        s_lo = tl.zeros((BLOCK_N,), dtype=tl.float32)
        s_hi = s_lo
        if QBITS == 8:  # the rows' scales, loaded once (stride_s1 0 where there is one)
            s_lo = tl.load(s_rows, mask=nmask, other=0.0)
            s_hi = tl.load(s_rows + stride_s1, mask=nmask, other=0.0)
        k_lo = split * k_per_split
        k_stop = k_lo + k_per_split
        k_lim = k_total
        if EXTRA:
            # One loop for both kinds of program, its operands picked per program: two
            # loops (an if per kind) spilled more registers.
            extra = pid >= NB
            js = (pid - NB) * BLOCK_N + tl.arange(0, BLOCK_N)
            e_rows = (
                e_ptr
                + (js // RS).to(tl.int64)[:, None] * stride_es
                + (js % RS).to(tl.int64)[:, None] * stride_er
                - e_koff
            )
            w_rows = tl.where(extra, e_rows, w_rows)
            nmask = tl.where(extra, js < NE, nmask)
            e_lo = e_koff + split * ke_per_split
            k_lo = tl.where(extra, e_lo, k_lo)
            k_stop = tl.where(extra, e_lo + ke_per_split, k_stop)
            k_lim = tl.where(extra, tl.minimum(e_lo + ke_per_split, k_total), k_lim)
        if FMA:
            acc = _accumulate_fma(x1_rows, x2_rows, w_rows, s_rows, s_lo, s_hi, nmask, mmask, K1,
                                  k_lo, k_stop, k_lim, BLOCK_M, BLOCK_N, BLOCK_K, QBITS,
                                  GROUP)  # fmt: skip
        else:
            acc = _accumulate(x1_rows, x2_rows, w_rows, s_rows, s_lo, s_hi, nmask, mmask, K1,
                              k_lo, k_stop, k_lim, IEEE, BLOCK_M, BLOCK_N, BLOCK_K, QBITS,
                              GROUP)  # fmt: skip
        if EXTRA and pid >= NB:
            js = (pid - NB) * BLOCK_N + tl.arange(0, BLOCK_N)
            offs = (split * M + ms.to(tl.int64))[:, None] * NE + js[None, :]
            tl.store(ext_ptr + offs, acc, mask=mmask[:, None] & (js < NE)[None, :])
        else:
            out_mask = mmask[:, None] & nmask[None, :]
            if SPLIT:
                offs = (split * M + ms.to(tl.int64))[:, None] * N + ns[None, :]
                tl.store(part_ptr + offs, acc, mask=out_mask)
            else:
                _epilogue(acc, ns, nmask, out_mask, ms, b_ptr, r_ptr, y_ptr, stride_r, stride_y,
                          gelu_from, HAS_BIAS, HAS_RES, HAS_GELU)  # fmt: skip

    @triton.jit
    def _split_sum_kernel(
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
        PDL: tl.constexpr = False,
    ):
        # The slices of K summed in split order: deterministic, unlike atomics.
        if PDL:  # launched early (launch_overlap.py): wait for the predecessor first
            gdc_wait()
            gdc_launch_dependents()
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
    weight: torch.Tensor | QuantWeight,
    bias: torch.Tensor | None = None,
    *,
    x2: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    gelu_from: int | None = None,
    config: SkinnyConfig | None = None,
    partials: bool = False,
    sums_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[x1 | x2] @ weight^T + bias``, GELU on columns >= ``gelu_from``, plus ``residual``.

    x1 [..., K1] (x2 [..., K2]: the weight's remaining input columns); weight [N, K1 + K2]
    with unit column stride, or held in 8 or 4 bits (a `QuantWeight`, widened in registers;
    INT8 with two scale columns split where x2 starts); returns [..., N] in x1's dtype.
    ``partials``: where the launch shape splits K, return the split sums [splits, rows, N]
    (fp32, the bias not added) for a consumer that finishes them itself; elsewhere the
    finished product, as without it.
    ``sums_out`` (fp32 [`split_count`, rows, N], contiguous): the split sums go there, even
    where the launch shape does not split K (one split), and it is returned.
    """
    y, _ = _launch(x1, weight, bias, x2, residual, gelu_from, config, partials, None, sums_out)
    return y


def layer_product(
    layer: torch.nn.Module, x: torch.Tensor, *, gelu: bool = False
) -> torch.Tensor | None:
    """``layer(x)`` (``gelu``: the tanh GELU of it, in the epilogue) through `skinny_linear`
    where that runs: a 16-bit ``nn.Linear`` of the activations' dtype and few rows on CUDA.
    None elsewhere: the caller runs the layer itself."""
    if type(layer) is not torch.nn.Linear or not supported(x) or layer.weight.dtype != x.dtype:
        return None
    return skinny_linear(x, layer.weight, layer.bias, gelu_from=0 if gelu else None)


def split_count(
    rows: int,
    weight: torch.Tensor | QuantWeight,
    config: SkinnyConfig | None = None,
    itemsize: int | None = None,
) -> int:
    """How many split sums `skinny_linear` writes for ``rows`` rows times ``weight``, in
    activations of ``itemsize`` bytes (default: a 16-bit weight's own; 2 for a quantized
    one)."""
    n, k = weight.shape
    if itemsize is None:
        itemsize = 2 if isinstance(weight, QuantWeight) else weight.element_size()
    return max(1, (config or default_config(rows, n, k, itemsize)).split_k)


def skinny_linear_shrink(
    x1: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    a: torch.Tensor,
    *,
    x2: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
    partials: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`skinny_linear` (no residual, no GELU) and, in the same launch, the input's last K_a
    columns times every row of ``a`` [slots, R, K_a] (any slot and row strides, unit column
    stride): (the product as `skinny_linear` returns it, the shrink's split sums [splits,
    rows, slots * R] fp32, slot s's in columns s R .. s R + R).

    The base columns are computed exactly as `skinny_linear` computes them (same launch
    shape, same sums): a row that reads no shrink column gets the product bit for bit.
    """
    return _launch(x1, weight, bias, x2, None, None, config, partials, a, None)


def _weight_args(
    weight: torch.Tensor | QuantWeight, k1: int, k2: int, two_inputs: bool
) -> tuple[torch.Tensor, torch.Tensor, int, tuple[int, int]]:
    """(stored weight, scales, QBITS, the scales' row and column strides) of a weight that
    takes inputs of k1 + k2 columns; a clear error where it does not."""
    if weight.shape[1] != k1 + k2:
        raise ValueError(f"weight {tuple(weight.shape)} does not take inputs of {k1} + {k2}")
    if not isinstance(weight, QuantWeight):
        if weight.stride(1) != 1:
            raise ValueError(f"weight {tuple(weight.shape)} needs unit column stride")
        return weight, weight, 16, (0, 0)
    q, scale = weight.qweight, weight.scale
    if weight.bits == 4:
        return q, scale, 4, (scale.stride(0), 1)
    if scale.dim() == 1:
        return q, scale, 8, (scale.stride(0), 0)
    if not two_inputs or weight.boundary != k1:
        raise ValueError(f"INT8 weight split at {weight.boundary} takes inputs of that + the rest")
    return q, scale, 8, (scale.stride(0), scale.stride(1))


def _launch(
    x1: torch.Tensor,
    weight: torch.Tensor | QuantWeight,
    bias: torch.Tensor | None,
    x2: torch.Tensor | None,
    residual: torch.Tensor | None,
    gelu_from: int | None,
    config: SkinnyConfig | None,
    partials: bool,
    a: torch.Tensor | None,
    sums_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    lead = x1.shape[:-1]
    k1 = x1.shape[-1]
    x = x1.reshape(-1, k1)
    if x.stride(-1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    k2 = 0
    b2 = x
    if x2 is not None:
        k2 = x2.shape[-1]
        b2 = x2.reshape(-1, k2)
        if b2.stride(-1) != 1:
            b2 = b2.contiguous()
    n = weight.shape[0]
    w, scale, qbits, s_strides = _weight_args(weight, k1, k2, x2 is not None)
    # The launch shape is the product's alone: extra columns must not change its sums.
    cfg = config or default_config(m, n, k1 + k2, x.element_size())
    # Tensor-core tiles take 16 rows at least; the CUDA cores take the rows as they are.
    block_m = triton.next_power_of_2(m) if cfg.fma else max(16, triton.next_power_of_2(m))
    split = max(1, cfg.split_k)
    # Each split's slice of K is a whole number of K blocks.
    k_per_split = triton.cdiv(triton.cdiv(k1 + k2, split), cfg.block_k) * cfg.block_k
    if sums_out is None:
        y = torch.empty(m, n, device=x.device, dtype=x.dtype)
        part = torch.empty(split, m, n, device=x.device, dtype=torch.float32) if split > 1 else y
    else:
        if sums_out.shape != (split, m, n) or sums_out.dtype != torch.float32:
            raise ValueError(f"sums_out must be fp32 {(split, m, n)}, not {tuple(sums_out.shape)}")
        if not sums_out.is_contiguous():
            raise ValueError("sums_out must be contiguous")
        if bias is not None or residual is not None or gelu_from is not None or a is not None:
            raise ValueError("split sums carry no epilogue: their consumer adds the bias")
        part = sums_out
        y = sums_out[0]  # not written: split sums take no epilogue
    res = residual.reshape(-1, n) if residual is not None else y
    flags = {
        "HAS_BIAS": bias is not None,
        "HAS_RES": residual is not None,
        "HAS_GELU": gelu_from is not None,
    }
    gelu = gelu_from if gelu_from is not None else n
    b = bias if bias is not None else w
    nb = triton.cdiv(n, cfg.block_n)
    e, ext, ne, rs, e_koff, ke_per_split, e_blocks = w, part, 0, 1, 0, 0, 0
    if a is not None:
        slots, rs, k_a = a.shape
        if qbits != 16:
            raise ValueError("a shrink rides 16-bit weights only, not a quantized weight")
        if a.stride(2) != 1 or a.dtype != w.dtype or not 0 < k_a <= k1 + k2:
            raise ValueError(f"shrink weights {tuple(a.shape)} do not fit inputs of {k1} + {k2}")
        e, ne, e_koff = a, slots * rs, k1 + k2 - k_a
        ke_per_split = triton.cdiv(triton.cdiv(k_a, split), cfg.block_k) * cfg.block_k
        ext = torch.empty(split, m, ne, device=x.device, dtype=torch.float32)
        e_blocks = triton.cdiv(ne, cfg.block_n)
    _skinny_kernel[(nb + e_blocks, split)](
        x, b2, w, scale, b, res, y, part, e, ext, m, n, k1, k2, k_per_split,
        x.stride(0), b2.stride(0), w.stride(0), *s_strides, res.stride(0), y.stride(0), gelu,
        nb, ne, rs, e_koff, ke_per_split, e.stride(0), e.stride(1) if a is not None else 0,
        IEEE=x.dtype == torch.float32, SPLIT=split > 1 or sums_out is not None,
        EXTRA=a is not None, BLOCK_M=block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, FMA=cfg.fma, QBITS=qbits, GROUP=GROUP_SIZE,
        num_warps=cfg.warps,
        num_stages=_stages(cfg, block_m, x.element_size(), x.device), **flags,
        **launch_overlap.kernel_args(),
    )  # fmt: skip
    shrunk = ext if a is not None else None
    if sums_out is not None:
        return sums_out, shrunk
    if split > 1 and partials:
        if residual is not None or gelu_from is not None:
            raise ValueError("split sums carry no epilogue but the bias, added by their consumer")
        return part, shrunk
    if partials:  # the finished product, as rows: a consumer tells it from split sums by dim
        return y, shrunk
    if split > 1:
        _split_sum_kernel[(triton.cdiv(n, 128), triton.cdiv(m, 16))](
            part, b, res, y, m, n, res.stride(0), y.stride(0), gelu,
            SPLITS=split, BLOCK_M=16, BLOCK_N=128, **flags, **launch_overlap.kernel_args(),
        )  # fmt: skip
    return y.view(*lead, n), shrunk
