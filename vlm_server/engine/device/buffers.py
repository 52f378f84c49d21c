"""The fixed-address buffers of the step pipeline, allocated once, at start-up: a captured
graph reads and writes them by address, and the hot path allocates nothing.

Per pipeline slot (`SlotBuffers`): the pinned buffers the host fills and the device buffers
their copies land in (a decode step's rows and positions, a mixed step's packed inputs, the
finalize rows, the block-table rows), the forward's hidden states, the sampled outputs and
their pinned landing buffer, and the slot's events. Per row (`StepBuffers`): the next input
embedding finalize leaves for the next forward, and the hidden state a riding prompt's prefix
batch keeps for its first sample. Both have one row more than the scheduler's rows: the pad
row that fills graph buckets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.mixed_inputs import MixedLayout
from vlm_server.engine.core.step_layout import N_FIN, N_OUT
from vlm_server.engine.device.streams import Device, Event


@dataclass
class SlotBuffers:
    """Fixed-address buffers of one pipeline slot, allocated once."""

    launch_host: torch.Tensor  # [max_rows, 2] int64: row, position (pinned)
    block_stage: torch.Tensor  # pinned copy of the block-table rows this slot uploads
    launch_dev: torch.Tensor
    # A mixed step's inputs, packed flat as core/mixed_inputs.py lays them out.
    mixed_host: torch.Tensor  # pinned
    mixed_dev: torch.Tensor
    fin_host: torch.Tensor  # [max_rows, N_FIN] int64 (pinned)
    fin_dev: torch.Tensor
    hidden: torch.Tensor  # [max_rows, dim] forward output (pre-norm hidden of the last pos)
    out_dev: torch.Tensor  # [max_rows, N_OUT] float32
    out_host: torch.Tensor  # pinned landing buffer for the D2H copy
    inputs_ready: Event
    mask_ready: Event
    step_done: Event
    d2h_done: Event


@dataclass
class StepBuffers:
    """Both slots' buffers and the per-row device state the steps share."""

    slots: list[SlotBuffers]
    # Each row's next input embedding: finalize writes it, the next forward reads it, so
    # sampled ids and region values never visit the host in between.
    next_embed: torch.Tensor
    # The hidden state of each riding prompt's last token, at its sequence's row: written
    # on the prefill stream, sampled by the sequence's held row in a later step.
    held: torch.Tensor
    pad_row: int  # the extra row: its block-table row stays on the sink page
    # Where a mixed step's inputs sit in a slot's ``mixed_dev``. Tail copies happen when a
    # prompt's first chunk launches, at most one per step row.
    mixed_layout: MixedLayout

    @classmethod
    def allocate(
        cls,
        dev: Device,
        cfg: EngineConfig,
        dim: int,
        dtype: torch.dtype,
        device: torch.device,
        block_shape: tuple[int, ...],
    ) -> StepBuffers:
        """Every buffer, once: ``dim`` is the model's hidden size, ``block_shape`` the block
        table's (the pad row included)."""
        rows = cfg.max_rows + 1
        layout = MixedLayout(rows=rows, max_tails=cfg.max_batch_size)
        mixed_len = layout.size(cfg.max_step_tokens)
        return cls(
            slots=[
                _slot_buffers(dev, i, rows, dim, dtype, device, mixed_len, block_shape)
                for i in range(2)
            ],
            next_embed=dev.buffer("next_embed", zeros((rows, dim), dtype, device)),
            held=dev.buffer("held", zeros((rows, dim), dtype, device)),
            pad_row=cfg.max_rows,
            mixed_layout=layout,
        )


def _slot_buffers(
    dev: Device,
    slot: int,
    rows: int,
    dim: int,
    dtype: torch.dtype,
    device: torch.device,
    mixed_len: int,
    block_shape: tuple[int, ...],
) -> SlotBuffers:
    def host(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return dev.host_buffer(f"slot{slot}.{name}", shape, dtype, slot=slot)

    def on_device(name: str, shape: tuple[int, ...], dtype: torch.dtype, **kw: str) -> torch.Tensor:
        return dev.buffer(f"slot{slot}.{name}", zeros(shape, dtype, device), slot=slot, **kw)

    return SlotBuffers(
        launch_host=host("launch_host", (rows, 2), torch.int64),
        block_stage=host("block_stage", block_shape, torch.int32),
        launch_dev=on_device("launch_dev", (rows, 2), torch.int64),
        mixed_host=host("mixed_host", (mixed_len,), torch.int64),
        mixed_dev=on_device("mixed_dev", (mixed_len,), torch.int64),
        fin_host=host("fin_host", (rows, N_FIN), torch.int64),
        fin_dev=on_device("fin_dev", (rows, N_FIN), torch.int64),
        hidden=on_device("hidden", (rows, dim), dtype),
        # A copy of outputs not yet written waited on the wrong event, or none (I3).
        out_dev=on_device("out_dev", (rows, N_OUT), torch.float32, early_read="I3"),
        out_host=host("out_host", (rows, N_OUT), torch.float32),
        inputs_ready=dev.event(f"slot{slot}.inputs_ready"),
        mask_ready=dev.event(f"slot{slot}.mask_ready"),
        step_done=dev.event(f"slot{slot}.step_done"),
        d2h_done=dev.event(f"slot{slot}.d2h_done"),
    )


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Device memory of a fixed-address buffer, zeroed."""
    return torch.zeros(shape, dtype=dtype, device=device)


def copy_rows(dst: torch.Tensor, src: torch.Tensor, lo: int, hi: int) -> None:
    """Rows ``lo:hi`` of ``src`` into the same rows of ``dst``, without a host wait."""
    dst[lo:hi].copy_(src[lo:hi], non_blocking=True)


def copy_into(dst: torch.Tensor, lo: int, hi: int, src: torch.Tensor) -> None:
    """All of ``src`` into rows ``lo:hi`` of ``dst``, without a host wait."""
    dst[lo:hi].copy_(src, non_blocking=True)
