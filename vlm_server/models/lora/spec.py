"""What an adapter is: low-rank deltas on a decoder's linear layers, and how a decoder asks
for them.

A family declares its targets (`LoraTargets`: layers, and per target name the input and
output widths of the linear layer it adds to). Its decoder calls ``lora.add(layer, target,
x, out)``, which returns that layer's output ``out`` with the delta added. Moondream's rule
(the reference's ``moondream/torch/text.py``): per layer ``qkv += (h @ A^T) @ B^T``, ``fc1
+= ...`` before the GELU, ``fc2 += (gelu @ A^T) @ B^T``, and ``proj += (h @ A^T) @ B^T``
where ``h`` is the layer-normed block input, not the attention output the base ``proj``
reads. No alpha or rank scaling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LoraTargets:
    """The linear layers of a decoder an adapter may add to: ``targets[name] = (in, out)``
    widths, for each of ``n_layers`` layers."""

    n_layers: int
    targets: dict[str, tuple[int, int]]


@dataclass
class AdapterWeights:
    """One adapter, validated against a model: ``pairs[layer][target] = (A [r, in], B [out,
    r])`` (targets an adapter leaves out add nothing); ``rank`` is the largest ``r``."""

    name: str
    rank: int
    pairs: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for layer in self.pairs for a, b in layer.values())

    def to(self, dtype: torch.dtype, device: torch.device | str) -> AdapterWeights:
        pairs = [
            {t: (a.to(device, dtype), b.to(device, dtype)) for t, (a, b) in layer.items()}
            for layer in self.pairs
        ]
        return AdapterWeights(self.name, self.rank, pairs)


class LoraDelta(Protocol):
    """What a decoder asks: ``out`` [..., out], the output of ``target`` in ``layer``, plus
    the adapter's delta for that layer's input ``x`` [..., in] (tokens in the order the
    forward holds them). ``out`` may be updated in place."""

    def add(self, layer: int, target: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor: ...


class SingleLora:
    """One adapter for every token, computed as the reference does (two ``F.linear``): the
    reference generation uses it."""

    def __init__(self, weights: AdapterWeights) -> None:
        self.weights = weights

    def delta(self, layer: int, target: str, x: torch.Tensor) -> torch.Tensor | None:
        """The delta alone (None: the adapter leaves the target out)."""
        pair = self.weights.pairs[layer].get(target)
        if pair is None:
            return None
        a, b = pair
        return F.linear(F.linear(x, a), b)

    def add(self, layer: int, target: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        d = self.delta(layer, target, x)
        return out if d is None else out + d
