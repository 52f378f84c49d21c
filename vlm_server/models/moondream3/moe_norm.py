"""An expert layer's combine fused into the residual add and the next block's LayerNorm
(CUDA with Triton; the CPU tests interpret it).

An expert layer's fused path ends with `moe_routing.combine_fused` (each token's k expert rows
weighted and summed in slot order) and the block with `fused_norm.add_layernorm` (``x + a +
m``, then the next block's norm). One kernel does both: it reads a token's k rows once,
combines them with every product and sum rounded to the activations' dtype as the combine
kernel does, adds ``(x + a) + m`` as the norm kernel does, and writes the residual stream
(bit for bit the two kernels') and its norm (fp32 statistics, as `fused_norm`). One launch and
one [N, D] round trip fewer per expert layer and step.
"""

from __future__ import annotations

import torch

from vlm_server.models.common import launch_overlap
from vlm_server.models.common.fused_norm import add_layernorm
from vlm_server.models.common.layers import LN_EPS, LayerNorm
from vlm_server.models.moondream3 import moe_routing
from vlm_server.models.moondream3.moe import combine_slots

try:
    import triton
    import triton.language as tl

    from vlm_server.models.common.fused_norm import _normalize
    from vlm_server.models.common.launch_overlap import gdc_launch_dependents, gdc_wait
    from vlm_server.models.moondream3.moe_routing import combined
except ImportError:  # the CPU path needs no Triton
    triton = None
    tl = None


if triton is not None:

    @triton.jit
    def _add_combine_layernorm_kernel(
        x_ptr,
        a_ptr,
        y_ptr,
        rw_ptr,
        w_ptr,
        bias_ptr,
        sum_ptr,
        out_ptr,
        dim,
        top_k,
        eps,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """One token: m = sum_j y[j] rw[j] in slot order (each product and sum rounded),
        s = (x + a) + m, and LayerNorm(s)."""
        if PDL:  # launched early (launch_overlap.py): wait for the predecessor first
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < dim
        offs = row * dim + cols
        m = combined(y_ptr, rw_ptr, row, cols, mask, dim, top_k, x_ptr.dtype.element_ty)
        s = tl.load(x_ptr + offs, mask=mask, other=0.0) + tl.load(
            a_ptr + offs, mask=mask, other=0.0
        )
        s = s + m
        tl.store(sum_ptr + offs, s, mask=mask)
        _normalize(s, cols, mask, offs, dim, eps, w_ptr, bias_ptr, out_ptr)


def add_combine_layernorm(
    x: torch.Tensor,
    a: torch.Tensor,
    y: torch.Tensor,
    weights: torch.Tensor,
    norm: LayerNorm,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + a + combine(y, weights)`` and ``norm(s)``, as `fused_norm.add_layernorm`
    over `moe_routing.combine_fused`: x, a [..., D]; y [N, k, D] each chosen expert's output
    and weights [N, k] of the N = x.numel() / D tokens. Returns (s, norm(s))."""
    dim = x.shape[-1]
    n, k, _ = y.shape
    if triton is None or not x.is_cuda or not x.dtype == a.dtype == y.dtype == weights.dtype:
        fused = triton is not None and x.is_cuda
        m = moe_routing.combine_fused(y, weights) if fused else combine_slots(y, weights)
        return add_layernorm(x, a, m.view(x.shape), norm)
    x, a = x.contiguous(), a.contiguous()
    s, out = torch.empty_like(x), torch.empty_like(x)
    # no FMA: each product is rounded before its sum, as the combine kernel launches
    _add_combine_layernorm_kernel[(n,)](
        x, a, y.contiguous(), weights.contiguous(), norm.weight, norm.bias, s, out, dim, k,
        LN_EPS, BLOCK=triton.next_power_of_2(dim), enable_fp_fusion=False,
        **launch_overlap.kernel_args(),
    )  # fmt: skip
    return s, out
