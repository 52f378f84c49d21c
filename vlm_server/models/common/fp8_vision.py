"""The vision tower with FP8 (e4m3) matrix products: an opt-in, faster and less exact tower.

Three of each block's four linears (QKV, fc1, fc2: 90% of the tower's GEMM work) run as FP8
GEMMs with bf16 output. Weights are quantized once, one scale per output channel; activations
one scale per row, computed by the kernel that writes the row anyway: the fused add +
LayerNorm in front of QKV and fc1, and a GELU kernel between fc1 and fc2 (which replaces
the GELU epilogue of the bf16 path). fc2's inner width is padded to a multiple of 128 with
zero weights and zero activations (the same sums, a faster GEMM). The attention projection
stays bf16: quantizing its input costs as much as the FP8 GEMM saves.

fc1's and fc2's products run with per-tensor scales of one, which cuBLAS runs faster than
per-row scales; the kernel that reads each product next (the GELU quantizer, the next add +
LayerNorm) applies the row and column scales and the bias on the way in (`Unscaled`).

Everything the bf16 tower keeps in bf16 (residual stream, attention, norms' statistics) is
unchanged; the loss is e4m3's 3-bit mantissa on the GEMM inputs (see the GPU test for the
measured deviation from the bf16 tower). On CUDA the quantizers are Triton kernels; elsewhere
plain PyTorch computes the same function, which is what the CPU tests check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from vlm_server.models.common.fused_norm import add_layernorm
from vlm_server.models.common.layers import LN_EPS, LayerNorm

if TYPE_CHECKING:
    from vlm_server.models.common.vision import VisionEncoder

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path needs no Triton
    triton = None
    tl = None

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
_MIN_SCALE = 1e-12  # an all-zero row still gets a finite scale


@dataclass(frozen=True)
class Fp8Weight:
    """A linear layer's weight in e4m3 ([out, in_padded], row-major: the GEMM's column-major
    second operand once transposed), its per-output-channel scale [1, out] and its bias."""

    weight: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor
    one: torch.Tensor  # the per-tensor scale of `unscaled`'s products

    @classmethod
    def quantize(cls, linear: torch.nn.Linear, in_padded: int | None = None) -> Fp8Weight:
        """Quantize ``linear`` (its weight padded with zero columns to ``in_padded``)."""
        w = linear.weight.detach().float()
        if in_padded is not None and in_padded > w.shape[1]:
            w = F.pad(w, (0, in_padded - w.shape[1]))
        scale = w.abs().amax(dim=1).clamp_min(_MIN_SCALE) / FP8_MAX
        q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).contiguous()
        bias = linear.bias.detach().to(torch.bfloat16).clone()
        return cls(q, scale[None, :].contiguous(), bias, torch.ones((), device=w.device))

    def __call__(
        self, q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """``dequant(q) @ dequant(weight).T + bias`` for rows ``q`` [M, in_padded] (e4m3) with
        per-row scales ``scale`` [M, 1]; computed in bf16, the one output row-wise scaled FP8
        GEMMs support, and cast to ``out_dtype``."""
        if not q.is_cuda:  # row-wise scaled FP8 GEMMs are CUDA-only in some torch builds
            w = self.weight.float() * self.scale.t()
            out = torch.addmm(self.bias.float(), q.float() * scale, w.t()).to(torch.bfloat16)
            return out if out_dtype == torch.bfloat16 else out.to(out_dtype)
        out = torch._scaled_mm(
            q,
            self.weight.t(),
            scale,
            self.scale,
            bias=self.bias,
            out_dtype=torch.bfloat16,
            use_fast_accum=True,
        )
        return out if out_dtype == torch.bfloat16 else out.to(out_dtype)

    def unscaled(self, q: torch.Tensor, scale: torch.Tensor) -> Unscaled:
        """``q @ weight.T`` in bf16 before any scale or bias, for a consumer that applies
        them; ``scale`` [M, 1] is ``q``'s row scales."""
        if not q.is_cuda:
            raw = (q.float() @ self.weight.float().t()).to(torch.bfloat16)
        else:
            raw = torch._scaled_mm(
                q,
                self.weight.t(),
                self.one,
                self.one,
                out_dtype=torch.bfloat16,
                use_fast_accum=True,
            )
        return Unscaled(raw, scale, self.scale, self.bias)


