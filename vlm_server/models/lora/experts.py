"""Resident adapters of a decoder with expert layers (Moondream 3): the dense layers' pairs as
`LoraBank` holds them, plus one pair per expert of every expert layer, and the batched delta of
rows of (token, chosen expert) pairs.

Each expert layer's weights are stacked layer first, ``A [layers, slots, E, r, in]`` and ``B
[layers, slots, E, out, r]`` (``r`` = max_adapter_rank / experts per token; a lower rank is
zero-padded, which adds exact zeros), so one layer's slice is ``[slots * E, r, in]`` without a
copy: a row's (slot, expert) pair is one index into it, and the grouped LoRA kernel of the
dense layers (models/common/lora_kernel.py) serves the expert rows unchanged. Elsewhere
PyTorch: exact per-pair products on the CPU (each adapter's own rank, as the reference), and
on CUDA without Triton each row's pair gathered and two batched products (no host sync).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType

import torch

from vlm_server.models.lora.bank import LoraBank, exact_lora
from vlm_server.models.lora.layout import SlotLayout
from vlm_server.models.lora.spec import AdapterWeights, ExpertTargets, LoraTargets

EXPERTS = "experts."  # staged expert targets are keyed apart from the dense ones
DENSE = "dense"  # the dense layers' staged slot (`LoraBank.staging`)
ExpertStaged = dict[str, "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]


@dataclass(frozen=True)
class ExpertTransfer:
    """One adapter of a decoder with expert layers as one flat buffer on its way to a slot:
    the dense layers' `SlotLayout`, then per expert target ``A [layers, E, r, in]`` and ``B
    [layers, E, out, r]`` (``r`` the expert rank, zero-padded). What the adapter reader's
    child packs (engine/adapter_reader.py: it has `targets`, `max_rank`, `numel`, `pack`, as
    a `SlotLayout` has); the bank takes it apart into its staging buffers."""

    dense: SlotLayout
    expert_rank: int

    @property
    def targets(self) -> LoraTargets:
        return self.dense.targets

    @property
    def max_rank(self) -> int:
        return self.dense.max_rank

    def segments(self) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
        """(target, A shape, B shape) of each expert target, in declaration order."""
        ex = self.targets.experts
        assert ex is not None
        r = self.expert_rank
        return [
            (t, (ex.n_layers, ex.n_experts, r, n_in), (ex.n_layers, ex.n_experts, n_out, r))
            for t, (n_in, n_out) in ex.targets.items()
        ]

    @property
    def numel(self) -> int:
        experts = sum(math.prod(a) + math.prod(b) for _, a, b in self.segments())
        return self.dense.numel + experts

    def split(
        self, flat: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Views into ``flat`` [numel]: the dense layers' slot, and each target's (A, B)."""
        at = self.dense.numel
        out = {}
        for t, a_shape, b_shape in self.segments():
            n_a, n_b = math.prod(a_shape), math.prod(b_shape)
            a = flat[at : at + n_a].view(a_shape)
            b = flat[at + n_a : at + n_a + n_b].view(b_shape)
            out[t] = (a, b)
            at += n_a + n_b
        return flat[: self.dense.numel], out

    def pack(self, weights: AdapterWeights, flat: torch.Tensor) -> None:
        """Write ``weights`` into ``flat`` [numel], zero-padded, in ``flat``'s dtype."""
        assert flat.shape == (self.numel,), "one adapter's flat buffer"
        dense, experts = self.split(flat)
        self.dense.pack(weights, dense)
        for t, (a, b) in experts.items():
            fill_experts(weights, t, a, b)


def fill_experts(weights: AdapterWeights, target: str, a: torch.Tensor, b: torch.Tensor) -> None:
    """``a`` [layers, E, r, in] and ``b`` [layers, E, out, r]: ``target``'s expert pairs of
    every expert layer, zero-padded to r (zeros where a layer has none)."""
    a.zero_()
    b.zero_()
    for layer, pairs in enumerate(weights.experts):
        if target in pairs:
            wa, wb = pairs[target]
            a[layer, :, : wa.shape[1]] = wa
            b[layer, :, :, : wb.shape[2]] = wb


