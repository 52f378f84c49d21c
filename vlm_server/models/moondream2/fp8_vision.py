"""The vision tower with FP8 (e4m3) matrix products: an opt-in, faster and less exact tower.

Three of each block's four linears (QKV, fc1, fc2: 90% of the tower's GEMM work) run as FP8
GEMMs with bf16 output. Weights are quantized once, one scale per output channel; activations
one scale per row, computed by the kernel that writes the row anyway: the fused add +
LayerNorm in front of QKV and fc1, and a GELU kernel between fc1 and fc2 (which replaces
the GELU epilogue of the bf16 path). fc2's inner width is padded to a multiple of 128 with
zero weights and zero activations (the same sums, a faster GEMM). The attention projection
stays bf16: quantizing its input costs as much as the FP8 GEMM saves.

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

from vlm_server.models.common import tower_attention
from vlm_server.models.common.fused_norm import add_layernorm
from vlm_server.models.common.layers import LN_EPS, LayerNorm

if TYPE_CHECKING:
    from vlm_server.models.moondream2.vision import VisionEncoder

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

    @classmethod
    def quantize(cls, linear: torch.nn.Linear, in_padded: int | None = None) -> Fp8Weight:
        """Quantize ``linear`` (its weight padded with zero columns to ``in_padded``)."""
        w = linear.weight.detach().float()
        if in_padded is not None and in_padded > w.shape[1]:
            w = F.pad(w, (0, in_padded - w.shape[1]))
        scale = w.abs().amax(dim=1).clamp_min(_MIN_SCALE) / FP8_MAX
        q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).contiguous()
        bias = linear.bias.detach().to(torch.bfloat16).clone()
        return cls(q, scale[None, :].contiguous(), bias)

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

    @triton.jit
    def _add_layernorm_fp8_kernel(
        x_ptr,
        a_ptr,
        w_ptr,
        bias_ptr,
        sum_ptr,
        q_ptr,
        scale_ptr,
        dim,
        eps,
        HAS_A: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < dim
        offs = row.to(tl.int64) * dim + cols
        s = tl.load(x_ptr + offs, mask=mask, other=0.0)
        if HAS_A:
            s = s + tl.load(a_ptr + offs, mask=mask, other=0.0)
            tl.store(sum_ptr + offs, s, mask=mask)
        v = s.to(tl.float32)
        mean = tl.sum(v, axis=0) / dim
        centred = tl.where(mask, v - mean, 0.0)
        var = tl.sum(centred * centred, axis=0) / dim
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.where(mask, centred * tl.rsqrt(var + eps) * w + b, 0.0)
        amax = tl.maximum(tl.max(tl.abs(y), axis=0), 448e-12)
        q = tl.minimum(tl.maximum(y * (448.0 / amax), -448.0), 448.0)
        tl.store(q_ptr + offs, q.to(tl.float8e4nv), mask=mask)
        tl.store(scale_ptr + row, amax / 448.0)

    @triton.jit
    def _gelu(u):
        # GELU, tanh approximation: 0.5 (1 + tanh(z)) = sigmoid(2 z), with one fast division
        # (the IEEE one costs more than the memory traffic here); e^(-2z) = inf gives 0
        z = 0.7978845608028654 * (u + 0.044715 * u * u * u)
        return tl.fdiv(u, 1.0 + tl.exp(-2.0 * z), ieee_rounding=False)

    @triton.jit
    def _gelu_fp8_kernel(
        u_ptr, q_ptr, scale_ptr, width, width_out, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
        TAIL: tl.constexpr = 0,
    ):  # fmt: skip
        row = tl.program_id(0)
        src = u_ptr + row.to(tl.int64) * width
        dst = q_ptr + row.to(tl.int64) * width_out
        if TAIL > 0:  # the row as a BLOCK-wide and a TAIL-wide piece, both in registers
            # Lanes past the row would compute GELU too (two special-function ops each: the
            # bound of a power-of-two block twice the row's width).
            cols = tl.arange(0, BLOCK)
            tail = BLOCK + tl.arange(0, TAIL)
            g = _gelu(tl.load(src + cols, mask=cols < width, other=0.0).to(tl.float32))
            gt = _gelu(tl.load(src + tail, mask=tail < width, other=0.0).to(tl.float32))
            top = tl.maximum(tl.max(tl.abs(g), axis=0), tl.max(tl.abs(gt), axis=0))
            top = tl.maximum(top, 448e-12)
            q = tl.minimum(tl.maximum(g * (448.0 / top), -448.0), 448.0)
            tl.store(dst + cols, q.to(tl.float8e4nv), mask=cols < width_out)
            q = tl.minimum(tl.maximum(gt * (448.0 / top), -448.0), 448.0)
            tl.store(dst + tail, q.to(tl.float8e4nv), mask=tail < width_out)
        elif CHUNK >= BLOCK:  # the whole row in registers: one read, GELU computed once
            cols = tl.arange(0, BLOCK)
            g = _gelu(tl.load(src + cols, mask=cols < width, other=0.0).to(tl.float32))
            top = tl.maximum(tl.max(tl.abs(g), axis=0), 448e-12)
            q = tl.minimum(tl.maximum(g * (448.0 / top), -448.0), 448.0)
            # columns past ``width`` hold 0 (u = 0 there): fc2's zero-padded inner width
            tl.store(dst + cols, q.to(tl.float8e4nv), mask=cols < width_out)
        else:  # two passes over CHUNK-wide pieces, the second reading the row back from cache
            cols = tl.arange(0, CHUNK)
            amax = tl.zeros((CHUNK,), tl.float32)
            for start in range(0, width, CHUNK):
                u = tl.load(src + start + cols, mask=start + cols < width, other=0.0)
                amax = tl.maximum(amax, tl.abs(_gelu(u.to(tl.float32))))
            top = tl.maximum(tl.max(amax, axis=0), 448e-12)
            for start in range(0, width_out, CHUNK):
                u = tl.load(src + start + cols, mask=start + cols < width, other=0.0)
                q = tl.minimum(tl.maximum(_gelu(u.to(tl.float32)) * (448.0 / top), -448.0), 448.0)
                tl.store(dst + start + cols, q.to(tl.float8e4nv), mask=start + cols < width_out)
        tl.store(scale_ptr + row, top / 448.0)


def _on_triton(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


def layernorm_fp8(
    x: torch.Tensor, a: torch.Tensor | None, norm: LayerNorm
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``s = x (+ a)`` and ``norm(s)`` in e4m3 rows: returns (s, rows, row scales [M, 1]).
    ``x`` and ``a`` are [M, dim]; with ``a`` None, ``s`` is ``x`` itself."""
    if not _on_triton(x):
        s = x if a is None else x + a
        y = F.layer_norm(s.float(), (s.shape[-1],), norm.weight.float(), norm.bias.float(), LN_EPS)
        q, scale = quantize_rows(y)
        return s, q, scale
    rows, dim = x.shape
    s = x if a is None else torch.empty_like(x)
    q = torch.empty((rows, dim), dtype=FP8, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    _add_layernorm_fp8_kernel[(rows,)](
        x,
        x if a is None else a,
        norm.weight,
        norm.bias,
        s,
        q,
        scale,
        dim,
        LN_EPS,
        HAS_A=a is not None,
        BLOCK=triton.next_power_of_2(dim),
    )
    return s, q, scale


# The GELU quantizer's launch: (chunk width, warps). Chunk 0: the row as a power-of-two block
# and a tail, read once; a chunk as wide as the row's power-of-two block: read once, lanes to
# that bound; narrower: two passes. On an H100 at [6561, 4304] (bench/tower_probe.py, one
# run): block and tail 37.4 us with 8 warps (43.0 with 16), the 8192-lane block 48.8, a chunk
# of 1024 56.0.
GELU_LAUNCH = (0, 8)


def gelu_fp8(
    u: torch.Tensor, width_out: int, launch: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gelu_tanh(u)`` in e4m3 rows zero-padded to ``width_out`` columns, and the row scales."""
    rows, width = u.shape
    if not _on_triton(u):
        return quantize_rows(F.gelu(u.float(), approximate="tanh"), width_out)
    q = torch.empty((rows, width_out), dtype=FP8, device=u.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=u.device)
    chunk, warps = launch or GELU_LAUNCH
    block = triton.next_power_of_2(width_out)
    tail = 0
    if chunk == 0 and block > width_out:
        block //= 2
        tail = triton.next_power_of_2(width_out - block)
    chunk = block if chunk == 0 else min(chunk, block)
    _gelu_fp8_kernel[(rows,)](
        u, q, scale, width, width_out, BLOCK=block, CHUNK=chunk, TAIL=tail, num_warps=warps
    )
    return q, scale


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
            if attn.split_head:
                o = tower_attention.attention(qkv.view(n, t, 3 * d), attn.n_heads).view(n * t, d)
            else:
                qkv = qkv.view(n, t, 3, attn.n_heads, d // attn.n_heads)
                qh, kh, vh = (qkv[:, :, j].transpose(1, 2) for j in range(3))
                o = F.scaled_dot_product_attention(qh, kh, vh).transpose(1, 2).reshape(n * t, d)
            x, q, scale = layernorm_fp8(x, attn.proj(o), block.ln2)
            g, g_scale = gelu_fp8(w.fc1(q, scale, dt), self.inner_padded)
            y = w.fc2(g, g_scale, dt)
            if i + 1 < len(blocks):
                x, q, scale = layernorm_fp8(x, y, blocks[i + 1].ln1)
            else:
                x, h = add_layernorm(x, y, None, encoder.post_ln)
        return h.view(n, t, d)
