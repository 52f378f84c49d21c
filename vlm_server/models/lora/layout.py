"""One adapter slot's weights as one flat buffer: the same layout on the device (a row of the
bank), in the host staging buffer and in what the adapter reader process writes, so that a load
is one copy at each hop.

Targets whose deltas read the same input (`LoraTargets.shared`) have their A matrices stacked
along the rank, ``[layers, k * max_rank, in]`` per group, so that one shrink serves the group;
every other target's A is a group of its own. Each B is ``[layers, out, max_rank]``. A lower
rank is zero-padded: the padding adds exact zeros.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from vlm_server.models.lora.spec import AdapterWeights, LoraTargets

Group = tuple[str, ...]


class Packing(Protocol):
    """A flat layout one adapter is packed into on its way to a slot (`SlotLayout`, or a
    decoder with expert layers' `experts.ExpertTransfer`)."""

    @property
    def targets(self) -> LoraTargets: ...

    @property
    def max_rank(self) -> int: ...

    @property
    def numel(self) -> int: ...

    def pack(self, weights: AdapterWeights, flat: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class SlotLayout:
    targets: LoraTargets
    max_rank: int

    @property
    def groups(self) -> list[Group]:
        """The shared-input groups, then every other target alone, in declaration order."""
        shared = [tuple(g) for g in self.targets.shared]
        grouped = {t for g in shared for t in g}
        return shared + [(t,) for t in self.targets.targets if t not in grouped]

    def segments(self) -> list[tuple[str, Group, tuple[int, ...]]]:
        """(``"A"``, group, shape) per group, then (``"B"``, (target,), shape) per target."""
        n_layers, r = self.targets.n_layers, self.max_rank
        out = []
        for group in self.groups:
            n_in = self.targets.targets[group[0]][0]
            out.append(("A", group, (n_layers, len(group) * r, n_in)))
        for target, (_, n_out) in self.targets.targets.items():
            out.append(("B", (target,), (n_layers, n_out, r)))
        return out

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for _, _, shape in self.segments())

    def views(
        self, flat: torch.Tensor
    ) -> tuple[dict[Group, torch.Tensor], dict[str, torch.Tensor]]:
        """Views into ``flat`` [..., numel]: each group's stacked A [..., layers, k * r, in]
        and each target's B [..., layers, out, r] (leading dims kept: the bank's slots)."""
        a: dict[Group, torch.Tensor] = {}
        b: dict[str, torch.Tensor] = {}
        at = 0
        for kind, group, shape in self.segments():
            n = math.prod(shape)
            view = flat[..., at : at + n].unflatten(-1, shape)
            at += n
            if kind == "A":
                a[group] = view
            else:
                b[group[0]] = view
        return a, b

    def target_a(self, groups: dict[Group, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each target's A [..., layers, r, in]: its rows of its group's stacked A."""
        r = self.max_rank
        return {
            t: stacked[..., i * r : (i + 1) * r, :]
            for group, stacked in groups.items()
            for i, t in enumerate(group)
        }

    def pack(self, weights: AdapterWeights, flat: torch.Tensor) -> None:
        """Write ``weights`` (checked against the targets, rank <= max_rank) into ``flat``
        [numel], zero-padded, converted to ``flat``'s dtype."""
        assert flat.shape == (self.numel,), "one slot's flat buffer"
        flat.zero_()
        groups, b = self.views(flat)
        a = self.target_a(groups)
        for layer, pairs in enumerate(weights.pairs):
            for target, (wa, wb) in pairs.items():
                a[target][layer, : wa.shape[0]] = wa
                b[target][layer, :, : wb.shape[1]] = wb
