"""The forwards of the pipeline's steps, on the compute stream.

A decode-only step runs one token per row (graph-captured per batch bucket on CUDA); a mixed
step (core/step_plan.py) runs one forward over a ragged batch of decode rows and prompt
chunks (graph-captured per token-count bucket, the batch padded by pad tokens;
core/mixed_inputs.py gives the input layout). Either way the step's inputs go up from the
slot's pinned buffer in one copy, behind the block-table rows the scheduler changed since the
last launch, and the compute stream waits for that copy on the device (``inputs_ready``),
never the host. Each row's last hidden state lands in the slot's ``hidden`` for finalize.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.observer import Observer
from vlm_server.engine.core.step_inputs import StepInputs
from vlm_server.engine.core.step_plan import HELD, N_TOK, T_ID, T_POS, T_ROW
from vlm_server.engine.device.adapter_rows import AdapterRows
from vlm_server.engine.device.buffers import SlotBuffers, StepBuffers, copy_rows
from vlm_server.engine.device.graphs import GraphSet, bucket, graph_buckets, token_buckets
from vlm_server.engine.device.kv_pool import KVPool
from vlm_server.engine.device.model_entry import ModelEntryPoints
from vlm_server.engine.device.spatial_refs import SpatialRefSlots
from vlm_server.engine.device.streams import Device, timing_mark
from vlm_server.models.common import launch_overlap


class StepForwards:
    """Launches the decode and mixed forwards, and holds their graphs."""

    def __init__(
        self,
        dev: Device,
        entry: ModelEntryPoints,
        cfg: EngineConfig,
        pool: KVPool,
        buffers: StepBuffers,
        observer: Observer,
        refs: SpatialRefSlots,
        adapters: AdapterRows | None = None,
    ) -> None:
        self.dev, self.entry, self.pool, self.buffers = dev, entry, pool, buffers
        self.adapters = adapters  # each row's adapter slot; None: adapters are off
        self.observer = observer
        self.refs = refs
        self.page_size = cfg.page_size
        self.max_step_tokens = cfg.max_step_tokens
        self.buckets = graph_buckets(cfg.max_batch_size)
        self.token_buckets = token_buckets(cfg.max_step_tokens)
        self.decode_graphs: GraphSet[tuple[int, int]] = GraphSet("decode")
        # The same forwards with their kernels launched early (models/common/launch_overlap.py),
        # captured where early launches are on for idle prefill only. A decode step takes them
        # when `prefill_busy` says no image prefill is in flight; a mixed step also beside
        # batches in the SM partition (`prefill_contends`: none has the whole GPU). Mixed
        # steps beside a prefix are the streams' slowest gaps, and few enough that their early
        # programs cost the partitioned image path little (docs/performance.md).
        self.early_decode_graphs: GraphSet[tuple[int, int]] = GraphSet("decode (early launches)")
        self.capture_early = False
        self.prefill_busy: Callable[[], bool] = lambda: True
        self.prefill_contends: Callable[[], bool] = lambda: True
        self.early_steps = 0  # decode steps launched from the early-launch graphs
        self.early_mixed_steps = 0  # mixed steps launched from them
        self.mixed_graphs: GraphSet[tuple[int, int]] = GraphSet("mixed step")
        self.early_mixed_graphs: GraphSet[tuple[int, int]] = GraphSet("mixed step (early launches)")
        # With adapters on, the same forwards with the adapters' deltas: a step runs them
        # only when one of its rows uses an adapter, so the others pay nothing for LoRA.
        self.lora_decode_graphs: GraphSet[tuple[int, int]] = GraphSet("decode (adapters)")
        self.lora_mixed_graphs: GraphSet[tuple[int, int]] = GraphSet("mixed step (adapters)")
        # Host scratch the inputs are packed in before they go to a slot's pinned buffer.
        self.launch_rows = np.zeros((buffers.pad_row + 1, 2), np.int64)
        self.mixed_scratch = np.zeros(buffers.mixed_layout.size(cfg.max_step_tokens), np.int64)

    # ---- decode -----------------------------------------------------------------------

    def launch_decode(self, slot: int, step: StepInputs) -> None:
        """Enqueue one decode forward of ``step``'s rows (row order = batch order). With graphs
        on, the batch is padded to its bucket with the pad row and the bucket's graph replays."""
        buf, dev, pad_row = self.buffers.slots[slot], self.dev, self.buffers.pad_row
        b = step.n_rows
        n = self.bucket(b) if self.decode_graphs else b
        host = self.launch_rows
        host[:b] = step.tokens[:, T_ROW : T_POS + 1]  # row | position: adjacent columns
        host[b:n, 0], host[b:n, 1] = pad_row, 0
        n_blocks = int(host[:b, 1].max()) // self.page_size + 1
        self._send_inputs(slot, buf.launch_host, buf.launch_dev, host[:n], step.block_rows)
        block_dev, next_embed = self.pool.block_dev, self.buffers.next_embed
        adapters = self.adapters

        def access() -> tuple[list, list]:
            # Host numpy only, and only the fake device calls it: no device sync here.
            rows = host[:b, 0].tolist()
            reads = [buf.launch_dev, (block_dev, rows), (next_embed, rows)]
            if adapters is not None:
                reads.append((adapters.row_slot, rows))
            return reads, [buf.hidden]

        lora = self.uses_lora(step)
        # Decided at launch: whether a prefill is in flight now (an event query, no sync).
        early = not lora and (slot, n) in self.early_decode_graphs and not self.prefill_busy()
        self.early_steps += early
        dev.kernel(
            dev.compute_stream,
            f"decode slot{slot}",
            partial(self._decode_step, slot, n, n_blocks, lora, early),
            access,
        )

    def _decode_step(self, slot: int, n: int, n_blocks: int, lora: bool, early: bool) -> None:
        start = timing_mark(self.observer, self.dev)
        if early:
            graphs = self.early_decode_graphs
        else:
            graphs = self.lora_decode_graphs if lora else self.decode_graphs
        if (slot, n) in graphs:
            graphs.replay((slot, n))
        else:
            self.decode_forward(self.buffers.slots[slot], n, n_blocks, lora)
        if start is not None:
            self.observer.forward_timed("decode", start, timing_mark(self.observer, self.dev))

    def decode_forward(self, buf: SlotBuffers, n: int, n_blocks: int, lora: bool = True) -> None:
        """The decode forward of the slot's first ``n`` rows (graph-capturable); ``lora``:
        with the rows' adapters (when adapters are on)."""
        rows, pos = buf.launch_dev[:n, 0], buf.launch_dev[:n, 1:2]
        kv = self.pool.decode_view(rows, n_blocks)
        x = self.buffers.next_embed[rows][:, None]
        deltas = self.adapters.for_rows(rows) if self.adapters and lora else None
        buf.hidden[:n] = self.entry.text_forward(x, pos, kv, deltas)[:, -1]

    def uses_lora(self, step: StepInputs) -> bool:
        """Whether ``step`` needs the adapters' deltas: a row uses an adapter."""
        return self.adapters is not None and step.uses_adapters()

    def bucket(self, b: int) -> int:
        """The batch bucket of ``b`` rows (also the sampling graphs')."""
        size = bucket(self.buckets, b)
        if size is None:
            raise ValueError(f"batch {b} exceeds the largest graph bucket {self.buckets[-1]}")
        return size

    def token_bucket(self, t: int) -> int:
        size = bucket(self.token_buckets, t)
        if size is None:
            raise ValueError(f"{t} tokens exceed the step budget {self.max_step_tokens}")
        return size

    # ---- mixed ------------------------------------------------------------------------

    def launch_mixed(self, slot: int, step: StepInputs, after: object | None = None) -> None:
        """Enqueue one mixed step: the cached prefix tail pages copied into the rows starting
        their prompt, then one forward over the ragged token batch.

        Everything the device work needs from the host (the token layout, pages) comes in
        ``step``, values the scheduler built at launch. With ``after`` (a prefix batch's
        handle) the step waits on the device for that batch: its held rows may be sampled
        before the host saw the prefixes finish."""
        buf, dev = self.buffers.slots[slot], self.dev
        tokens, last, tails = step.tokens, step.last, step.tails
        t = len(tokens)
        if t > self.max_step_tokens:
            raise ValueError(f"{t} tokens exceed the step budget {self.max_step_tokens}")
        # A step of held rows only (prompts that ran with their prefix) runs no forward.
        n = self.token_bucket(t) if self.mixed_graphs and t else t
        n_blocks = int(tokens[:, T_POS].max()) // self.page_size + 1 if t else 0
        held_rows = [HELD - h for h in last.tolist() if h <= HELD]  # host numpy: no sync
        for row, values in step.ref_writes:  # its references' embeddings, before its forward
            self.refs.write(row, values)
        lay, pad_row = self.buffers.mixed_layout, self.buffers.pad_row
        values = lay.pack(self.mixed_scratch, tokens, last, tails, n, pad_row)
        if self.adapters:  # a new sequence's first step: its row's adapter goes up first
            self.adapters.sync_rows(slot, step.rows, step.adapter_slots)
        self._send_inputs(slot, buf.mixed_host, buf.mixed_dev, values, step.block_rows)
        if after is not None:  # held rows of a prefix batch still running: a device wait
            dev.wait(dev.compute_stream, after)
        pool, bufs = self.pool, self.buffers

        def access() -> tuple[list, list]:
            # Host numpy only, and only the fake device calls it: no device sync here.
            rows = sorted(set(tokens[:, T_ROW].tolist()))
            decode_rows = tokens[: step.n_decode, T_ROW].tolist()
            reads = [
                buf.mixed_dev,
                (pool.block_dev, rows),
                (bufs.next_embed, decode_rows),
                (pool.kv, step.prefix_pages),
                (bufs.held, held_rows),
                (self.refs.embeds, self.refs.rows_of(step.ref_rows)),
            ]
            if self.adapters is not None:
                reads.append((self.adapters.row_slot, rows))
            return reads, [buf.hidden]

        lora = self.uses_lora(step)
        early = not lora and (slot, n) in self.early_mixed_graphs and not self.prefill_contends()
        self.early_mixed_steps += early
        dev.kernel(
            dev.compute_stream,
            f"mixed slot{slot}",
            partial(self.mixed_step, slot, len(tails), t, n, n_blocks, lora, early),
            access,
        )

    def mixed_step(
        self,
        slot: int,
        n_tails: int,
        t: int,
        n: int,
        n_blocks: int,
        lora: bool = True,
        early: bool = False,
    ) -> None:
        """The device work of a launched mixed step (``t`` tokens padded to ``n``; ``early``:
        from the early-launch graphs)."""
        buf, lay = self.buffers.slots[slot], self.buffers.mixed_layout
        start = timing_mark(self.observer, self.dev)
        if n_tails:
            at = lay.tails_at
            # Every layer's keys and values of the tail pages, in one gather and one scatter.
            self.pool.copy_pages(buf.mixed_dev[at : at + 2 * n_tails].view(n_tails, 2))
        if not n:
            last = buf.mixed_dev[: lay.rows]
            buf.hidden[: len(last)] = self._held_states(last)
        elif early:
            self.early_mixed_graphs.replay((slot, n))
        elif (slot, n) in (graphs := self.lora_mixed_graphs if lora else self.mixed_graphs):
            graphs.replay((slot, n))
        else:
            self.mixed_forward(buf, n, n_blocks, lora)
        if start is not None:
            self.observer.forward_timed("mixed", start, timing_mark(self.observer, self.dev))

    def mixed_forward(self, buf: SlotBuffers, n: int, n_blocks: int, lora: bool = True) -> None:
        """The token forward of a mixed step over the slot's ``n`` (padded) tokens. On CUDA
        every token is a row of the rotary + KV-write kernel, and attention runs per tile of a
        row's consecutive tokens over its pages up to each token's position (causal: every
        prefix was computed before), so no shape depends on the host; elsewhere the PyTorch
        varlen path over the first ``n_blocks`` pages."""
        entry, lay = self.entry, self.buffers.mixed_layout
        tokens = buf.mixed_dev[lay.tokens_at : lay.tiles_at(n)].view(n, N_TOK)
        last = buf.mixed_dev[: lay.rows]
        rows, pos, ids = tokens[:, T_ROW], tokens[:, T_POS], tokens[:, T_ID]
        # Decode rows (id -1) take the input finalize left on the device.
        next_embed = self.buffers.next_embed
        x = torch.where(
            (ids < 0)[:, None], next_embed[rows], self.refs.embed(rows, ids.clamp(min=0))
        )
        x = x.to(entry.dtype)
        deltas = self.adapters.for_rows(rows) if self.adapters and lora else None
        if self.pool.use_triton:
            tiles = buf.mixed_dev[lay.tiles_at(n) : lay.size(n)].view(-1, 2)
            kv = self.pool.token_view(rows, tiles, lay.tile_tokens)
            h = entry.text_forward(x[:, None], pos[:, None], kv, deltas)[:, 0]
        else:
            kv = self.pool.ragged_view(rows, n_blocks)
            h = entry.text_forward(x[None], pos[None], kv, deltas)[0]
        # Rows without a token here (-1) sample nothing: any row's state will do. Held rows
        # take what their prefix batch left.
        held = self._held_states(last)
        buf.hidden[: lay.rows] = torch.where((last <= HELD)[:, None], held, h[last.clamp(min=0)])

    def _held_states(self, last: torch.Tensor) -> torch.Tensor:
        """The kept hidden state of each step row's sequence (``last`` <= HELD; other rows get
        row 0's, which they do not use)."""
        return self.buffers.held[(HELD - last).clamp(min=0)]

    # ---- inputs and graphs ------------------------------------------------------------

    def _send_inputs(
        self,
        slot: int,
        host: torch.Tensor,
        device: torch.Tensor,
        values: np.ndarray,
        block_rows: tuple[int, ...],
    ) -> None:
        """A step's inputs into the slot's pinned buffer and up in one copy, after the dirty
        block-table rows; the compute stream waits for both (inputs_ready), never the host."""
        buf, dev = self.buffers.slots[slot], self.dev
        n = len(values)
        dev.host_write(host, values)
        self.pool.upload_rows(buf.block_stage, block_rows)
        dev.copy(
            dev.copy_stream,
            f"h2d inputs slot{slot}",
            partial(copy_rows, device, host, 0, n),
            lambda: ([host], [device]),
        )
        dev.record(buf.inputs_ready, dev.copy_stream)
        dev.wait(dev.compute_stream, buf.inputs_ready)

    def capture(self, progress: bool) -> None:
        """Capture the decode forward per (slot, batch bucket) and the mixed step's token
        forward per (slot, token bucket), on the compute stream (CUDA only). Pad rows only:
        the warm-up writes the sink page."""
        max_blocks = self.pool.block_dev.shape[1]
        stream, slots, pad_row = self.dev.compute_stream, self.buffers.slots, self.buffers.pad_row

        def prepare_decode(key: tuple[int, int]) -> None:
            slot, n = key
            slots[slot].launch_dev[:n, 0] = pad_row
            slots[slot].launch_dev[:n, 1] = 0

        def run_decode(key: tuple[int, int], lora: bool = False) -> None:
            self.decode_forward(slots[key[0]], key[1], max_blocks, lora)

        keys = [(slot, n) for n in sorted(self.buckets, reverse=True) for slot in (0, 1)]
        self.decode_graphs.capture(keys, prepare_decode, run_decode, stream, progress)
        if self.capture_early:
            with launch_overlap.enabled_within(self.entry.device) as on:
                if on:
                    early = self.early_decode_graphs
                    early.capture(keys, prepare_decode, run_decode, stream, progress)
        if self.adapters is not None:
            run = partial(run_decode, lora=True)
            self.lora_decode_graphs.capture(keys, prepare_decode, run, stream, progress)

        def prepare_mixed(key: tuple[int, int]) -> None:
            slot, t = key
            none = np.zeros((0, N_TOK), np.int64)
            lay = self.buffers.mixed_layout
            host = lay.pack(self.mixed_scratch, none, np.zeros(0, np.int64), [], t, pad_row)
            slots[slot].mixed_dev[: len(host)].copy_(torch.from_numpy(host))

        def run_mixed(key: tuple[int, int], lora: bool = False) -> None:
            self.mixed_forward(slots[key[0]], key[1], max_blocks, lora)

        keys = [(slot, t) for t in sorted(self.token_buckets, reverse=True) for slot in (0, 1)]
        self.mixed_graphs.capture(keys, prepare_mixed, run_mixed, stream, progress)
        if self.capture_early:
            with launch_overlap.enabled_within(self.entry.device) as on:
                if on:
                    early = self.early_mixed_graphs
                    early.capture(keys, prepare_mixed, run_mixed, stream, progress)
        if self.adapters is not None:
            run = partial(run_mixed, lora=True)
            self.lora_mixed_graphs.capture(keys, prepare_mixed, run, stream, progress)
