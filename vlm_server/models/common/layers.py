"""Small building blocks shared by the vision, text and region parts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlm_server.models.common.quant_linear import QuantLinear

LN_EPS = 1e-5  # every LayerNorm in Moondream 2 uses PyTorch's default eps


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation: the only activation the model uses."""
    return F.gelu(x, approximate="tanh")


class LayerNorm(nn.Module):
    """LayerNorm whose parameters are named ``weight``/``bias`` like the checkpoint."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, LN_EPS)


class MLP(nn.Module):
    """fc1 -> gelu_tanh -> fc2."""

    def __init__(self, dim: int, inner: int, out: int | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, inner)
        self.fc2 = nn.Linear(inner, dim if out is None else out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return self.fc2(self.fc1_gelu(x))
        return self.fc2(gelu_tanh(self.fc1(x)))

    def fc1_gelu(self, x: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(fc1(x)) with the bias and the GELU in the GEMM's epilogue (cuBLASLt on
        CUDA): one kernel instead of two, and no round trip of the widest activation. A
        quantized fc1 (models/common/quant_linear.py) has the GELU in its own epilogue."""
        if isinstance(self.fc1, QuantLinear):
            return self.fc1(x, gelu=True)
        flat = x.reshape(-1, x.shape[-1])
        h = torch._addmm_activation(self.fc1.bias, flat, self.fc1.weight.t(), use_gelu=True)
        return h.view(*x.shape[:-1], h.shape[-1])
