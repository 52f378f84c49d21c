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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from vlm_server.models.common.layers import gelu_tanh


@dataclass(frozen=True)
class LoraTargets:
    """The linear layers of a decoder an adapter may add to: ``targets[name] = (in, out)``
    widths, for each of ``n_layers`` layers. ``shared``: groups of targets whose deltas the
    decoder computes from one input tensor (their A's are stacked, so that one shrink serves
    a group: models/lora/layout.py)."""

    n_layers: int
    targets: dict[str, tuple[int, int]]
    shared: tuple[tuple[str, ...], ...] = ()

    def __post_init__(self) -> None:
        seen = [t for group in self.shared for t in group]
        assert len(seen) == len(set(seen)) <= len(self.targets), "a target in one group at most"
        for group in self.shared:
            widths = {self.targets[t][0] for t in group}
            assert len(widths) == 1, f"{group}: a shared input has one width"


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
    forward holds them). ``out`` may be updated in place.

    `shrink` and `expand` split the same deltas in two so that an implementation can batch
    them: ``shrink(layer, x, targets)`` takes what ``targets``' deltas need of their shared
    input ``x``; ``expand(layer, [(shrunk, target, out), ...])`` returns each ``out`` plus
    its target's delta of the input ``shrunk`` was taken from (``gelu_last``: the last one
    then through GELU, tanh approximation)."""

    def add(self, layer: int, target: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor: ...

    def shrink(self, layer: int, x: torch.Tensor, targets: tuple[str, ...]) -> object: ...

    def expand(
        self,
        layer: int,
        outs: Sequence[tuple[Any, str, torch.Tensor]],
        gelu_last: bool = False,
    ) -> list[torch.Tensor]: ...


class DeltaByTarget:
    """`shrink` and `expand` through ``add``, target by target: each output gets its own
    delta in the order ``outs`` lists them (the reference's arithmetic)."""

    def add(self, layer: int, target: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def shrink(self, layer: int, x: torch.Tensor, targets: tuple[str, ...]) -> object:
        return x

    def expand(
        self,
        layer: int,
        outs: Sequence[tuple[Any, str, torch.Tensor]],
        gelu_last: bool = False,
    ) -> list[torch.Tensor]:
        ys = [self.add(layer, target, x, out) for x, target, out in outs]
        if gelu_last:
            ys[-1] = gelu_tanh(ys[-1])
        return ys


class SingleLora(DeltaByTarget):
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
