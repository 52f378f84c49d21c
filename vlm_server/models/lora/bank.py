"""Resident adapters on the device, stacked, and the batched delta over a per-token slot index.

`LoraBank` holds every slot's weights in one fixed-address buffer, a row per slot laid out as
models/lora/layout.py says (per shared-input group the A's stacked along the rank, per target
B; a lower rank is zero-padded, which adds exact zeros), so a captured graph reads whatever
adapters the slots hold when it replays, and a load is one copy into a row. `LoraBatch` is
what a batched forward passes its decoder: the bank and one slot per token (-1: no adapter).
On CUDA the deltas are the grouped Triton kernels (models/common/lora_kernel.py): `shrink`
once per shared-input group (or, on the fused decode products, `shrink_weights` for a
product that computes it beside its own columns: models/lora/products.py), `expand` added
into the layers' outputs in place, two per launch (`expand_then_shrink`: the launch that
finishes a GELU'd output also computes the next layer's shrink from it); a batch of image
prefixes (runs of hundreds of tokens with one slot each) runs two batched products over each
run's gathered weights; elsewhere PyTorch: exact per-slot products on the CPU (the
reference's arithmetic on each adapter's own rank), and on CUDA without Triton a masked
product per slot, which needs no host sync and so stays capturable.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from vlm_server.models.common.layers import gelu_tanh
from vlm_server.models.lora.layout import Group, SlotLayout
from vlm_server.models.lora.spec import AdapterWeights, DeltaByTarget, LoraTargets

if TYPE_CHECKING:
    from vlm_server.models.common.lora_kernel import Partials


WRITE_CHUNK_BYTES = 2 << 20  # a slot goes up in pieces of this size (~0.1 ms each over PCIe)
# Decode steps take models/common/lora_step.py's kernels where they fit (False: lora_kernel's
# per-slot launches).
STEP_KERNELS = True


class LoraBank:
    """``n_slots`` adapters of rank up to ``max_rank``, on ``device`` in ``dtype``."""

    def __init__(
        self,
        targets: LoraTargets,
        n_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.targets, self.n_slots, self.max_rank = targets, n_slots, max_rank
        self.dtype, self.device = dtype, torch.device(device)
        self.layout = SlotLayout(targets, max_rank)
        # Slot i's weights are row i, laid out as `SlotLayout` says: a load is one contiguous
        # copy.
        self.flat = torch.zeros(n_slots, self.layout.numel, dtype=dtype, device=device)
        # Views: per shared-input group the stacked A [slots, layers, k * r, in] (one shrink
        # for the group), per target A [slots, layers, r, in] and B [slots, layers, out, r].
        self.a_groups, self.b = self.layout.views(self.flat)
        self.a = self.layout.target_a(self.a_groups)
        self.group_of = {t: (g, i) for g in self.a_groups for i, t in enumerate(g)}
        self.ranks = [0] * n_slots  # host copy: the CPU path slices each slot to its rank
        # One slot's worth of host memory (pinned on CUDA), made here, at start, and reused:
        # pinning tens of megabytes per load stalled the running steps (the driver's page
        # locking). Whoever stages holds `stage_lock` until the copy from it completed.
        self.stage_lock = threading.Lock()
        pin = self.device.type == "cuda"
        self._stage = torch.empty(self.layout.numel, dtype=dtype, pin_memory=pin)

    @property
    def nbytes(self) -> int:
        return self.flat.nbytes

    def staging(self, weights: AdapterWeights) -> torch.Tensor:
        """One slot's worth of ``weights``, padded to the bank's layout, in the bank's one
        host staging buffer (pinned on CUDA, so the copy up is asynchronous). The caller holds
        `stage_lock` from here until the copy from it completed."""
        self.layout.pack(weights, self._stage)
        return self._stage

    @property
    def transfer(self) -> SlotLayout:
        """The flat layout the adapter reader packs one adapter into: a slot's."""
        return self.layout

    def staging_from(self, packed: torch.Tensor) -> torch.Tensor:
        """`staging` of a slot already packed in the bank's layout and dtype (``packed``
        [numel], e.g. the adapter reader's shared buffer): one copy, which releases the GIL."""
        self._stage.copy_(packed)
        return self._stage

    def write(self, slot: int, staged: torch.Tensor, rank: int) -> None:
        """Copy staged weights into ``slot`` on the current stream (asynchronous from pinned
        memory: the caller records and waits for an event before any forward reads it). The
        caller guarantees no queued forward reads the slot (it is pinned by no row)."""
        row = self.flat[slot]
        # In pieces on CUDA: a step's own uploads, on another stream, can go between them
        # instead of queueing behind tens of megabytes on the copy engine.
        step = WRITE_CHUNK_BYTES // row.element_size() if row.is_cuda else max(1, row.numel())
        for at in range(0, row.numel(), step):
            row[at : at + step].copy_(staged[at : at + step], non_blocking=True)
        self.ranks[slot] = rank

    def expert_delta(
        self,
        index: torch.Tensor,
        layer: int,
        target: str,
        x: torch.Tensor,
        experts: torch.Tensor,
        tokens: torch.Tensor,
    ) -> torch.Tensor | None:
        """Expert layers' deltas: none here (models/lora/experts.py holds them)."""
        return None


