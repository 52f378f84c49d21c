"""What an adapter is: low-rank deltas on a decoder's linear layers, and how a decoder asks
for them.

A family declares its targets (`LoraTargets`: layers, and per target name the input and
output widths of the linear layer it adds to). Its decoder calls ``lora.add(layer, target,
x, out)``, which returns that layer's output ``out`` with the delta added. Moondream's rule
(the reference's ``moondream/torch/text.py``): per layer ``qkv += (h @ A^T) @ B^T``, ``fc1
+= ...`` before the GELU, ``fc2 += (gelu @ A^T) @ B^T``, and ``proj += (h @ A^T) @ B^T``
where ``h`` is the layer-normed block input, not the attention output the base ``proj``
reads. No alpha or rank scaling.

A mixture-of-experts decoder (Moondream 3) also declares `ExpertTargets`: every expert of its
expert layers has its own low-rank pair, the adapter's rank split evenly over the experts a
token uses. Its decoder asks ``lora.expert_delta(layer, target, x, experts, tokens)`` for rows
of (token, chosen expert) pairs: the delta belongs to that expert's computation (fc1's before
the activation, fc2's after), before the routing weight scales it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F

from vlm_server.models.common.layers import gelu_tanh

# How a family's adapters are stored and fetched: "variant" (Moondream 2: the reference's
# renamed training keys; ``/v1/variants/<id>/download``) or "finetune" (Moondream 3: the cloud
# finetunes' ``lora_state_dict``; a checkpoint's presigned URL, models/lora/finetune_files.py).
AdapterFormat = Literal["variant", "finetune"]


@dataclass(frozen=True)
class ExpertTargets:
    """The expert layers an adapter may add to: layers ``first_layer`` to ``first_layer +
    n_layers - 1`` (adapter layer ``j`` is decoder layer ``first_layer + j``), each with
    ``n_experts`` experts, ``top_k`` of them per token; ``targets[name] = (in, out)`` widths
    of one expert's matrix. An adapter of rank r gives each expert rank r / top_k."""

    first_layer: int
    n_layers: int
    n_experts: int
    top_k: int
    targets: dict[str, tuple[int, int]]


@dataclass(frozen=True)
class LoraTargets:
    """The linear layers of a decoder an adapter may add to: ``targets[name] = (in, out)``
    widths, for each of ``n_layers`` layers (the first ones: a family with expert layers
    counts its dense layers here); ``experts``: its expert layers, if any; ``format``: how its
    adapters are stored and fetched; ``shared``: groups of targets whose deltas the decoder
    computes from one input tensor (their A's are stacked, so that one shrink serves a group:
    models/lora/layout.py)."""

    n_layers: int
    targets: dict[str, tuple[int, int]]
    experts: ExpertTargets | None = None
    format: AdapterFormat = "variant"
    shared: tuple[tuple[str, ...], ...] = ()

    def __post_init__(self) -> None:
        seen = [t for group in self.shared for t in group]
        assert len(seen) == len(set(seen)) <= len(self.targets), "a target in one group at most"
        for group in self.shared:
            widths = {self.targets[t][0] for t in group}
            assert len(widths) == 1, f"{group}: a shared input has one width"


Pairs = list[dict[str, tuple[torch.Tensor, torch.Tensor]]]


@dataclass
class AdapterWeights:
    """One adapter, validated against a model: ``pairs[layer][target] = (A [r, in], B [out,
    r])`` (targets an adapter leaves out add nothing); ``rank`` is the largest ``r``.
    ``experts[j][target] = (A [E, r / top_k, in], B [E, out, r / top_k])``: expert layer
    ``j``'s pairs, one per expert (empty for a decoder without expert layers)."""

    name: str
    rank: int
    pairs: Pairs
    experts: Pairs = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        layers = [*self.pairs, *self.experts]
        return sum(a.nbytes + b.nbytes for layer in layers for a, b in layer.values())

    def to(self, dtype: torch.dtype, device: torch.device | str) -> AdapterWeights:
        def move(pairs: Pairs) -> Pairs:
            return [
                {t: (a.to(device, dtype), b.to(device, dtype)) for t, (a, b) in layer.items()}
                for layer in pairs
            ]

        return AdapterWeights(self.name, self.rank, move(self.pairs), move(self.experts))