@dataclass(frozen=True)
class Unscaled:
    """An FP8 product whose consumer applies its scales and bias: its value is
    ``raw * row * col + bias`` in fp32. On an H100 at 9 crops cuBLAS takes 56.3 us for fc1
    with scales of one against 64.5 with row and column scales and the bias."""

    raw: torch.Tensor  # [M, N] bf16
    row: torch.Tensor  # [M, 1] fp32
    col: torch.Tensor  # [1, N] fp32
    bias: torch.Tensor  # [N] bf16

    def value(self) -> torch.Tensor:
        """The product as fp32, computed in the order the kernels compute it."""
        return self.raw.float() * self.row * self.col + self.bias.float()


def quantize_rows(y: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``y`` to e4m3 with one scale per row (zero-padded to ``width`` columns)."""
    y = y.float()
    amax = y.abs().amax(dim=-1, keepdim=True).clamp_min(FP8_MAX * _MIN_SCALE)
    q = (y * (FP8_MAX / amax)).clamp(-FP8_MAX, FP8_MAX)
    scale = amax / FP8_MAX
    if width is not None and width > q.shape[-1]:
        q = F.pad(q, (0, width - q.shape[-1]))
    return q.to(FP8), scale


if triton is not None:
    # The standard library's combine functions, not tl.sum and tl.max: the CPU tests'
    # interpreted copy cannot call those (jitted where Triton was first imported).
    _SUM = tl.standard._sum_combine
    _MAX = tl.standard._elementwise_max

    @triton.jit
    def _columns(col_scales, biases, cols, mask, SCALED: tl.constexpr = True):
        """An `Unscaled` product's column scales and biases at ``cols`` in fp32 (zeros unless
        SCALED)."""
        if SCALED:
            c = tl.load(col_scales + cols, mask=mask, other=0.0)
            b = tl.load(biases + cols, mask=mask, other=0.0).to(tl.float32)
        else:
            c = cols.to(tl.float32) * 0.0
            b = c
        return c, b

    @triton.jit
    def _load_row(src, cols, mask, rs, c, b, SCALED: tl.constexpr):
        """Columns ``cols`` of a row in fp32 (0 off ``mask``); of an `Unscaled` product when
        SCALED: raw * row scale ``rs`` * column scales ``c`` + biases ``b``."""
        v = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
        if SCALED:
            v = v * rs * c + b
        return v

    @triton.jit
    def _gelu(u):
        # GELU, tanh approximation: 0.5 (1 + tanh(z)) = sigmoid(2 z), with one fast division
        # (the IEEE one costs more than the memory traffic here); e^(-2z) = inf gives 0
        z = 0.7978845608028654 * (u + 0.044715 * u * u * u)
        return tl.fdiv(u, 1.0 + tl.exp(-2.0 * z), ieee_rounding=False)

    @triton.jit
    def _to_e4m3(y, top):
        return tl.minimum(tl.maximum(y * (448.0 / top), -448.0), 448.0).to(tl.float8e4nv)

    @triton.jit
    def _add_layernorm_fp8_kernel(
        x_ptr, a_ptr, w_ptr, bias_ptr, sum_ptr, q_ptr, scale_ptr, row_ptr, col_ptr, a_bias_ptr,
        dim, eps, HAS_A: tl.constexpr, BLOCK: tl.constexpr, SCALED: tl.constexpr = False,
    ):  # fmt: skip
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < dim
        offs = row.to(tl.int64) * dim + cols
        s = tl.load(x_ptr + offs, mask=mask, other=0.0)
        if HAS_A:
            if SCALED:  # ``a`` is an `Unscaled` product
                c, b = _columns(col_ptr, a_bias_ptr, cols, mask)
                rs = tl.load(row_ptr + row)
                a = _load_row(a_ptr + row.to(tl.int64) * dim, cols, mask, rs, c, b, True)
                s = (s.to(tl.float32) + a).to(s.dtype)
            else:
                s = s + tl.load(a_ptr + offs, mask=mask, other=0.0)
            tl.store(sum_ptr + offs, s, mask=mask)
        v = s.to(tl.float32)
        mean = tl.reduce(v, 0, _SUM) / dim
        centred = tl.where(mask, v - mean, 0.0)
        var = tl.reduce(centred * centred, 0, _SUM) / dim
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        nb = tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.where(mask, centred * tl.rsqrt(var + eps) * w + nb, 0.0)
        amax = tl.maximum(tl.reduce(tl.abs(y), 0, _MAX), 448e-12)
        tl.store(q_ptr + offs, _to_e4m3(y, amax), mask=mask)
        tl.store(scale_ptr + row, amax / 448.0)

    @triton.jit
    def _gelu_fp8_kernel(
        u_ptr, q_ptr, scale_ptr, row_ptr, col_ptr, bias_ptr, width, width_out,
        BLOCK: tl.constexpr, TAIL: tl.constexpr = 0, SCALED: tl.constexpr = False,
    ):  # fmt: skip
        # The row as a BLOCK-wide piece and, when TAIL > 0, a TAIL-wide one, both in
        # registers: lanes past the row would compute GELU too (two special-function ops
        # each), up to twice the row's width with one power-of-two block. Columns from
        # ``width`` to ``width_out`` get 0 (u = 0 there): fc2's zero-padded inner width.
        row = tl.program_id(0)
        src = u_ptr + row.to(tl.int64) * width
        dst = q_ptr + row.to(tl.int64) * width_out
        rs = 0.0
        if SCALED:
            rs = tl.load(row_ptr + row)
        cols = tl.arange(0, BLOCK)
        mask = cols < width
        c, b = _columns(col_ptr, bias_ptr, cols, mask, SCALED)
        g = _gelu(_load_row(src, cols, mask, rs, c, b, SCALED))
        top = tl.reduce(tl.abs(g), 0, _MAX)
        if TAIL > 0:
            tail = BLOCK + tl.arange(0, TAIL)
            tmask = tail < width
            ct, bt = _columns(col_ptr, bias_ptr, tail, tmask, SCALED)
            gt = _gelu(_load_row(src, tail, tmask, rs, ct, bt, SCALED))
            top = tl.maximum(top, tl.reduce(tl.abs(gt), 0, _MAX))
        top = tl.maximum(top, 448e-12)
        tl.store(dst + cols, _to_e4m3(g, top), mask=cols < width_out)
        if TAIL > 0:
            tl.store(dst + tail, _to_e4m3(gt, top), mask=tail < width_out)
        tl.store(scale_ptr + row, top / 448.0)


def _on_triton(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


# The quantizers' launches: the add + LayerNorm's warps; the GELU's (the row as a power-of-two
# block and a tail, warps). On an H100 at 9 crops: the norm 21.9 us with 4 warps against 23.2
# with 8; the GELU 36.4 us as a block of 4096 and a tail of 256 against 49.1 as one block.
NORM_WARPS = 4
GELU_LAUNCH = (True, 8)


def layernorm_fp8(
    x: torch.Tensor,
    a: torch.Tensor | Unscaled | None,
    norm: LayerNorm,
    warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``s = x (+ a)`` and ``norm(s)`` in e4m3 rows: returns (s, rows, row scales [M, 1]).
    ``x`` and ``a`` are [M, dim]; with ``a`` None, ``s`` is ``x`` itself. ``warps``
    overrides `NORM_WARPS`."""
    if not _on_triton(x):
        if isinstance(a, Unscaled):
            s = (x.float() + a.value()).to(x.dtype)
        else:
            s = x if a is None else x + a
        y = F.layer_norm(s.float(), (s.shape[-1],), norm.weight.float(), norm.bias.float(), LN_EPS)
        q, scale = quantize_rows(y)
        return s, q, scale
    rows, dim = x.shape
    s = x if a is None else torch.empty_like(x)
    q = torch.empty((rows, dim), dtype=FP8, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    scaled = isinstance(a, Unscaled)
    # unscaled: the scales' and bias' places are taken by tensors the kernel never reads
    raw, row, col, bias = (a.raw, a.row, a.col, a.bias) if scaled else (a, scale, scale, scale)
    _add_layernorm_fp8_kernel[(rows,)](
        x, x if a is None else raw, norm.weight, norm.bias, s, q, scale, row, col, bias, dim,
        LN_EPS, HAS_A=a is not None, BLOCK=triton.next_power_of_2(dim), SCALED=scaled,
        num_warps=warps or NORM_WARPS,
    )  # fmt: skip
    return s, q, scale


def gelu_fp8(
    u: torch.Tensor | Unscaled, width_out: int, launch: tuple[bool, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gelu_tanh(u)`` in e4m3 rows zero-padded to ``width_out`` columns, and the row scales.
    ``launch`` overrides `GELU_LAUNCH`."""
    scaled = isinstance(u, Unscaled)
    raw = u.raw if scaled else u
    rows, width = raw.shape
    if not _on_triton(raw):
        v = u.value() if scaled else u.float()
        return quantize_rows(F.gelu(v, approximate="tanh"), width_out)
    q = torch.empty((rows, width_out), dtype=FP8, device=raw.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=raw.device)
    row, col, bias = (u.row, u.col, u.bias) if scaled else (scale, scale, scale)
    split, warps = launch or GELU_LAUNCH
    block, tail = triton.next_power_of_2(width_out), 0
    if split and block > width_out:
        block //= 2
        tail = triton.next_power_of_2(width_out - block)
    _gelu_fp8_kernel[(rows,)](
        raw, q, scale, row, col, bias, width, width_out,
        BLOCK=block, TAIL=tail, SCALED=scaled, num_warps=warps,
    )  # fmt: skip
    return q, scale


# fc1's and fc2's products as `Unscaled` ones, their scales applied by the next kernel; False:
# cuBLAS applies them (the tower probe's "before").
DEFER_SCALES = True


@dataclass(frozen=True)
class Fp8Block:
    qkv: Fp8Weight
    fc1: Fp8Weight
    fc2: Fp8Weight


class Fp8Tower:
    """The quantized weights of one vision encoder, and its forward with FP8 GEMMs."""

    def __init__(self, encoder: VisionEncoder) -> None:
        inner = encoder.cfg.enc_ff_dim
        self.inner_padded = -(-inner // 128) * 128
        self.blocks = [
            Fp8Block(
                Fp8Weight.quantize(b.attn.qkv),
                Fp8Weight.quantize(b.mlp.fc1),
                Fp8Weight.quantize(b.mlp.fc2, self.inner_padded),
            )
            for b in encoder.blocks
        ]

    def encode(self, encoder: VisionEncoder, crops: torch.Tensor) -> torch.Tensor:
        """``encoder.encode(crops)``, its QKV / fc1 / fc2 products in FP8."""
        x = encoder.patch_emb(encoder.patchify(crops)) + encoder.pos_emb
        n, t, d = x.shape
        dt = x.dtype
        x = x.reshape(n * t, d)
        blocks = encoder.blocks
        x, q, scale = layernorm_fp8(x, None, blocks[0].ln1)
        h = x
        for i, (block, w) in enumerate(zip(blocks, self.blocks, strict=True)):
            attn = block.attn
            qkv = w.qkv(q, scale, dt)
            qkv = qkv.view(n, t, 3, attn.n_heads, d // attn.n_heads)
            qh, kh, vh = (qkv[:, :, j].transpose(1, 2) for j in range(3))
            o = F.scaled_dot_product_attention(qh, kh, vh).transpose(1, 2).reshape(n * t, d)
            x, q, scale = layernorm_fp8(x, attn.proj(o), block.ln2)
            if DEFER_SCALES:
                g, g_scale = gelu_fp8(w.fc1.unscaled(q, scale), self.inner_padded)
            else:
                g, g_scale = gelu_fp8(w.fc1(q, scale, dt), self.inner_padded)
            if i + 1 < len(blocks):
                y = w.fc2.unscaled(g, g_scale) if DEFER_SCALES else w.fc2(g, g_scale, dt)
                x, q, scale = layernorm_fp8(x, y, blocks[i + 1].ln1)
            else:  # the last block's sum goes to a 16-bit LayerNorm
                x, h = add_layernorm(x, w.fc2(g, g_scale, dt), None, encoder.post_ln)
        return h.view(n, t, d)
