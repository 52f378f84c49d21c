"""The device side of the engine: KV pools, per-slot buffers, forwards, finalize (mask, sample,
region values, next inputs) and the result copy back to the host.

Contract with the scheduler: every method here only enqueues device work (no host-device
synchronization) except `read_outputs`, which waits for one step's device-to-host copy.
Sampled ids and region values never visit the host before the next forward: finalize writes
each sequence's next input embedding into ``next_embed[row]`` on the device, and the next
forward reads it from there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from decoding.batch_masks import apply_masks
from decoding.mask_table import NO_MASK, MaskTable
from decoding.region_values import coord_from_logits, size_from_logits
from decoding.sampling import sample
from image_pipeline import normalize_crops
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.device import CpuEvent, DeviceStreams
from vlm_server.engine.paged_attention import DecodeKV, PagedKV
from vlm_server.engine.pages import PageAllocator
from vlm_server.engine.sequence import PHASE_BOUNDARY, PHASE_SIZE, PHASE_TOKEN, Sequence
from vlm_server.model import MoondreamModel

# Columns of the per-step finalize input (int64; temperature and top_p bit-cast from float64).
F_ROW, F_MASK, F_PHASE, F_SEED, F_STEP, F_TEMP, F_TOP_P = range(7)
N_FIN = 7
# Columns of the per-step output copied back: token id, coordinate, width, height.
N_OUT = 4


@dataclass
class SlotBuffers:
    """Fixed-address buffers of one pipeline slot, allocated once."""

    launch_host: torch.Tensor  # [max_rows, 2] int64: row, position (pinned)
    block_stage: torch.Tensor  # pinned copy of the block-table rows this slot uploads
    launch_dev: torch.Tensor
    fin_host: torch.Tensor  # [max_rows, N_FIN] int64 (pinned)
    fin_dev: torch.Tensor
    hidden: torch.Tensor  # [max_rows, dim] forward output (pre-norm hidden of the last pos)
    out_dev: torch.Tensor  # [max_rows, N_OUT] float32
    out_host: torch.Tensor  # pinned landing buffer for the D2H copy
    inputs_ready: object
    mask_ready: object
    step_done: object
    d2h_done: object


def graph_buckets(max_batch: int) -> list[int]:
    """Batch sizes with a captured graph: 1, 2, 4, 8, then multiples of 8, up to max_batch."""
    sizes = [n for n in (1, 2, 4) if n < max_batch]
    sizes += list(range(8, max_batch, 8))
    return [*sizes, max_batch]


def triton_available() -> bool:
    from vlm_server.engine import triton_attention

    return triton_attention.AVAILABLE


def kv_page_bytes(model: MoondreamModel, page_size: int) -> int:
    t = model.config.text
    return 2 * t.n_layers * page_size * t.n_kv_heads * t.head_dim * model.dtype.itemsize


class ModelRuntime:
    def __init__(self, model: MoondreamModel, cfg: EngineConfig, table: MaskTable) -> None:
        self.model = model
        self.cfg = cfg
        self.device = model.device
        self.dtype = model.dtype
        self.streams = DeviceStreams(self.device)
        tc = model.config.text
        self.contract = model.config.tokens
        budget = cfg.kv_budget_bytes or self._default_budget()
        n_pages = max(2, budget // kv_page_bytes(model, cfg.page_size))
        shape = (n_pages, cfg.page_size, tc.n_kv_heads, tc.head_dim)
        self.k_pools = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(tc.n_layers)
        ]
        self.v_pools = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(tc.n_layers)
        ]
        rows, max_pages = cfg.max_rows, -(-tc.max_context // cfg.page_size)
        # One extra row pads graph buckets: its block-table row stays on the sink page.
        self.pad_row = rows
        self.block_host = self.streams.host_buffer((rows + 1, max_pages), torch.int32)
        self.block_dev = torch.zeros((rows + 1, max_pages), dtype=torch.int32, device=self.device)
        self.pages = PageAllocator(
            n_pages, cfg.page_size, rows, max_pages, block_table=self.block_host.numpy()[:rows]
        )
        self.next_embed = torch.zeros(rows + 1, tc.dim, dtype=self.dtype, device=self.device)
        self.slots = [self._slot_buffers(rows + 1, tc.dim) for _ in range(2)]
        self.use_triton = self.streams.is_cuda and triton_available()
        self.buckets = graph_buckets(cfg.max_batch)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.vision_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        # Benchmarks set these lists to collect (start, end) device events of each forward
        # and each finalize, in launch order; None in production (no events recorded).
        self.forward_events: list[tuple[str, object, object]] | None = None
        self.finalize_events: list[tuple[object, object]] | None = None
        self.table = table
        self.table_dev = torch.ones(
            (table.max_rows, table.width), dtype=torch.bool, device=self.device
        )

    # ---- setup ------------------------------------------------------------------------

    def _default_budget(self) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * 0.4)
        return 256 << 20

    def _slot_buffers(self, rows: int, dim: int) -> SlotBuffers:
        s, dev = self.streams, self.device
        return SlotBuffers(
            launch_host=s.host_buffer((rows, 2), torch.int64),
            block_stage=s.host_buffer(tuple(self.block_host.shape), torch.int32),
            launch_dev=torch.zeros((rows, 2), dtype=torch.int64, device=dev),
            fin_host=s.host_buffer((rows, N_FIN), torch.int64),
            fin_dev=torch.zeros((rows, N_FIN), dtype=torch.int64, device=dev),
            hidden=torch.zeros((rows, dim), dtype=self.dtype, device=dev),
            out_dev=torch.zeros((rows, N_OUT), dtype=torch.float32, device=dev),
            out_host=s.host_buffer((rows, N_OUT), torch.float32),
            inputs_ready=s.event(),
            mask_ready=s.event(),
            step_done=s.event(),
            d2h_done=s.event(),
        )

    # ---- host-to-device uploads (copy stream, ordered by events) -------------------------

    def _upload_block_table(self, buf: SlotBuffers) -> None:
        rows = self.pages.take_dirty()
        if rows:
            lo, hi = rows[0], rows[-1] + 1  # one copy covering every dirty row
            # Staged per slot: the host mirror may change again while this copy is queued,
            # the slot's stage only after the commit that frees the slot.
            buf.block_stage[lo:hi] = self.block_host[lo:hi]
            self.block_dev[lo:hi].copy_(buf.block_stage[lo:hi], non_blocking=True)

    def _upload_table_rows(self) -> None:
        # New and rewritten (reclaimed) rows alike: the table hands out each dirty row once.
        for first, dense in self.table.take_dirty_runs():
            rows = torch.from_numpy(dense)
            if self.streams.is_cuda:
                rows = rows.pin_memory()  # a pageable source would make the copy block
            self.table_dev[first : first + len(rows)].copy_(rows, non_blocking=True)

    # ---- forwards ---------------------------------------------------------------------

    @torch.inference_mode()
    def launch_decode(self, slot: int, seqs: list[Sequence]) -> None:
        """Enqueue one decode forward for ``seqs`` (row order = batch order). With graphs on,
        the batch is padded to its bucket with the pad row and the bucket's graph replays."""
        buf, st = self.slots[slot], self.streams
        b = len(seqs)
        n = self._bucket(b) if self.graphs else b
        host = buf.launch_host.numpy()
        max_pos = 0
        for i, seq in enumerate(seqs):
            pos = seq.next_position()
            host[i, 0], host[i, 1] = seq.row, pos
            max_pos = max(max_pos, pos)
        host[b:n, 0], host[b:n, 1] = self.pad_row, 0
        with st.on(st.copy):
            self._upload_block_table(buf)
            buf.launch_dev[:n].copy_(buf.launch_host[:n], non_blocking=True)
            buf.inputs_ready.record()
        st.wait(st.compute, buf.inputs_ready)
        with st.on(st.compute):
            start = self._mark()
            graph = self.graphs.get((slot, n)) if self.graphs else None
            if graph is not None:
                graph.replay()
            else:
                self._decode_forward(buf, n, max_pos // self.cfg.page_size + 1)
            if self.forward_events is not None:
                self.forward_events.append(("decode", start, self._mark()))

    def _decode_forward(self, buf: SlotBuffers, n: int, n_blocks: int) -> None:
        rows, pos = buf.launch_dev[:n, 0], buf.launch_dev[:n, 1:2]
        text = self.model.text
        kv = DecodeKV(
            self.k_pools,
            self.v_pools,
            self.block_dev,
            rows,
            n_blocks,
            (text.rope_cos, text.rope_sin),
            text.cfg.n_heads,
            self.use_triton,
        )
        x = self.next_embed[rows][:, None]
        buf.hidden[:n] = self.model.text(x, pos, kv)[:, -1]

    def _bucket(self, b: int) -> int:
        for size in self.buckets:
            if size >= b:
                return size
        raise ValueError(f"batch {b} exceeds the largest graph bucket {self.buckets[-1]}")

    @torch.inference_mode()
    def capture_graphs(self, progress: bool = True) -> None:
        """Capture the decode forward per (slot, batch bucket), largest first, in one memory
        pool. CUDA only; the CPU keeps running the same forward eagerly."""
        if not self.streams.is_cuda:
            return
        from tqdm import tqdm

        pool = torch.cuda.graph_pool_handle()
        max_blocks = self.block_dev.shape[1]
        todo = [(slot, n) for n in sorted(self.buckets, reverse=True) for slot in (0, 1)]
        graphs = {}
        torch.cuda.synchronize(self.device)  # start-up only: buffers made on other streams
        for slot, n in tqdm(todo, desc="capturing decode graphs", disable=not progress):
            buf = self.slots[slot]
            with torch.cuda.stream(self.streams.compute):
                buf.launch_dev[:n, 0] = self.pad_row
                buf.launch_dev[:n, 1] = 0
                self._decode_forward(buf, n, max_blocks)  # warm-up: kernels compiled, no alloc
            self.streams.compute.synchronize()  # start-up only: capture needs a quiet stream
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=self.streams.compute):
                self._decode_forward(buf, n, max_blocks)
            graphs[(slot, n)] = graph
        self.graphs = graphs

    @torch.inference_mode()
    def launch_prefill(
        self, slot: int, seqs: list[Sequence], image_for: dict[int, torch.Tensor | None]
    ) -> None:
        """Enqueue the prefill of ``seqs``: vision (batched over all new images' crops), image
        prefixes not yet cached, then each prompt; the last hidden state goes to the slot."""
        buf, st, m = self.slots[slot], self.streams, self.model
        with st.on(st.copy):
            self._upload_block_table(buf)
            buf.inputs_ready.record()
        st.wait(st.compute, buf.inputs_ready)
        with st.on(st.compute):
            start = self._mark()
            prefixes = self._image_prefixes(seqs, image_for)
            if prefixes:
                self._prefill_prefixes([seqs[i] for i in prefixes], list(prefixes.values()))
            for i, seq in enumerate(seqs):
                if seq.prefix is not None and seq.prefix.tail_page is not None:
                    tail, own = seq.prefix.tail_page, seq.own_pages[0]
                    for kp, vp in zip(self.k_pools, self.v_pools, strict=True):
                        kp[own].copy_(kp[tail])
                        vp[own].copy_(vp[tail])
                first = seq.prefix_len
                # Only the pages holding positions before the end of the prompt are visible.
                visible = self.pages.pages_for(first + len(seq.prompt))
                pages = ((seq.prefix.full_pages if seq.prefix else []) + seq.own_pages)[:visible]
                ids = self._h2d(seq.prompt)
                pos = torch.arange(first, first + len(seq.prompt), device=self.device)[None]
                kv = PagedKV(self.k_pools, self.v_pools, self._h2d(pages)[None], seq.prefix_len)
                buf.hidden[i] = m.text(m.text.embed(ids)[None], pos, kv)[0, -1]
            if self.forward_events is not None:
                self.forward_events.append(("prefill", start, self._mark()))

    def _h2d(self, values: list[int]) -> torch.Tensor:
        """Small host list -> device tensor through pinned memory, without a host wait."""
        host = torch.tensor(values, dtype=torch.int64, pin_memory=self.streams.is_cuda)
        return host.to(self.device, non_blocking=True)

    def _image_prefixes(
        self, seqs: list[Sequence], image_for: dict[int, torch.Tensor | None]
    ) -> dict[int, torch.Tensor]:
        """BOS + image embeddings for the sequences whose prefix must be computed."""
        todo = [i for i, s in enumerate(seqs) if s.prefix is not None and not s.prefix_hit]
        if not todo:
            return {}
        m = self.model
        crops = [image_for[i] for i in todo]
        counts = [c.shape[0] for c in crops]
        pin = self.streams.is_cuda  # a pageable source would make the copy block the host
        normalized = [
            normalize_crops(
                (c.pin_memory() if pin else c).to(self.device, non_blocking=True), self.dtype
            )
            for c in crops
        ]
        out = {}
        if self.vision_graphs:
            # One graph replay per image (captured per crop count); counts without a graph
            # (extreme aspect ratios) run eagerly.
            for i, x in zip(todo, normalized, strict=True):
                f = self._encode_graphed(x)
                out[i] = m.prefix_embeddings(m.vision.project(f, seqs[i].request.image.tiling))
            return out
        feats = m.vision.encode(torch.cat(normalized))
        for i, f in zip(todo, feats.split(counts), strict=True):
            out[i] = m.prefix_embeddings(m.vision.project(f, seqs[i].request.image.tiling))
        return out

    def _encode_graphed(self, crops: torch.Tensor) -> torch.Tensor:
        entry = self.vision_graphs.get(crops.shape[0])
        if entry is None:
            return self.model.vision.encode(crops)
        graph, static_in, static_out = entry
        static_in.copy_(crops)
        graph.replay()
        return static_out  # read before the next replay: the caller projects it right away

    @torch.inference_mode()
    def capture_vision_graphs(self, progress: bool = True) -> None:
        """Capture the vision tower once per crop count of a single image (1 + h*w tiles up
        to max_crops), largest first, in one memory pool. CUDA only."""
        if not self.streams.is_cuda:
            return
        from tqdm import tqdm

        vc = self.model.config.vision
        pool = torch.cuda.graph_pool_handle()
        counts = sorted(
            {
                1 + h * w
                for h in range(1, vc.max_crops + 1)
                for w in range(1, vc.max_crops + 1)
                if h * w <= vc.max_crops
            },
            reverse=True,
        )
        torch.cuda.synchronize(self.device)  # start-up only
        graphs = {}
        for n in tqdm(counts, desc="capturing vision graphs", disable=not progress):
            static_in = torch.zeros(
                (n, vc.in_channels, vc.crop_size, vc.crop_size),
                dtype=self.dtype,
                device=self.device,
            )
            with torch.cuda.stream(self.streams.compute):
                self.model.vision.encode(static_in)  # warm-up outside the capture
            self.streams.compute.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=self.streams.compute):
                static_out = self.model.vision.encode(static_in)
            graphs[n] = (graph, static_in, static_out)
        self.vision_graphs = graphs

    def _prefill_prefixes(self, seqs: list[Sequence], embs: list[torch.Tensor]) -> None:
        """BOS + image of several new images in one forward, straight into their cache
        entries' pages. The prefix sees only itself, both ways, so attention needs no mask
        (the fused attention kernels apply)."""
        n = seqs[0].prefix_len
        rows = torch.stack([self._h2d(s.prefix.pages) for s in seqs])  # type: ignore[union-attr]
        kv = PagedKV(self.k_pools, self.v_pools, rows, n, fresh_prefix=True)
        pos = torch.arange(n, device=self.device)[None].expand(len(seqs), n)
        self.model.text(torch.cat(embs), pos, kv)

    # ---- finalize: masks, sampling, region values, next inputs, D2H ---------------------

    @torch.inference_mode()
    def finalize(
        self,
        slot: int,
        seqs: list[Sequence],
        fin: np.ndarray,
        constrained: bool,
        regions: bool,
        greedy: bool = False,
    ) -> None:
        """Sample the step in ``slot``. ``fin`` [B, N_FIN] was filled from committed state;
        ``greedy`` says every row is at temperature 0."""
        buf, st, m = self.slots[slot], self.streams, self.model
        b = len(seqs)
        buf.fin_host.numpy()[:b] = fin
        with st.on(st.copy):
            if constrained:
                self._upload_table_rows()
            buf.fin_dev[:b].copy_(buf.fin_host[:b], non_blocking=True)
            buf.mask_ready.record()
        st.wait(st.compute, buf.mask_ready)
        with st.on(st.compute):
            start = self._mark()
            fin_dev = buf.fin_dev[:b]
            floats = fin_dev.view(torch.float64)
            h = buf.hidden[:b]
            logits = m.text.logits(h)
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
            nxt = m.text.embed(tokens)
            if regions:
                coord = coord_from_logits(m.region.decode_coord(h))
                size = size_from_logits(m.region.decode_size(h), self.contract.size_scale)
                out[:, 1:2] = coord
                out[:, 2:4] = size
                is_size = (phase == PHASE_SIZE)[:, None]
                is_token = (phase == PHASE_TOKEN)[:, None]
                region_emb = torch.where(
                    is_size, m.region.encode_size(size), m.region.encode_coord(coord)
                )
                nxt = torch.where(is_token, nxt, region_emb)
            self.next_embed[fin_dev[:, F_ROW]] = nxt.to(self.dtype)
            if self.finalize_events is not None:
                self.finalize_events.append((start, self._mark()))
            buf.step_done.record()
        st.wait(st.copy, buf.step_done)
        with st.on(st.copy):
            buf.out_host[:b].copy_(out, non_blocking=True)
            buf.d2h_done.record()

    def _mark(self) -> object:
        """A timing event on the current stream, only while a benchmark collects them."""
        if self.forward_events is None:
            return None
        event = torch.cuda.Event(enable_timing=True) if self.streams.is_cuda else CpuEvent()
        event.record()
        return event

    def read_outputs(self, slot: int, b: int) -> np.ndarray:
        """Wait for the slot's D2H copy (the scheduler's one intended sync) and view it."""
        buf = self.slots[slot]
        if not isinstance(buf.d2h_done, CpuEvent):
            buf.d2h_done.synchronize()  # the tick's single wait: this step's results
        return buf.out_host.numpy()[:b]

    def release_row(self, row: int) -> None:
        self.pages.clear(row)


__all__ = ["NO_MASK", "PHASE_BOUNDARY", "ModelRuntime", "kv_page_bytes"]
