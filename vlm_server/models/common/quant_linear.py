"""A linear layer over 8- or 4-bit weights (docs/quantization.md), in place of an `nn.Linear`.

It holds the stored values and their scales (``qweight``, ``scale``) and the layer's bias,
never a 16-bit copy of the weight: that is the point of the format. On CUDA its products
run in models/common/quant_gemm.py's kernels, which widen each weight tile in registers
(few rows, a decode step: the skinny kernel; more: the tiled GEMM). Elsewhere it widens the
weight for the one product (dequantize, then the plain product), under the same numerics
contract: each weight rounded once to the scale's dtype, then to the activations'. So the
CPU tests run the production layer, and a product here equals that of a 16-bit layer
holding the dequantized weight (exactly off CUDA; up to the order of fp32 sums on it).

The module's state is ``qweight``, ``scale`` and ``bias``: a quantized checkpoint's
``<layer>.weight.qweight`` and ``<layer>.weight.scale`` load into it as ``<layer>.qweight``
and ``<layer>.scale`` (`module_names`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from vlm_server.models.common import quant_gemm
from vlm_server.models.quant.files import QWEIGHT, SCALE
from vlm_server.models.quant.formats import SCALE_DTYPE, QuantFormat

WEIGHT = ".weight"


class QuantLinear(nn.Module):
    """``x @ w^T + bias`` with ``w`` stored in ``fmt`` (INT8 per channel or INT4 in groups)."""

    def __init__(
        self,
        fmt: QuantFormat,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.fmt = fmt
        self.in_features, self.out_features = in_features, out_features
        shape = (out_features, in_features)
        qdtype = torch.int8 if fmt.bits == 8 else torch.uint8
        qshape = fmt.qweight_shape("weight", shape)
        self.register_buffer("qweight", torch.empty(qshape, dtype=qdtype, device=device))
        scale = torch.empty(fmt.scale_shape("weight", shape), dtype=SCALE_DTYPE, device=device)
        self.register_buffer("scale", scale)
        self.bias = nn.Parameter(torch.empty(out_features, device=device)) if bias else None

    @classmethod
    def like(cls, linear: nn.Linear, fmt: QuantFormat) -> QuantLinear:
        """An empty layer of ``linear``'s shape and bias, on its device (meta when built so)."""
        return cls(
            fmt,
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device=linear.weight.device,
        )

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # The scales are part of the format: ``.to(dtype)`` or ``.half()`` on the model moves
        # them with it but never casts them (the bias takes the activations' dtype).
        scale = self.scale
        super()._apply(fn, recurse)
        if self.scale.dtype != scale.dtype:
            self.scale = scale.to(self.scale.device)
        return self

    def extra_repr(self) -> str:
        group = f", group={self.fmt.group_size}" if self.fmt.group_size else ""
        return f"{self.in_features}, {self.out_features}, {self.fmt.name}{group}"

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in ``dtype``, rounded first to the scale's dtype (as the
        kernels widen it): a temporary, for the product off CUDA and for checks."""
        return self.fmt.dequantize(self.qweight, self.scale, self.scale.dtype).to(dtype)

    def forward(self, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype; ``gelu``: tanh GELU of the result (on CUDA
        in the product's epilogue, as the 16-bit fc1's fused GEMM has it)."""
        if self._kernels_take(x):
            rows = x.numel() // x.shape[-1]
            product = (
                quant_gemm.quant_skinny_linear
                if rows <= quant_gemm.MAX_ROWS
                else quant_gemm.quant_linear
            )
            return product(x, self.qweight, self.scale, self.bias, gelu_from=0 if gelu else None)
        y = F.linear(x, self.dequantized(x.dtype), self.bias)
        return F.gelu(y, approximate="tanh") if gelu else y

    def _kernels_take(self, x: torch.Tensor) -> bool:
        # INT4 kernels take groups of quant_gemm.GROUP only (the loader refuses others on CUDA).
        group_ok = self.fmt.group_size in (0, quant_gemm.GROUP)
        return group_ok and quant_gemm.supported(x)


def module_names(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A quantized checkpoint's tensors (``<layer>.weight.qweight``, ``.weight.scale``) under
    the model's state names once its quantized layers are `QuantLinear`s."""
    out = {}
    for name, value in tensors.items():
        for suffix, member in ((WEIGHT + QWEIGHT, ".qweight"), (WEIGHT + SCALE, ".scale")):
            if name.endswith(suffix):
                name = name.removesuffix(suffix) + member
                break
        out[name] = value
    return out


def swap_linears(model: nn.Module, weights: Iterable[str], fmt: QuantFormat) -> None:
    """Replace the `nn.Linear` of each weight name (``<layer>.weight``) in ``model`` by an
    empty `QuantLinear` in ``fmt`` (before loading its state: build the model on the meta
    device, swap, then ``load_state_dict(..., assign=True)``)."""
    for name in weights:
        if not name.endswith(WEIGHT):
            raise ValueError(f"{name}: not a linear layer's weight")
        path = name.removesuffix(WEIGHT)
        linear = model.get_submodule(path)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"{path}: a {type(linear).__name__}, not a linear layer")
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, child, QuantLinear.like(linear, fmt))