class LoraDelta(Protocol):
    """What a decoder asks: ``out`` [..., out], the output of ``target`` in ``layer``, plus
    the adapter's delta for that layer's input ``x`` [..., in] (tokens in the order the
    forward holds them). ``out`` may be updated in place.

    `shrink` and `expand` split the same deltas in two so that an implementation can batch
    them: ``shrink(layer, x, targets)`` takes what ``targets``' deltas need of their shared
    input ``x``; ``expand(layer, [(shrunk, target, out), ...])`` returns each ``out`` plus
    its target's delta of the input ``shrunk`` was taken from (``gelu_last``: the last one
    then through GELU, tanh approximation); ``expand_sum(layer, [(shrunk, target), ...],
    out)`` adds several targets' deltas into one output."""

    @property
    def fused(self) -> bool:
        """Whether `shrink`, `expand` and `expand_sum` run grouped kernels in place, so that a
        decoder may take its fused products with these deltas."""
        ...

    def add(self, layer: int, target: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor: ...

    def expert_delta(
        self,
        layer: int,
        target: str,
        x: torch.Tensor,
        experts: torch.Tensor,
        tokens: torch.Tensor,
    ) -> torch.Tensor | None:
        """Expert layer ``layer``'s delta [R, out] for ``R`` rows of (token, expert) pairs:
        ``x`` [R, in] the rows' inputs to ``target``, ``experts`` [R] each row's expert,
        ``tokens`` [R] its token in the forward's order (-1: a padding row, delta zero).
        None: no delta for ``target`` (the adapter leaves it out)."""
        ...

    def shrink(self, layer: int, x: torch.Tensor, targets: tuple[str, ...]) -> object: ...

    def expand(
        self,
        layer: int,
        outs: Sequence[tuple[Any, str, torch.Tensor]],
        gelu_last: bool = False,
    ) -> list[torch.Tensor]: ...

    def expand_sum(
        self, layer: int, terms: Sequence[tuple[Any, str]], out: torch.Tensor
    ) -> torch.Tensor: ...


class DeltaByTarget:
    """`shrink` and `expand` through ``add``, target by target: each output gets its own
    delta in the order ``outs`` lists them (the reference's arithmetic)."""

    @property
    def fused(self) -> bool:
        """Target by target: never the grouped kernels."""
        return False

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

    def expand_sum(
        self, layer: int, terms: Sequence[tuple[Any, str]], out: torch.Tensor
    ) -> torch.Tensor:
        """``out`` plus every ``(shrunk, target)`` term's delta: targets whose outputs the
        decoder sums anyway (a parallel block's proj and fc2, when one product gives their
        sum)."""
        for x, target in terms:
            out = self.add(layer, target, x, out)
        return out


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

    def expert_delta(
        self,
        layer: int,
        target: str,
        x: torch.Tensor,
        experts: torch.Tensor,
        tokens: torch.Tensor,
    ) -> torch.Tensor | None:
        """Row by row, each row's expert's own pair: ``B[e] (A[e] x)`` (the reference's
        arithmetic, plainly); None where the adapter leaves the target out."""
        pair = self.weights.experts[layer].get(target) if self.weights.experts else None
        if pair is None:
            return None
        a, b = pair
        y = x.new_zeros(x.shape[0], b.shape[1])
        # The reference generation's path (one adapter, plain loops): its host reads never
        # run in the scheduler tick.
        for row, (e, t) in enumerate(zip(experts.tolist(), tokens.tolist(), strict=True)):
            if t >= 0:
                y[row] = b[e] @ (a[e] @ x[row])
        return y
