"""Which adapter slot each token of a forward uses, on the device (per row, and per image of
a prefix batch), and the stacked adapter weights the forwards read.

A sequence keeps its row and its adapter slot for its whole life, so each row's slot lives in
a fixed device buffer (``row_slot``, -1: no adapter; the pad row stays -1): a step's token
index is a gather ``row_slot[rows]`` inside the forward, which CUDA graphs capture. Changed
rows go up, like the block table's, from the launching slot's pinned stage on the copy stream
ahead of the step's inputs (so behind ``inputs_ready``); a row changes only when a new
sequence takes it, which no queued step reads. A prefix batch's images (and the prompts that
ride it) take their job's slot from a small per-prefix-slot buffer sent on the lane's stream.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from vlm_server.engine.device.buffers import copy_rows
from vlm_server.engine.device.streams import Device
from vlm_server.models.lora.bank import LoraBank, LoraBatch


class AdapterRows:
    def __init__(
        self,
        dev: Device,
        bank: LoraBank,
        rows: int,
        prefix_slots: int,
        max_jobs: int,
        prefix_len: int,
        prefix_paths: int = 1,
    ) -> None:
        """``rows``: the scheduler's rows plus the pad row; ``prefix_len``: BOS + image;
        ``prefix_slots``: pinned staging buffers, one a prefix batch in flight (of every
        prefill path); ``prefix_paths``: the device buffers their graphs read, one a prefill
        path (its batches run in order, each copied in ahead of its forward)."""
        self.dev, self.bank, self.prefix_len = dev, bank, prefix_len
        device = bank.device
        self.row_slot = dev.buffer(
            "adapter.row_slot", torch.full((rows,), -1, dtype=torch.int32, device=device)
        )
        self.row_host = np.full(rows, -1, np.int32)  # what row_slot holds (or will, once sent)
        self.stage = [
            dev.host_buffer(f"slot{i}.adapter_stage", (rows,), torch.int32, slot=i)
            for i in range(2)
        ]
        self.job_host = [
            dev.host_buffer(f"prefix{i}.adapter_host", (max_jobs + 1,), torch.int32)
            for i in range(prefix_slots)
        ]
        self.job_dev = [
            dev.buffer(
                f"prefix_path{i}.adapter_dev",
                torch.full((max_jobs + 1,), -1, dtype=torch.int32, device=device),
            )
            for i in range(prefix_paths)
        ]

    # ---- steps ------------------------------------------------------------------------

    def sync_rows(self, slot: int, rows: np.ndarray, slots: np.ndarray) -> None:
        """Enqueue on the copy stream the adapter ``slots`` of a step's ``rows`` that changed
        (new sequences), staged in pipeline slot ``slot``'s pinned buffer."""
        host = self.row_host
        new = host[rows] != slots  # host numpy: no device sync
        if not new.any():
            return
        host[rows[new]] = slots[new]
        changed = rows[new].tolist()  # host numpy too
        lo, hi = min(changed), max(changed) + 1
        stage = self.stage[slot]
        self.dev.host_write(stage, host[lo:hi], start=lo)
        self.dev.copy(
            self.dev.copy_stream,
            "h2d adapter rows",
            partial(copy_rows, self.row_slot, stage, lo, hi),
            lambda: ([stage], [(self.row_slot, changed)]),
        )

    def for_rows(self, rows: torch.Tensor) -> LoraBatch:
        """The adapters of a step's tokens, given each token's row (device gather)."""
        return LoraBatch(self.bank, self.row_slot[rows])

    # ---- prefix batches ---------------------------------------------------------------

    def send_jobs(self, i: int, path: int, slots: list[int], stream: object) -> None:
        """Prefix slot ``i``'s jobs' adapter slots (the rest -1), up on ``stream`` into
        prefill path ``path``'s device buffer."""
        values = np.full(self.job_host[i].shape[0], -1, np.int32)
        values[: len(slots)] = slots
        host, dev_buf = self.job_host[i], self.job_dev[path]
        self.dev.host_write(host, values)
        self.dev.copy(
            stream,
            f"h2d prefix adapters {i}",
            partial(copy_rows, dev_buf, host, 0, len(values)),
            lambda: ([host], [dev_buf]),
        )

    def for_prefix(
        self, i: int, image_of_token: torch.Tensor, prompt_jobs: torch.Tensor | None = None
    ) -> LoraBatch:
        """The adapters of a prefix batch's tokens on prefill path ``i``: each image token its
        job's, then each riding prompt token (``prompt_jobs``: its job) its job's."""
        jobs = self.job_dev[i]
        index = jobs[image_of_token]
        if prompt_jobs is not None:
            index = torch.cat([index, jobs[prompt_jobs]])
        # Each image's tokens are one run of its job's slot: batched products on CUDA.
        k = image_of_token.shape[0] // self.prefix_len
        return LoraBatch(self.bank, index, (jobs[:k], self.prefix_len))
