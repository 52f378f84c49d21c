"""Finalize: masks, sampling, region values and next inputs of a step, and its outputs back
to the host.

``fin`` rows built from committed state go up on the copy stream (after the mask-table rows
the grammars changed); the compute stream waits for them (``mask_ready``), samples from the
slot's hidden states (graph-captured per batch bucket and flags on CUDA), writes each row's
next input embedding on the device and its outputs into the slot's ``out_dev``; the copy
stream waits for that (``step_done``) and copies the outputs into pinned memory, which
`read_outputs` waits for: the tick's one host wait.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from decoding.batch_masks import apply_masks
from decoding.mask_table import NO_MASK, MaskTable
from decoding.sampling import sample
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.observer import Observer
from vlm_server.engine.core.step_layout import (
    F_MASK,
    F_PHASE,
    F_ROW,
    F_SEED,
    F_STEP,
    F_TEMP,
    F_TOP_P,
    N_FIN,
    RowPhase,
)
from vlm_server.engine.device.buffers import SlotBuffers, StepBuffers, copy_into, copy_rows
from vlm_server.engine.device.graphs import GraphSet, bucket, graph_buckets
from vlm_server.engine.device.model_entry import ModelEntryPoints
from vlm_server.engine.device.streams import Device, timing_mark


class Sampler:
    """Finalizes steps into their slots' outputs; holds the mask table's device copy and the
    sampling graphs."""

    def __init__(
        self,
        dev: Device,
        entry: ModelEntryPoints,
        cfg: EngineConfig,
        buffers: StepBuffers,
        table: MaskTable,
        observer: Observer,
    ) -> None:
        self.dev, self.entry, self.buffers, self.observer = dev, entry, buffers, observer
        self.buckets = graph_buckets(cfg.max_batch_size)
        # Masks + sampling per (slot, batch bucket, constrained, regions, greedy).
        self.sample_graphs: GraphSet[tuple[int, int, bool, bool, bool]] = GraphSet("sampling")
        # Finalize input of a bucket's padding rows: the pad row, no mask, greedy.
        self.fin_pad = np.zeros((buffers.pad_row + 1, N_FIN), np.int64)
        self.fin_pad[:, F_ROW] = buffers.pad_row
        self.fin_pad[:, F_PHASE] = RowPhase.TOKEN
        self.fin_pad[:, F_TOP_P] = np.float64(1.0).view(np.int64)
        self.table = table
        self.table_dev = dev.buffer(
            "table_dev",
            torch.ones((table.max_rows, table.width), dtype=torch.bool).to(entry.device),
        )

    def finalize(
        self,
        slot: int,
        fin: np.ndarray,
        constrained: bool,
        regions: bool,
        greedy: bool = False,
    ) -> None:
        """Sample the step in ``slot``. ``fin`` [B, N_FIN] (a row per step row) was filled from
        committed state; ``greedy`` says every row is at temperature 0."""
        buf, dev = self.buffers.slots[slot], self.dev
        b = len(fin)
        # With sampling graphs, the batch is padded to its bucket with harmless rows.
        n = self._bucket(b) if self.sample_graphs else b
        dev.host_write(buf.fin_host, fin)
        if n > b:
            dev.host_write(buf.fin_host, self.fin_pad[: n - b], start=b)
        if constrained:
            self._upload_table_rows()
        dev.copy(
            dev.copy_stream,
            f"h2d fin slot{slot}",
            partial(copy_rows, buf.fin_dev, buf.fin_host, 0, n),
            lambda: ([buf.fin_host], [buf.fin_dev]),
        )
        dev.record(buf.mask_ready, dev.copy_stream)
        dev.wait(dev.compute_stream, buf.mask_ready)
        next_embed = self.buffers.next_embed

        def access() -> tuple[list, list]:
            # Host numpy only, and only the fake device calls it: no device sync here.
            rows = fin[:, F_ROW].tolist()
            masks = sorted(set(fin[:, F_MASK].tolist()) - {NO_MASK})
            reads = [buf.fin_dev, buf.hidden, *([(self.table_dev, masks)] if masks else [])]
            return reads, [buf.out_dev, (next_embed, rows)]

        dev.kernel(
            dev.compute_stream,
            f"sample slot{slot}",
            partial(self._sample_step, slot, n, constrained, regions, greedy),
            access,
        )
        dev.record(buf.step_done, dev.compute_stream)
        dev.wait(dev.copy_stream, buf.step_done)
        dev.copy(
            dev.copy_stream,
            f"d2h outputs slot{slot}",
            partial(copy_rows, buf.out_host, buf.out_dev, 0, b),
            lambda: ([buf.out_dev], [buf.out_host]),
        )
        dev.record(buf.d2h_done, dev.copy_stream)

    def wait_outputs(self, slot: int) -> None:
        """Block the calling thread until the slot's D2H copy landed (a watcher thread's
        wait, the scheduler's stands in `read_outputs`)."""
        self.dev.host_wait(self.buffers.slots[slot].d2h_done)

    def read_outputs(self, slot: int, b: int) -> np.ndarray:
        """Wait for the slot's D2H copy (the scheduler's one intended sync) and view it."""
        buf = self.buffers.slots[slot]
        self.dev.host_wait(buf.d2h_done)  # the tick's single wait: this step's results
        return self.dev.host_read(buf.out_host)[:b]

    def _bucket(self, b: int) -> int:
        size = bucket(self.buckets, b)
        if size is None:
            raise ValueError(f"batch {b} exceeds the largest graph bucket {self.buckets[-1]}")
        return size

    def _upload_table_rows(self) -> None:
        # New and rewritten (reclaimed) rows alike: the table hands out each dirty run once.
        for first, dense in self.table.take_dirty_runs():
            rows = torch.from_numpy(dense)
            if self.dev.is_cuda:
                rows = rows.pin_memory()  # a pageable source would make the copy block
            hi = first + len(dense)
            self.dev.copy(
                self.dev.copy_stream,
                "h2d mask rows",
                partial(copy_into, self.table_dev, first, hi, rows),
                lambda first=first, hi=hi: ([], [(self.table_dev, range(first, hi))]),
            )

    def _sample_step(
        self, slot: int, n: int, constrained: bool, regions: bool, greedy: bool
    ) -> None:
        start = timing_mark(self.observer, self.dev)
        key = (slot, n, constrained, regions, greedy)
        if key in self.sample_graphs:
            self.sample_graphs.replay(key)
        else:
            self.sample(self.buffers.slots[slot], n, constrained, regions, greedy)
        if start is not None:
            self.observer.sample_timed(start, timing_mark(self.observer, self.dev))

    def sample(
        self, buf: SlotBuffers, b: int, constrained: bool, regions: bool, greedy: bool
    ) -> None:
        """Masks and sampling of the slot's first ``b`` rows (static shapes, no host sync:
        graph-capturable)."""
        entry = self.entry
        fin_dev = buf.fin_dev[:b]
        floats = fin_dev.view(torch.float64)
        h = buf.hidden[:b]
        logits = entry.logits(h)
        if constrained:
            logits = apply_masks(logits, fin_dev[:, F_MASK], self.table_dev)
        if greedy:  # every row at temperature 0: what sample() returns, without the sort
            tokens = logits.argmax(dim=-1)
        else:
            tokens = sample(
                logits,
                floats[:, F_TEMP].float(),
                floats[:, F_TOP_P].float(),
                fin_dev[:, F_SEED],
                fin_dev[:, F_STEP],
            )
        phase = fin_dev[:, F_PHASE]
        out = buf.out_dev[:b]
        out[:, 0] = tokens.float()
        nxt = entry.embed(tokens)
        if regions:
            coord = entry.decode_coord(h)
            size = entry.decode_size(h)
            out[:, 1:2] = coord
            out[:, 2:4] = size
            is_size = (phase == RowPhase.SIZE)[:, None]
            # A reasoning row feeds its token back unless it is the coordinate token.
            reasons = (phase == RowPhase.REASON) & (tokens != entry.coord_id)
            is_token = ((phase == RowPhase.TOKEN) | reasons)[:, None]
            region_emb = torch.where(is_size, entry.encode_size(size), entry.encode_coord(coord))
            nxt = torch.where(is_token, nxt, region_emb)
        self.buffers.next_embed[fin_dev[:, F_ROW]] = nxt.to(entry.dtype)

    def capture(self, progress: bool) -> None:
        """Capture masks + sampling per (slot, batch bucket, constrained, regions, greedy) on
        the compute stream (CUDA only), over pad rows."""

        def prepare(key: tuple[int, int, bool, bool, bool]) -> None:
            slot, n = key[0], key[1]
            self.buffers.slots[slot].fin_dev[:n].copy_(torch.from_numpy(self.fin_pad[:n]))

        def run(key: tuple[int, int, bool, bool, bool]) -> None:
            slot, n, constrained, regions, greedy = key
            self.sample(self.buffers.slots[slot], n, constrained, regions, greedy)

        flags = (False, True)
        keys = [
            (slot, n, constrained, regions, greedy)
            for n in sorted(self.buckets, reverse=True)
            for slot in (0, 1)
            for constrained in flags
            for regions in flags
            for greedy in flags
        ]
        self.sample_graphs.capture(keys, prepare, run, self.dev.compute_stream, progress)