@dataclass(frozen=True)
class Shrunk:
    """`LoraBatch.shrink`'s result: the input, and on the kernel path each shrunk group's
    partial products (empty: the deltas are computed target by target from ``x``)."""

    x: torch.Tensor
    parts: dict[Group, Partials]


class LoraBatch(DeltaByTarget):
    """The bank and each token's slot (``index`` [T] int32, in the forward's token order;
    -1: none) for one forward. ``segments`` (slots [k], length): the first ``k * length``
    tokens are ``k`` runs of ``length`` tokens, run ``j`` all with slot ``slots[j]`` (a batch
    of image prefixes): on CUDA those run as two batched matrix products over each run's
    gathered weights instead of per token. ``kernels``: the grouped kernels' module (default:
    models/common/lora_kernel.py for a CUDA index, where Triton is; tests pass one to run);
    ``step``: the same deltas' kernels for a decode step (default: models/common/
    lora_step.py beside the default ``kernels``), taken where a step fits them."""

    def __init__(
        self,
        bank: LoraBank,
        index: torch.Tensor,
        segments: tuple[torch.Tensor, int] | None = None,
        kernels: ModuleType | None = None,
        step: ModuleType | None = None,
    ) -> None:
        self.bank, self.index, self.segments = bank, index, segments
        self.kernels = kernels or (_grouped_kernel() if index.is_cuda else None)
        if step is None and kernels is None and self.kernels is not None and STEP_KERNELS:
            step = _step_kernel()
        self.step = step if segments is None else None
        # A decode step's shrink's count per slot: this forward's own (a forward on another
        # stream must not share it), made zero once and left zero by every launch.
        self._count: torch.Tensor | None = None

    def add(self, layer: int, target: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        bank = self.bank
        if target not in bank.a:
            return out
        flat = x.reshape(-1, x.shape[-1])
        a, b = bank.a[target][:, layer], bank.b[target][:, layer]
        kernels = self.kernels
        if kernels is None and not flat.is_cuda:
            y = exact_lora(flat, a, b, self.index, bank.ranks)
        elif self.segments is not None:
            slots, length = self.segments
            n = slots.shape[0] * length
            head = segmented_lora(flat[:n], a, b, slots, length)
            tail = flat[n:]
            if tail.shape[0]:
                head = torch.cat([head, per_token(tail, a, b, self.index[n:], kernels)])
            y = head
        elif kernels is not None and out.is_contiguous():
            # The kernel adds into the layer's output: no delta tensor, no separate add.
            kernels.grouped_lora(flat, a, b, self.index, out=out.view(-1, out.shape[-1]))
            return out
        else:
            y = masked_lora(flat, a, b, self.index)
        return out + y.view(out.shape)

    @property
    def fused(self) -> bool:
        """Whether `shrink`, `expand` and `expand_sum` run the grouped kernels in place (CUDA
        with Triton, not a batch of image prefixes)."""
        return self.kernels is not None and self.segments is None

    def shrink(self, layer: int, x: torch.Tensor, targets: tuple[str, ...]) -> Shrunk:
        """On the kernel path, one launch per shared-input group of ``targets``: the partial
        products of ``x`` with every slot's stacked A of the group."""
        kernels = self.kernels
        if kernels is None or self.segments is not None:
            return Shrunk(x, {})
        flat = x.reshape(-1, x.shape[-1])
        groups = dict.fromkeys(self.bank.group_of[t][0] for t in targets if t in self.bank.a)
        a = self.bank.a_groups
        count = None
        step = self.step
        if step is not None and step.fits(flat.shape[0]):
            # A decode step: the shrink sums its own splits, for the step's expand.
            if self._count is None:
                self._count = torch.zeros(self.bank.n_slots, dtype=torch.int32, device=x.device)
            count = self._count
        index, extra = self.index, () if count is None else (count,)
        return Shrunk(x, {g: kernels.shrink(flat, a[g][:, layer], index, *extra) for g in groups})

    def shrink_weights(
        self, layer: int, targets: tuple[str, ...]
    ) -> tuple[Group, torch.Tensor] | None:
        """On the kernel path, the one shared-input group of ``targets`` and every slot's
        stacked A of it for ``layer`` ([slots, k * r, in]): for a product that computes the
        shrink beside its own columns (`shrunk` takes its result); else None."""
        if not self.fused:
            return None
        groups = {self.bank.group_of[t][0] for t in targets if t in self.bank.a}
        if len(groups) != 1:
            return None
        (group,) = groups
        return group, self.bank.a_groups[group][:, layer]

    def shrunk(self, x: torch.Tensor, group: Group, sums: torch.Tensor) -> Shrunk:
        """`shrink`'s result from a shrink of ``x`` over every slot (``sums`` [splits, T,
        slots * k * r] fp32 split sums, slot by slot): each token's expand reads its slot's."""
        from vlm_server.models.common.lora_kernel import Partials

        cols = sums.shape[-1] // self.bank.n_slots
        return Shrunk(x, {group: Partials(sums.permute(1, 0, 2), cols)})

    def expand(
        self,
        layer: int,
        outs: Sequence[tuple[Any, str, torch.Tensor]],
        gelu_last: bool = False,
    ) -> list[torch.Tensor]:
        """On the kernel path, the deltas added in place, two outputs per launch (the GELU
        fused into the launch of the last); elsewhere target by target."""
        return self._expand(layer, outs, gelu_last)[0]

    def expand_then_shrink(
        self, layer: int, outs: Sequence[tuple[Any, str, torch.Tensor]], target: str
    ) -> tuple[list[torch.Tensor], Shrunk | None]:
        """`expand` with the GELU on the last output, and ``target``'s shrink of that GELU'd
        output computed in the GELU's launch where the kernels can (the kernel path, the
        GELU fused, ``target`` a shared-input group of its own); else None: the caller
        shrinks it."""
        return self._expand(layer, outs, True, target)

    def _expand(
        self,
        layer: int,
        outs: Sequence[tuple[Any, str, torch.Tensor]],
        gelu_last: bool,
        shrink_after: str | None = None,
    ) -> tuple[list[torch.Tensor], Shrunk | None]:
        kernels, bank = self.kernels, self.bank
        fused = kernels is not None and all(
            isinstance(s, Shrunk) and (s.parts or t not in bank.a) and _rows(o) is not None
            for s, t, o in outs
        )
        if not fused:
            xs = [(s.x if isinstance(s, Shrunk) else s, t, o) for s, t, o in outs]
            return super().expand(layer, xs, gelu_last), None
        assert kernels is not None
        jobs = [
            self._target(kernels, layer, shrunk, target, _rows(out))
            for shrunk, target, out in outs
            if target in bank.a
        ]
        # The step's kernels take a GELU'd output alone too; the per-slot ones in a pair.
        alone = len(jobs) == 1 and shrink_after is None and self._steps(jobs)
        gelu = gelu_last and outs[-1][1] in bank.a and (len(jobs) >= 2 or alone)
        group = (shrink_after,)
        # The shrink rides the GELU's launch (always a pair: the GELU'd output second).
        fold = gelu and shrink_after is not None and group in bank.a_groups
        if gelu and alone:
            self._expand_pair(kernels, [jobs.pop()], gelu=True)
        elif gelu and len(jobs) % 2:  # the GELU'd output launches second: pair it with one before
            self._expand_pair(kernels, [jobs.pop(0)])
        parts = None
        for i in range(0, len(jobs), 2):
            pair = jobs[i : i + 2]
            if fold and i + 2 == len(jobs):
                a = bank.a_groups[group][:, layer]
                parts = kernels.expand(self.index, *pair, gelu=True, shrink_after=a)
            else:
                self._expand_pair(kernels, pair, gelu=gelu and i + 2 == len(jobs))
        ys = [out for _, _, out in outs]
        if gelu_last and not gelu:
            ys[-1] = gelu_tanh(ys[-1])
        return ys, None if parts is None else Shrunk(ys[-1], {group: parts})

    def expand_sum(
        self, layer: int, terms: Sequence[tuple[Any, str]], out: torch.Tensor
    ) -> torch.Tensor:
        """On the kernel path, the deltas added into ``out`` in place, two per launch (their
        sum rounded once); elsewhere target by target."""
        kernels, bank = self.kernels, self.bank
        terms = [(s, t) for s, t in terms if t in bank.a]
        flat = _rows(out)
        fused = (
            kernels is not None
            and flat is not None
            and all(isinstance(s, Shrunk) and s.parts for s, _ in terms)
        )
        if not fused:
            xs = [(s.x if isinstance(s, Shrunk) else s, t) for s, t in terms]
            return super().expand_sum(layer, xs, out)
        assert kernels is not None and flat is not None
        jobs = [self._target(kernels, layer, s, t, flat) for s, t in terms]
        for i in range(0, len(jobs), 2):
            pair = jobs[i : i + 2]
            self._expand_pair(kernels, pair, same_out=len(pair) == 2)
        return out

    def delta_sum(
        self, layer: int, terms: Sequence[tuple[Shrunk, str]], width: int
    ) -> torch.Tensor | None:
        """The deltas of ``terms`` summed, alone: [T, width] fp32 (zeros on rows without an
        adapter), one launch of the step's kernels; None where they do not take it."""
        kernels = self.kernels
        terms = [(s, t) for s, t in terms if t in self.bank.a]
        if kernels is None or len(terms) != 2 or not all(s.parts for s, _ in terms):
            return None
        rows = self.index.shape[0]
        out = torch.empty(rows, width, dtype=torch.float32, device=self.index.device)
        jobs = [self._target(kernels, layer, s, t, out) for s, t in terms]
        if not self._steps(jobs):
            return None
        assert self.step is not None
        self.step.expand(self.index, *jobs, same_out=True, add=False)
        return out

    def step_fits(self, x: torch.Tensor, shrunk: Shrunk) -> bool:
        """Whether the step's kernels take the expands of ``shrunk`` (a shrink of ``x``)."""
        rows = x.numel() // x.shape[-1]
        step = self.step
        parts = shrunk.parts.values()
        return step is not None and bool(parts) and step.fits(rows, *parts)

    def _steps(self, jobs: Sequence[Any]) -> bool:
        """Whether the step's kernels take these expand targets."""
        step = self.step
        t = jobs[0].out.shape[0]
        return step is not None and step.fits(t, *(job.partials for job in jobs))

    def _expand_pair(
        self, kernels: ModuleType, pair: list[Any], gelu: bool = False, same_out: bool = False
    ) -> None:
        """One expand launch: the step's kernels where the step fits them."""
        module = self.step if self._steps(pair) else kernels
        assert module is not None
        module.expand(self.index, *pair, gelu=gelu, same_out=same_out)

    def _target(
        self, kernels: ModuleType, layer: int, shrunk: Shrunk, target: str, out: torch.Tensor
    ) -> Any:
        """The kernels' view of one output: ``target``'s columns of its group's partials."""
        group, i = self.bank.group_of[target]
        b = self.bank.b[target][:, layer]
        return kernels.Target(shrunk.parts[group], i * self.bank.max_rank, b, out)

    def expert_delta(
        self,
        layer: int,
        target: str,
        x: torch.Tensor,
        experts: torch.Tensor,
        tokens: torch.Tensor,
    ) -> torch.Tensor | None:
        """Rows of (token, expert) pairs of an expert layer (models/lora/spec.py)."""
        return self.bank.expert_delta(self.index, layer, target, x, experts, tokens)


def _rows(out: torch.Tensor) -> torch.Tensor | None:
    """``out`` [..., N] as rows [T, N] of unit column stride without a copy (a column slice of
    a wider product too), or None."""
    if out.stride(-1) != 1:
        return None
    try:
        return out.view(-1, out.shape[-1])
    except RuntimeError:
        return None


def _grouped_kernel() -> ModuleType | None:
    """The Triton kernels' module, or None without Triton."""
    from vlm_server.models.common import lora_kernel

    return lora_kernel if lora_kernel.AVAILABLE else None


def _step_kernel() -> ModuleType | None:
    """The decode step's Triton kernels' module, or None without Triton."""
    from vlm_server.models.common import lora_step

    return lora_step if lora_step.AVAILABLE else None


def per_token(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    index: torch.Tensor,
    kernels: ModuleType | None,
) -> torch.Tensor:
    """The delta alone: the grouped Triton kernels where given, else the masked PyTorch
    products."""
    if kernels is not None:
        return kernels.grouped_lora(x, a, b, index)
    return masked_lora(x, a, b, index)


def segmented_lora(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, length: int
) -> torch.Tensor:
    """``x`` [k * length, in] in ``k`` runs, run ``j`` with slot ``slots[j]`` (-1: none):
    each run's weights gathered (small: [r, in] and [out, r]), then two batched products.
    No host sync (capturable)."""
    k = slots.shape[0]
    pick = slots.clamp(min=0).long()
    v = torch.bmm(x.view(k, length, -1), a[pick].transpose(1, 2))
    y = torch.bmm(v, b[pick].transpose(1, 2))
    y = y * (slots >= 0).to(y.dtype)[:, None, None]
    return y.view(k * length, -1)


def exact_lora(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, index: torch.Tensor, ranks: list[int]
) -> torch.Tensor:
    """Per slot present, its tokens' ``(x @ A^T) @ B^T`` on the slot's own rank, as the
    reference computes it (reads the index on the host)."""
    y = x.new_zeros(x.shape[0], b.shape[1])
    # CPU only (`LoraBatch.add` takes it for CPU tensors): no device to wait for.
    for slot in index.unique().tolist():
        if slot < 0:
            continue
        r = ranks[slot]
        rows = (index == slot).nonzero()[:, 0]
        y[rows] = (x[rows] @ a[slot, :r].T) @ b[slot, :, :r].T
    return y


def masked_lora(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, index: torch.Tensor
) -> torch.Tensor:
    """Every slot's product over every token, each kept where the token uses that slot: no
    host sync (capturable), ``slots`` times the work of the grouped kernel."""
    y = x.new_zeros(x.shape[0], b.shape[1])
    for slot in range(a.shape[0]):
        keep = (index == slot)[:, None].to(x.dtype)
        y = y + keep * ((x @ a[slot].T) @ b[slot].T)
    return y
