"""Resident adapters on the device, stacked, and the batched delta over a per-token slot index.

`LoraBank` holds, per target, every slot's weights in one fixed-address buffer (A [slots,
layers, max_rank, in], B [slots, layers, out, max_rank]; a lower rank is zero-padded, which
adds exact zeros), so a captured graph reads whatever adapters the slots hold when it replays.
`LoraBatch` is what a batched forward passes its decoder: the bank and one slot per token (-1:
no adapter). On CUDA the delta is the grouped Triton kernel (models/common/lora_kernel.py:
shrink, then expand, per token, added into the layer's output), and a batch of image prefixes
(runs of hundreds of tokens with one slot each) two batched products over each run's gathered
weights; elsewhere PyTorch: exact per-slot products on the CPU (the reference's arithmetic on
each adapter's own rank), and on CUDA without Triton a masked product per slot, which needs no
host sync and so stays capturable.
"""

from __future__ import annotations

import threading
from types import ModuleType

import torch

from vlm_server.models.lora.spec import AdapterWeights, LoraTargets


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
        L = targets.n_layers
        self.a = {
            t: torch.zeros(n_slots, L, max_rank, n_in, dtype=dtype, device=device)
            for t, (n_in, _) in targets.targets.items()
        }
        self.b = {
            t: torch.zeros(n_slots, L, n_out, max_rank, dtype=dtype, device=device)
            for t, (_, n_out) in targets.targets.items()
        }
        self.ranks = [0] * n_slots  # host copy: the CPU path slices each slot to its rank
        # One slot's worth of host memory (pinned on CUDA), made here, at start, and reused:
        # pinning tens of megabytes per load stalled the running steps (the driver's page
        # locking). Whoever stages holds `stage_lock` until the copy from it completed.
        self.stage_lock = threading.Lock()
        pin = self.device.type == "cuda"
        self._stage = {
            t: (
                torch.empty(L, max_rank, n_in, dtype=dtype, pin_memory=pin),
                torch.empty(L, n_out, max_rank, dtype=dtype, pin_memory=pin),
            )
            for t, (n_in, n_out) in targets.targets.items()
        }

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in (*self.a.values(), *self.b.values()))

    def staging(self, weights: AdapterWeights) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """One slot's worth of ``weights``, padded to the bank's layout, in the bank's one
        host staging buffer (pinned on CUDA, so the copy up is asynchronous). The caller holds
        `stage_lock` from here until the copy from it completed."""
        out = {}
        for t in self.targets.targets:
            a, b = self._stage[t]
            a.zero_()
            b.zero_()
            for layer, pairs in enumerate(weights.pairs):
                if t in pairs:
                    wa, wb = pairs[t]
                    a[layer, : wa.shape[0]] = wa
                    b[layer, :, : wb.shape[1]] = wb
            out[t] = (a, b)
        return out

    def write(
        self, slot: int, staged: dict[str, tuple[torch.Tensor, torch.Tensor]], rank: int
    ) -> None:
        """Copy staged weights into ``slot`` on the current stream (asynchronous from pinned
        memory: the caller records and waits for an event before any forward reads it). The
        caller guarantees no queued forward reads the slot (it is pinned by no row)."""
        for t, (a, b) in staged.items():
            self.a[t][slot].copy_(a, non_blocking=True)
            self.b[t][slot].copy_(b, non_blocking=True)
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


class LoraBatch:
    """The bank and each token's slot (``index`` [T] int32, in the forward's token order;
    -1: none) for one forward. ``segments`` (slots [k], length): the first ``k * length``
    tokens are ``k`` runs of ``length`` tokens, run ``j`` all with slot ``slots[j]`` (a batch
    of image prefixes): on CUDA those run as two batched matrix products over each run's
    gathered weights instead of per token."""

    def __init__(
        self,
        bank: LoraBank,
        index: torch.Tensor,
        segments: tuple[torch.Tensor, int] | None = None,
    ) -> None:
        self.bank, self.index, self.segments = bank, index, segments

    def add(self, layer: int, target: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        bank = self.bank
        if target not in bank.a:
            return out
        flat = x.reshape(-1, x.shape[-1])
        a, b = bank.a[target][:, layer], bank.b[target][:, layer]
        if not flat.is_cuda:
            y = exact_lora(flat, a, b, self.index, bank.ranks)
        elif self.segments is not None:
            slots, length = self.segments
            n = slots.shape[0] * length
            head = segmented_lora(flat[:n], a, b, slots, length)
            tail = per_token(flat[n:], a, b, self.index[n:]) if flat.shape[0] > n else None
            y = head if tail is None else torch.cat([head, tail])
        elif out.is_contiguous() and (kernel := _grouped_kernel()) is not None:
            # The kernel adds into the layer's output: no delta tensor, no separate add.
            kernel.grouped_lora(flat, a, b, self.index, out=out.view(-1, out.shape[-1]))
            return out
        else:
            y = masked_lora(flat, a, b, self.index)
        return out + y.view(out.shape)

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


def _grouped_kernel() -> ModuleType | None:
    """The Triton kernels' module, or None without Triton."""
    from vlm_server.models.common import lora_kernel

    return lora_kernel if lora_kernel.AVAILABLE else None


def per_token(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, index: torch.Tensor
) -> torch.Tensor:
    """The delta alone: the grouped Triton kernel where Triton is, else the masked PyTorch
    products."""
    kernel = _grouped_kernel()
    if kernel is not None:
        return kernel.grouped_lora(x, a, b, index)
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
