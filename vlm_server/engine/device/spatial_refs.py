"""Each row's spatial-reference embeddings (engine/requests/spatial.py), on the device.

A prompt's reference positions hold placeholder ids (``vocab_size + j``). When the prompt's
first chunk launches, its values go up (pinned staging, one copy) and the model's region
encoders turn them into the row's slots, on the compute stream ahead of that chunk's forward;
the forward's embedding takes slot j wherever it finds placeholder j. Prompts with references
never ride their image prefix's forward (the scheduler keeps them in steps), so only the compute
stream reads the slots.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from vlm_server.engine.device.buffers import copy_rows, zeros
from vlm_server.engine.device.model_entry import ModelEntryPoints
from vlm_server.engine.device.streams import Device
from vlm_server.engine.requests.spatial import N_REF, SIZE


class SpatialRefSlots:
    """``slots`` reference embeddings per sequence row."""

    def __init__(self, dev: Device, entry: ModelEntryPoints, rows: int, slots: int) -> None:
        self.dev, self.entry, self.slots = dev, entry, max(slots, 1)
        n = rows * self.slots
        self.values_host = dev.host_buffer("ref_values_host", (n, N_REF), torch.float32)
        self.values_dev = dev.buffer("ref_values", zeros((n, N_REF), torch.float32, entry.device))
        self.embeds = dev.buffer("ref_embeds", zeros((n, entry.dim), entry.dtype, entry.device))

    def write(self, row: int, values: np.ndarray) -> None:
        """Enqueue the encoding of ``values`` ([k, N_REF], requests/spatial.py) into ``row``'s
        slots on the compute stream (no host wait)."""
        k = len(values)
        if k > self.slots:
            raise ValueError(f"{k} reference positions exceed the row's {self.slots} slots")
        # The reference builds its values in the model's dtype straight from Python floats:
        # round once, from float64, then carry the exact value in float32.
        # Host tensors only: no device sync. A copy, as a step's values are read-only.
        rounded = torch.tensor(values).to(self.entry.dtype).float().numpy()
        lo, hi = row * self.slots, row * self.slots + k
        dev = self.dev
        dev.host_write(self.values_host, rounded, start=lo)
        dev.copy(
            dev.compute_stream,
            "h2d ref values",
            partial(copy_rows, self.values_dev, self.values_host, lo, hi),
            lambda: ([(self.values_host, range(lo, hi))], [(self.values_dev, range(lo, hi))]),
        )
        dev.kernel(
            dev.compute_stream,
            "encode refs",
            partial(self._encode, lo, hi),
            lambda: ([(self.values_dev, range(lo, hi))], [(self.embeds, range(lo, hi))]),
        )

    def _encode(self, lo: int, hi: int) -> None:
        v, entry = self.values_dev[lo:hi], self.entry
        size = (v[:, :1] == SIZE).expand(-1, entry.dim)
        emb = torch.where(size, entry.encode_size(v[:, 1:3]), entry.encode_coord(v[:, 1:2]))
        self.embeds[lo:hi] = emb.to(entry.dtype)

    def embed(self, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings of prompt ids [T] (>= 0) of sequence ``rows`` [T]: token
        embeddings, and the row's slot j at placeholder j (graph-capturable: no host read)."""
        vocab = self.entry.vocab_size
        emb = self.entry.embed(ids.clamp(max=vocab - 1))
        slot = rows * self.slots + (ids - vocab).clamp(0, self.slots - 1)
        return torch.where((ids >= vocab)[:, None], self.embeds[slot].to(emb.dtype), emb)

    def rows_of(self, rows: list[int]) -> list[int]:
        """The slot indices of sequence ``rows`` (the fake device's access lists)."""
        return [r * self.slots + j for r in rows for j in range(self.slots)]
