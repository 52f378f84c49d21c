"""The mixture-of-experts MLP (plain PyTorch): router, top-k selection, experts, combine.

Router: a linear layer with bias over the normed hidden state; each token takes the ``top_k``
experts of the highest raw logits and weights them by a softmax over those ``top_k`` logits
only (fp32, then the activation dtype): no softmax over all experts, no renormalisation, no
shared expert, no capacity limit. Expert e (no biases): ``z = W1[e] x``; with ``a, b`` its
first and second halves, ``y = W2[e] (gelu_erf(a) * (b + 1))``. The output is the weighted
sum of the chosen experts' outputs, in selection order.

Three ways to run the experts, equal up to rounding: ``fused`` (CUDA with Triton,
moe_triton.py) routes and groups the step's (token, expert) pairs by expert in Triton
(moe_routing.py), runs grouped matmuls with the activation fused in and combines in one
kernel; ``loop`` gathers each expert's tokens and runs exactly the products needed (it reads
expert loads on the host: the CPU's way); ``dense`` runs every expert on every token and keeps
the chosen results (fixed shapes, no host read: the CUDA fallback without Triton). Expert
weights may be held in FP8 with per-row scales (`ExpertBank.set_fp8`), or in INT8 / INT4 with
bf16 scales (`ExpertBank.hold_quantized`, docs/quantization.md): the fused kernels read them
as they are, the other paths dequantize first.

With a finetune adapter (an `ExpertDelta`, models/lora/spec.py) each (token, chosen expert)
pair gets its expert's low-rank deltas: fc1's added before the activation, fc2's to the
expert's output, before the routing weight. Each path has its form: the fused kernels add them
in their epilogues, ``loop`` and ``dense`` in PyTorch (``dense`` with fixed shapes still).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from vlm_server.models.common import skinny_gemm
from vlm_server.models.moondream3 import fp8_experts, moe_routing, moe_triton
from vlm_server.models.moondream3.config import MoeConfig
from vlm_server.models.moondream3.moe_triton import ExpertDelta
from vlm_server.models.quant.formats import SCALE_DTYPE, QuantFormat

ExpertMethod = Literal["fused", "loop", "dense"]


class ExpertBank(nn.Module):
    """Stacked expert matrices ``weight`` [E, out, in] (rows = output features); in FP8 with
    ``scale`` [E, out] (fp32, per expert and row) after `set_fp8`; or, after
    `hold_quantized`, no ``weight`` but INT8 / INT4 ``qweight`` and bf16 ``scale`` (state
    names ``<bank>.qweight`` and ``<bank>.scale``, as a quantized checkpoint's tensors load)."""

    scale: torch.Tensor | None
    quant: QuantFormat | None

    def __init__(self, n_experts: int, out_dim: int, in_dim: int) -> None:
        super().__init__()
        self.shape = (n_experts, out_dim, in_dim)
        self.weight = nn.Parameter(torch.zeros(n_experts, out_dim, in_dim))
        self.register_buffer("scale", None, persistent=False)
        self.quant = None

    @property
    def format(self) -> str:
        """How the weights are held: the activations' dtype ("16"), "fp8", "int8" or "int4"."""
        if self.quant is not None:
            return self.quant.name
        return "16" if self.scale is None else "fp8"

    def set_fp8(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        """Hold FP8 values ``q`` and their row scales instead of the current weights."""
        if q.shape != self.shape or scale.shape != q.shape[:2]:
            raise ValueError(f"FP8 experts {list(q.shape)} do not match {list(self.shape)}")
        if self.quant is not None:
            raise ValueError(f"the experts are held in {self.quant.name}, not 16-bit")
        self.weight = nn.Parameter(q.to(fp8_experts.FP8), requires_grad=False)
        self.scale = scale.float()

    def use_fp8(self) -> None:
        """Quantize the current weights to FP8 (per-row absmax scales)."""
        if self.format == "16":
            self.set_fp8(*fp8_experts.quantize(self.weight.data))
        elif self.format != "fp8":
            raise ValueError(f"the experts are held in {self.format}, not 16-bit")

    def hold_quantized(self, fmt: QuantFormat) -> None:
        """Drop the 16-bit weights for empty ``qweight`` and ``scale`` in ``fmt`` (on the
        weights' device: the meta device before a checkpoint's state is assigned)."""
        if self.format != "16":
            raise ValueError(f"the experts are held in {self.format}, not 16-bit")
        device = self.weight.device
        qdtype = torch.int8 if fmt.bits == 8 else torch.uint8
        qshape = fmt.qweight_shape("experts", self.shape)
        del self.weight
        self.register_buffer("qweight", torch.empty(qshape, dtype=qdtype, device=device))
        scale = torch.empty(fmt.scale_shape("experts", self.shape), dtype=SCALE_DTYPE)
        self.register_buffer("scale", scale.to(device))
        self.quant = fmt

    def stored(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The values and scales as held, for the fused kernels (`moe_triton.experts_fused`)."""
        return (self.weight if self.quant is None else self.qweight), self.scale

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # A quantized format's scales are part of it: ``.to(dtype)`` on the model moves them
        # but never casts them (as models/common/quant_linear.py's).
        scale = self.scale
        super()._apply(fn, recurse)
        if self.quant is not None and scale is not None and self.scale.dtype != scale.dtype:
            self.scale = scale.to(self.scale.device)
        return self

    def values(self, dtype: torch.dtype) -> torch.Tensor:
        """The weights in ``dtype`` (dequantized when held in FP8, INT8 or INT4; a 4- or
        8-bit weight rounded first to its scale's dtype, as the kernels widen it)."""
        if self.quant is not None:
            return self.quant.dequantize(self.qweight, self.scale, self.scale.dtype).to(dtype)
        if self.scale is None:
            return self.weight
        return fp8_experts.dequantize(self.weight, self.scale, dtype)


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> (weights [N, k] in the logits' dtype, expert ids [N, k]):
    the top-k raw logits, softmaxed among themselves in fp32."""
    top, ids = logits.topk(top_k, dim=-1)
    return torch.softmax(top.float(), dim=-1).to(logits.dtype), ids


def expert_activation(z: torch.Tensor) -> torch.Tensor:
    """fc1 output [..., 2I] -> gelu_erf(first half) * (second half + 1) [..., I]."""
    a, b = z.chunk(2, dim=-1)
    return F.gelu(a) * (b + 1)


def experts_loop(
    x: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """x [N, D], ids [N, k] -> each chosen expert's output [N, k, D], expert by expert."""
    n, k = ids.shape
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    # CPU only (CUDA takes the fused or dense path): reading the loads here syncs nothing.
    counts = torch.bincount(flat, minlength=w1.shape[0]).tolist()
    rows = x[order // k]
    out = x.new_empty(n * k, w2.shape[1])
    start = 0
    for e, count in enumerate(counts):
        if count:
            part = slice(start, start + count)
            out[order[part]] = F.linear(expert_activation(F.linear(rows[part], w1[e])), w2[e])
            start += count
    return out.view(n, k, -1)


def experts_dense(
    x: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """x [N, D], ids [N, k] -> each chosen expert's output [N, k, D], every expert run on
    every token (fixed shapes, no host read)."""
    z = torch.einsum("nd,eod->neo", x, w1)
    y = torch.einsum("nei,edi->ned", expert_activation(z), w2)
    return y.gather(1, ids[..., None].expand(-1, -1, y.shape[-1]))


def _plus(x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
    return x if delta is None else x + delta


def experts_loop_lora(
    x: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, delta: ExpertDelta
) -> torch.Tensor:
    """`experts_loop` with an adapter's deltas, over the rows sorted by expert (the same
    products, so rows without an adapter equal `experts_loop`'s)."""
    n, k = ids.shape
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    # CPU only, as experts_loop: reading the loads here syncs nothing.
    counts = torch.bincount(flat, minlength=w1.shape[0]).tolist()
    spans, start = [], 0
    for e, count in enumerate(counts):
        if count:
            spans.append((e, slice(start, start + count)))
            start += count
    if not spans:
        return x.new_zeros(n, k, w2.shape[1])
    tokens = order // k
    rows, experts = x[tokens], flat[order]
    z = torch.cat([F.linear(rows[part], w1[e]) for e, part in spans])
    h = expert_activation(_plus(z, delta("fc1", rows, experts, tokens)))
    y = torch.cat([F.linear(h[part], w2[e]) for e, part in spans])
    y = _plus(y, delta("fc2", h, experts, tokens))
    out = torch.empty_like(y)
    out[order] = y
    return out.view(n, k, -1)


def experts_dense_lora(
    x: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, delta: ExpertDelta
) -> torch.Tensor:
    """`experts_dense` with an adapter's deltas (fixed shapes, no host read): fc1's added to
    each token's chosen experts before the activation, fc2's to their outputs."""
    n, k = ids.shape
    flat = ids.reshape(-1)
    tokens = torch.arange(n * k, device=x.device) // k
    z = torch.einsum("nd,eod->neo", x, w1)
    up = delta("fc1", x[tokens], flat, tokens)
    if up is not None:  # a token's k experts are distinct: each chosen row gets its delta once
        z = z.scatter_add(1, ids[..., None].expand(-1, -1, z.shape[-1]), up.view(n, k, -1))
    h = expert_activation(z)
    y = torch.einsum("nei,edi->ned", h, w2).gather(1, ids[..., None].expand(-1, -1, w2.shape[1]))
    chosen = h.gather(1, ids[..., None].expand(-1, -1, h.shape[-1])).reshape(n * k, -1)
    down = delta("fc2", chosen, flat, tokens)
    return y if down is None else y + down.view(n, k, -1)


def combine_slots(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Expert outputs [N, k, D] and routing weights [N, k] -> [N, D], summed in slot order."""
    out = y[:, 0] * weights[:, :1]
    for j in range(1, y.shape[1]):
        out = out + y[:, j] * weights[:, j : j + 1]
    return out


class MoeMLP(nn.Module):
    """router [E, D] + bias, fc1 [E, 2I, D], fc2 [E, D, I]: the checkpoint's names."""

    def __init__(self, dim: int, moe: MoeConfig) -> None:
        super().__init__()
        self.top_k = moe.top_k
        self.router = nn.Linear(dim, moe.n_experts)
        self.fc1 = ExpertBank(moe.n_experts, 2 * moe.expert_dim, dim)
        self.fc2 = ExpertBank(moe.n_experts, dim, moe.expert_dim)
        # None: fused on CUDA with Triton, dense on CUDA without, loop elsewhere.
        self.method: ExpertMethod | None = None
        # FP8 activations in the fused kernels for steps of FP8_ACT_MIN_TOKENS tokens or more
        # (`use_fp8_activations`): FP8 x FP8 products, answers no longer the bf16 path's.
        self.fp8_act = False
        # The router's product through the skinny kernel in steps of few rows (text.py's
        # `use_fused_products`).
        self.skinny_router = False

    def use_fp8_activations(self, enabled: bool = True) -> None:
        """Run wide steps' expert products with FP8 activations (needs FP8 weights)."""
        if enabled and self.fc1.format != "fp8":
            raise ValueError("FP8 activations need the experts' weights in FP8")
        self.fp8_act = enabled

    def forward(self, h: torch.Tensor, delta: ExpertDelta | None = None) -> torch.Tensor:
        """``delta``: an adapter's deltas for this layer's (token, expert) rows, if any."""
        x = h.reshape(-1, h.shape[-1])
        method = self.method or (
            "fused" if moe_triton.available(x) else "dense" if x.is_cuda else "loop"
        )
        if method == "fused":
            return self._fused(x, delta).view(h.shape)
        weights, ids = route(self.router(x), self.top_k)
        if delta is None:
            run = experts_dense if method == "dense" else experts_loop
            y = run(x, ids, self.fc1.values(x.dtype), self.fc2.values(x.dtype))
        else:
            run_lora = experts_dense_lora if method == "dense" else experts_loop_lora
            y = run_lora(x, ids, self.fc1.values(x.dtype), self.fc2.values(x.dtype), delta)
        return combine_slots(y, weights).view(h.shape)

    def pairs(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where the fused path runs (and no adapter): each chosen expert's output [N, k, D]
        and the routing weights [N, k] before their combine, for a caller that fuses the
        combine into what follows (moe_norm.py); None on the other paths."""
        x = h.reshape(-1, h.shape[-1])
        if (self.method or ("fused" if moe_triton.available(x) else "")) != "fused":
            return None
        return self._fused_pairs(x, None)

    def _fused(self, x: torch.Tensor, delta: ExpertDelta | None) -> torch.Tensor:
        """Router (cuBLAS), route + grouping (one or two kernels), the two grouped kernels,
        combine (one kernel): the plain path's numbers, no host read, shapes fixed by N."""
        return moe_routing.combine_fused(*self._fused_pairs(x, delta))

    def _fused_pairs(
        self, x: torch.Tensor, delta: ExpertDelta | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`_fused` before the combine: (each chosen expert's output, routing weights)."""
        fp8_act = self.fp8_act and delta is None and x.shape[0] >= moe_triton.FP8_ACT_MIN_TOKENS
        table = moe_triton.FP8_ACT_TILES if fp8_act else None
        tiles = moe_triton.pick_tiles(x.shape[0], table)
        logits = skinny_gemm.layer_product(self.router, x) if self.skinny_router else None
        if logits is None:
            logits = self.router(x)
        weights, ids, routing = moe_routing.route_align(logits, self.top_k, tiles.bm)
        (w1, s1), (w2, s2) = self.fc1.stored(), self.fc2.stored()
        y = moe_triton.experts_fused(
            x, ids, w1, w2, s1, s2, delta, tiles=tiles, routing=routing, fp8_act=fp8_act
        )
        return y, weights