class ExpertLoraBank(LoraBank):
    """``n_slots`` adapters of rank up to ``max_rank`` for a decoder with expert layers."""

    def __init__(
        self,
        targets: LoraTargets,
        n_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__(targets, n_slots, max_rank, dtype, device)
        ex = targets.experts
        if ex is None:
            raise ValueError("an expert bank needs targets with expert layers")
        self.expert_targets: ExpertTargets = ex
        self.expert_rank = r = max_rank // ex.top_k
        if r < 1:
            raise ValueError(
                f"max_adapter_rank {max_rank} is below the {ex.top_k} experts per token: an "
                "adapter's rank is split over them"
            )
        L, E = ex.n_layers, ex.n_experts
        self.ea = {
            t: torch.zeros(L, n_slots, E, r, n_in, dtype=dtype, device=device)
            for t, (n_in, _) in ex.targets.items()
        }
        self.eb = {
            t: torch.zeros(L, n_slots, E, n_out, r, dtype=dtype, device=device)
            for t, (_, n_out) in ex.targets.items()
        }
        pin = self.device.type == "cuda"  # one slot's worth, made once (see LoraBank)
        self._expert_stage = {
            t: (
                torch.empty(L, E, r, n_in, dtype=dtype, pin_memory=pin),
                torch.empty(L, E, n_out, r, dtype=dtype, pin_memory=pin),
            )
            for t, (n_in, n_out) in ex.targets.items()
        }

    @property
    def nbytes(self) -> int:
        experts = sum(x.nbytes for x in (*self.ea.values(), *self.eb.values()))
        return super().nbytes + experts

    @property
    def transfer(self) -> ExpertTransfer:
        """The flat layout the adapter reader packs one adapter into."""
        return ExpertTransfer(self.layout, self.expert_rank)

    def staging(self, weights: AdapterWeights) -> ExpertStaged:  # type: ignore[override]
        """The dense layers' staging (`LoraBank.staging`) and the expert layers', keyed
        ``experts.<target>``; the caller holds `stage_lock` until the copy completed."""
        out: ExpertStaged = {DENSE: super().staging(weights)}
        for t in self.expert_targets.targets:
            a, b = self._expert_stage[t]
            fill_experts(weights, t, a, b)
            out[EXPERTS + t] = (a, b)
        return out

    def staging_from(self, packed: torch.Tensor) -> ExpertStaged:  # type: ignore[override]
        """`staging` of an adapter the reader packed in `transfer`'s layout: plain copies,
        which release the GIL."""
        dense, experts = self.transfer.split(packed)
        out: ExpertStaged = {DENSE: super().staging_from(dense)}
        for t, (a, b) in experts.items():
            stage_a, stage_b = self._expert_stage[t]
            stage_a.copy_(a)
            stage_b.copy_(b)
            out[EXPERTS + t] = (stage_a, stage_b)
        return out

    def write(self, slot: int, staged: ExpertStaged, rank: int) -> None:  # type: ignore[override]
        """`LoraBank.write` of the dense layers, then each expert layer's slice of ``slot``
        (contiguous [E, r, in] and [E, out, r]: plain asynchronous copies from pinned memory)."""
        dense = staged[DENSE]
        assert isinstance(dense, torch.Tensor)
        super().write(slot, dense, rank)
        for t in self.expert_targets.targets:
            a, b = staged[EXPERTS + t]
            for layer in range(a.shape[0]):
                self.ea[t][layer, slot].copy_(a[layer], non_blocking=True)
                self.eb[t][layer, slot].copy_(b[layer], non_blocking=True)

    def expert_delta(
        self,
        index: torch.Tensor,
        layer: int,
        target: str,
        x: torch.Tensor,
        experts: torch.Tensor,
        tokens: torch.Tensor,
    ) -> torch.Tensor | None:
        """Rows' deltas [R, out] for expert layer ``layer``: row i is token ``tokens[i]`` (-1:
        padding, delta zero) through expert ``experts[i]``, with that token's slot ``index``."""
        if target not in self.ea:
            return None
        n_pairs = self.n_slots * self.expert_targets.n_experts
        a = self.ea[target][layer].view(n_pairs, self.expert_rank, -1)
        b = self.eb[target][layer].view(n_pairs, -1, self.expert_rank)
        pick = pair_index(index, experts, tokens, self.expert_targets.n_experts)
        if not x.is_cuda:
            k, n_experts = self.expert_targets.top_k, self.expert_targets.n_experts
            ranks = [r // k for r in self.ranks for _ in range(n_experts)]
            return exact_lora(x, a, b, pick, ranks)
        kernel = _lora_kernel()
        if kernel is not None:
            return kernel.grouped_lora(x, a, b, pick)
        return gathered_lora(x, a, b, pick)


def _lora_kernel() -> ModuleType | None:
    """The grouped Triton LoRA kernels' module, or None without Triton."""
    from vlm_server.models.common import lora_kernel

    return lora_kernel if lora_kernel.AVAILABLE else None


def pair_index(
    index: torch.Tensor, experts: torch.Tensor, tokens: torch.Tensor, n_experts: int
) -> torch.Tensor:
    """Each row's (slot, expert) pair ``slot * n_experts + expert`` (int32; -1: the row's
    token has no adapter, or the row is padding). Device ops only (capturable)."""
    tok = tokens.long()
    slot = torch.where(tok >= 0, index[tok.clamp(min=0)].long(), -1)
    return torch.where(slot >= 0, slot * n_experts + experts.long(), -1).to(torch.int32)


def gathered_lora(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, pick: torch.Tensor
) -> torch.Tensor:
    """Each row's pair gathered (``a[pick]`` [R, r, in], ``b[pick]`` [R, out, r]) and two
    batched products; rows without a pair (-1) zero. No host sync (capturable)."""
    safe = pick.clamp(min=0).long()
    v = torch.bmm(a[safe], x[:, :, None])
    y = torch.bmm(b[safe], v)[..., 0]
    return torch.where((pick >= 0)[:, None], y, torch.zeros((), dtype=y.dtype, device=y.device))
