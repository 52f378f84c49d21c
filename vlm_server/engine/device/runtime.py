"""The device side of the engine: KV pools, per-slot buffers, forwards, finalize (mask, sample,
region values, next inputs) and the result copy back to the host.

Contract with the scheduler: every method here only enqueues device work (no host-device
synchronization) except `read_outputs`, which waits for one step's device-to-host copy.
Sampled ids and region values never visit the host before the next forward: finalize writes
each sequence's next input embedding into ``next_embed[row]`` on the device, and the next
forward reads it from there.

Two kinds of forward: a decode-only step (one token per row, graph-captured per batch bucket
on CUDA) and a mixed step (core/step_plan.py): one forward over a ragged batch of decode rows
and prompt chunks, graph-captured per token-count bucket with the batch padded by pad tokens
(core/mixed_inputs.py gives the input layout).

New image prefixes are not part of any step: `launch_prefixes` runs the image path (one graph
per tiling) and the BOS + image forward (one graph per number of images) on the prefill
stream, a low-priority stream beside the compute stream, so a new image overlaps the decode
steps instead of lengthening one. Only the prefix's own pages are written there (and those of
the prompts riding the batch, core/prefix_jobs.py, with their last hidden states in ``held``),
and the scheduler launches no step that reads them before `prefix_ready` said the batch
completed, unless the step itself waits for the batch on the device (``after``). With an SM
partition used only while requests stream (``prefill_sms_when_streaming``) there are two
prefill lanes, each with its own graphs; a batch that changes lane waits for the other
lane's last one (``prefill.lane_done``), as both read the same static buffers.

All stream, event, copy and pinned-buffer work goes through a `Device`
(`TorchDevice` in production), so the same code runs on a fake device in the tests. Per step:

    copy    | h2d block rows, inputs | rec inputs_ready | h2d mask rows, fin | rec mask_ready |
    compute |   wait inputs_ready -> forward        wait mask_ready -> sample | rec step_done |
    copy    |   wait step_done -> d2h outputs | rec d2h_done       (host: wait d2h_done, read)
    prefill | h2d prefix pages -> crops -> image paths -> BOS + image forward | rec prefix.done
            (polled by the scheduler; a watcher thread sleeps on it while nothing else runs)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from decoding.batch_masks import apply_masks
from decoding.mask_table import NO_MASK, MaskTable
from decoding.region_values import coord_from_logits, size_from_logits
from decoding.sampling import sample
from image_pipeline import (
    EncodedImage,
    HostImage,
    ImagePreparer,
    PreparedImage,
    normalize_crops,
)
from image_pipeline.crop_graphs import CropGraphs
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.mixed_inputs import MixedLayout
from vlm_server.engine.core.observer import NO_OBSERVER, Observer
from vlm_server.engine.core.pages import PageAllocator
from vlm_server.engine.core.prefix_jobs import PrefixJob, pack_prompts, tail_copies
from vlm_server.engine.core.sequence import Sequence
from vlm_server.engine.core.step_layout import (
    F_MASK,
    F_PHASE,
    F_ROW,
    F_SEED,
    F_STEP,
    F_TEMP,
    F_TOP_P,
    N_FIN,
    N_OUT,
    RowPhase,
)
from vlm_server.engine.core.step_plan import (
    HELD,
    N_TOK,
    T_ID,
    T_POS,
    T_ROW,
    StepPlan,
    pack_tokens,
)
from vlm_server.engine.device.graphs import GraphSet, sm_carveout
from vlm_server.engine.device.kernels.paged_attention import (
    DecodeKV,
    PagedKV,
    PrefixKV,
    PrefixPromptKV,
    RaggedKV,
)
from vlm_server.engine.device.streams import CpuEvent, Device, Event, TorchDevice
from vlm_server.model import MoondreamModel
from vlm_server.model.fp8_vision import fp8_supported

log = logging.getLogger(__name__)


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
class PrefixSlot:
    """Buffers of one batch of image prefixes in flight on the prefill stream."""

    # [max_prefill_batch + 1, pages of prefix + riding prompt] int64 (pinned): each job's
    # pages (core/prefix_jobs.py); the last row stays on the sink page, for pad tokens.
    pages_host: torch.Tensor
    pages_dev: torch.Tensor
    # The riding prompts: each job's held row, then their tokens as core/mixed_inputs.py lays
    # out a step's (the pad row is the sink row above).
    prompt_host: torch.Tensor
    prompt_dev: torch.Tensor
    done: Event


@dataclass
class PrefillLane:
    """A stream new images' prefixes run on, with the graphs captured on it (a graph keeps the
    SM partition of the stream it was captured on, so each lane has its own)."""

    stream: object
    image_graphs: GraphSet[tuple[int, int]]
    prefix_graphs: GraphSet[tuple[int, int, int]]
    crop_graphs: CropGraphs | None


def graph_buckets(max_batch: int) -> list[int]:
    """Batch sizes with a captured graph: 1, 2, 4, 8, then multiples of 8, up to max_batch."""
    sizes = [n for n in (1, 2, 4) if n < max_batch]
    sizes += list(range(8, max_batch, 8))
    return [*sizes, max_batch]


def token_buckets(max_tokens: int, smallest: int = 16) -> list[int]:
    """Token counts with a captured mixed-step graph: about 1.5x apart (16, 24, 32, 48, ...),
    so padding wastes at most a third of a step, up to and including ``max_tokens``."""
    sizes, n = [], smallest
    while n < max_tokens:
        sizes.append(n)
        n = n * 3 // 2 if n & (n - 1) == 0 else n * 4 // 3
    return [*sizes, max_tokens]


def prompt_buckets(max_tokens: int) -> list[int]:
    """Riding-prompt token counts with a captured prefix graph: powers of two from 32, up to
    and including ``max_tokens`` (none when 0)."""
    sizes, n = [], 32
    while n < max_tokens:
        sizes.append(n)
        n *= 2
    return [*sizes, max_tokens] if max_tokens else []


def image_tilings(max_crops: int) -> list[tuple[int, int]]:
    """Every (h, w) tiling of at most ``max_crops`` local crops, most crops first."""
    tilings = [
        (h, w)
        for h in range(1, max_crops + 1)
        for w in range(1, max_crops + 1)
        if h * w <= max_crops
    ]
    return sorted(tilings, key=lambda hw: (-hw[0] * hw[1], hw))


def triton_available() -> bool:
    from vlm_server.engine.device.kernels import triton_attention

    return triton_attention.AVAILABLE


def kv_page_bytes(model: MoondreamModel, page_size: int) -> int:
    t = model.config.text
    return 2 * t.n_layers * page_size * t.n_kv_heads * t.head_dim * model.dtype.itemsize


class ModelRuntime:
    def __init__(
        self,
        model: MoondreamModel,
        cfg: EngineConfig,
        table: MaskTable,
        device: Device | None = None,
        observer: Observer = NO_OBSERVER,
        image_preparer: ImagePreparer | None = None,
    ) -> None:
        self.model = model
        self.cfg = cfg
        # Makes the crops of host-decoded images (`HostImage`), on the model's device.
        self.image_preparer = image_preparer or ImagePreparer(device=model.device)
        self.torch_device = model.device
        self.dtype = model.dtype
        self.dev: Device = device or TorchDevice(
            model.device, cfg.prefill_sms, both_lanes=cfg.prefill_sms_when_streaming > 0
        )
        two_lanes = getattr(self.dev, "partitioned_prefill_stream", None) is not None
        partition_capture = getattr(self.dev, "prefill_capture_stream", None)
        self.crop_graphs = self._crop_graphs(None if two_lanes else partition_capture)
        self.observer = observer
        dev, tc = self.dev, model.config.text
        self.contract = model.config.tokens
        if dev.is_cuda and cfg.prefill_sm_carveout:
            sms = torch.cuda.get_device_properties(self.torch_device).multi_processor_count
            if cfg.prefill_sm_carveout >= sms:
                raise ValueError(
                    f"prefill_sm_carveout ({cfg.prefill_sm_carveout}) must leave the image "
                    f"path some of the device's {sms} SMs"
                )
        if cfg.vision_fp8:
            if not fp8_supported(self.torch_device):
                raise ValueError(
                    "vision_fp8 needs a CUDA device with FP8 matrix units (compute capability "
                    f"8.9 or newer); the model is on {self.torch_device}"
                )
            model.vision.use_fp8()
        budget = cfg.kv_budget_bytes or self._default_budget()
        n_pages = max(2, budget // kv_page_bytes(model, cfg.page_size))
        shape = (2, tc.n_layers, n_pages, cfg.page_size, tc.n_kv_heads, tc.head_dim)
        # One tensor for every layer's keys and values: a page copy is one op for all layers.
        self.kv = dev.buffer("kv", self._zeros(shape, self.dtype))
        self.k_pools, self.v_pools = list(self.kv[0]), list(self.kv[1])
        rows, max_pages = cfg.max_rows, -(-tc.max_context // cfg.page_size)
        # One extra row pads graph buckets: its block-table row stays on the sink page.
        self.pad_row = rows
        self.block_host = dev.host_buffer("block_host", (rows + 1, max_pages), torch.int32)
        self.block_dev = dev.buffer("block_dev", self._zeros((rows + 1, max_pages), torch.int32))
        self.pages = PageAllocator(
            n_pages, cfg.page_size, rows, max_pages, block_table=self.block_host.numpy()[:rows]
        )
        self.next_embed = dev.buffer("next_embed", self._zeros((rows + 1, tc.dim), self.dtype))
        prefix_len = model.config.image_prefix_len
        # Tail copies happen when a prompt's first chunk launches, at most one per step row.
        self.mixed_layout = MixedLayout(rows=rows + 1, max_tails=cfg.max_batch_size)
        self._mixed_len = self.mixed_layout.size(cfg.max_step_tokens)
        self._mixed_scratch = np.zeros(self._mixed_len, np.int64)
        # Image prefixes: batches of up to max_prefill_batch images, prefill_batches in flight,
        # with up to prefix_prompt_tokens of their first users' prompts (core/prefix_jobs.py).
        self.prefix_slots = cfg.prefill_batches
        self.prefix_prompt_tokens = cfg.prefix_prompt_tokens
        self.prompt_buckets = prompt_buckets(cfg.prefix_prompt_tokens)
        self._prefix_pages = -(-prefix_len // cfg.page_size)
        jobs = cfg.max_prefill_batch
        pages_shape = (jobs + 1, -(-(prefix_len + cfg.prefix_prompt_tokens) // cfg.page_size))
        self.prompt_layout = MixedLayout(rows=jobs + 1, max_tails=jobs)
        prompt_len = jobs + 1 + self.prompt_layout.size(cfg.prefix_prompt_tokens)
        self._prompt_scratch = np.zeros(prompt_len, np.int64)
        self._prefix = [
            PrefixSlot(
                dev.host_buffer(f"prefix{i}.pages_host", pages_shape, torch.int64),
                dev.buffer(f"prefix{i}.pages_dev", self._zeros(pages_shape, torch.int64)),
                dev.host_buffer(f"prefix{i}.prompt_host", (prompt_len,), torch.int64),
                dev.buffer(f"prefix{i}.prompt_dev", self._zeros((prompt_len,), torch.int64)),
                # Blocking: the engine's prefix watcher sleeps on it (see `wait_prefix`).
                dev.event(f"prefix{i}.prefix_done", blocking=True),
            )
            for i in range(self.prefix_slots)
        ]
        # The hidden state of each riding prompt's last token, at its sequence's row: written
        # on the prefill stream, sampled by the sequence's held row in a later step.
        self.held = dev.buffer("held", self._zeros((rows + 1, tc.dim), self.dtype))
        self._next_prefix = 0
        # BOS + image embeddings of one batch (written and read on the prefill stream only).
        # Registered: both prefill lanes' batches write it (the fake device versions it).
        self.prefix_emb = dev.buffer(
            "prefix_emb", self._zeros((cfg.max_prefill_batch, prefix_len, tc.dim), self.dtype)
        )
        self._prefix_pos = torch.arange(prefix_len, device=self.torch_device)
        # Which image of a prefix batch each flattened token belongs to (the Triton path).
        self._prefix_image_of_token = torch.arange(
            cfg.max_prefill_batch, device=self.torch_device
        ).repeat_interleave(prefix_len)
        self.slots = [self._slot_buffers(i, rows + 1, tc.dim) for i in range(2)]
        self._launch_rows = np.zeros((rows + 1, 2), np.int64)  # host scratch, one per runtime
        self.use_triton = dev.is_cuda and triton_available()
        self.buckets = graph_buckets(cfg.max_batch_size)
        self.token_buckets = token_buckets(cfg.max_step_tokens)
        self.decode_graphs: GraphSet[tuple[int, int]] = GraphSet("decode")
        self.mixed_graphs: GraphSet[tuple[int, int]] = GraphSet("mixed step")
        self.image_graphs: GraphSet[tuple[int, int]] = GraphSet("image")
        self.prefix_graphs: GraphSet[tuple[int, int, int]] = GraphSet("image prefix")
        # Where new images' prefixes run: the prefill stream, and with a partition used only
        # while requests stream (cfg.prefill_sms_when_streaming) a second, partitioned lane
        # with graphs of its own. Both lanes share the static buffers the graphs read
        # (`prefix_emb`, `_image_inputs`), so a batch waits for the other lane's last one.
        self.lanes = [
            PrefillLane(dev.prefill_stream, self.image_graphs, self.prefix_graphs, self.crop_graphs)
        ]
        if two_lanes:
            self.lanes.append(
                PrefillLane(
                    dev.partitioned_prefill_stream,
                    GraphSet("image (partitioned)"),
                    GraphSet("image prefix (partitioned)"),
                    self._crop_graphs(partition_capture),
                )
            )
        self._lane_done = dev.event("prefill.lane_done")
        self._last_lane: int | None = None
        # Masks + sampling per (slot, batch bucket, constrained, regions, greedy).
        self.sample_graphs: GraphSet[tuple[int, int, bool, bool, bool]] = GraphSet("sampling")
        # Finalize input of a bucket's padding rows: the pad row, no mask, greedy.
        self._fin_pad = np.zeros((rows + 1, N_FIN), np.int64)
        self._fin_pad[:, F_ROW] = self.pad_row
        self._fin_pad[:, F_PHASE] = RowPhase.TOKEN
        self._fin_pad[:, F_TOP_P] = np.float64(1.0).view(np.int64)
        self._image_inputs: dict[int, torch.Tensor] = {}
        self.table = table
        self.table_dev = dev.buffer(
            "table_dev",
            torch.ones((table.max_rows, table.width), dtype=torch.bool).to(self.torch_device),
        )

    # ---- setup ------------------------------------------------------------------------

    def _crop_graphs(self, capture_stream: object) -> CropGraphs | None:
        """Crop graphs of host-decoded images (CUDA preparer only), captured on
        ``capture_stream`` (None: a stream of their own)."""
        cfg = self.cfg
        if not (
            self.dev.is_cuda
            and cfg.cuda_graphs
            and cfg.crop_graph_sizes
            and self.image_preparer.device.type == "cuda"
        ):
            return None
        return CropGraphs(
            self.image_preparer,
            cfg.crop_graph_sizes,
            capture_stream=capture_stream,  # type: ignore[arg-type]
        )

    @property
    def _prefill_carveout(self) -> int:
        """SMs the prefill path's matmuls leave free (a cuBLAS setting: CUDA only)."""
        return self.cfg.prefill_sm_carveout if self.dev.is_cuda else 0

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.torch_device)

    def _default_budget(self) -> int:
        if self.torch_device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.torch_device)
            return int(free * 0.4)
        return 256 << 20

    def _slot_buffers(self, slot: int, rows: int, dim: int) -> SlotBuffers:
        dev = self.dev

        def host(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return dev.host_buffer(f"slot{slot}.{name}", shape, dtype, slot=slot)

        def device(
            name: str, shape: tuple[int, ...], dtype: torch.dtype, **kw: str
        ) -> torch.Tensor:
            return dev.buffer(f"slot{slot}.{name}", self._zeros(shape, dtype), slot=slot, **kw)

        return SlotBuffers(
            launch_host=host("launch_host", (rows, 2), torch.int64),
            block_stage=host("block_stage", tuple(self.block_host.shape), torch.int32),
            launch_dev=device("launch_dev", (rows, 2), torch.int64),
            mixed_host=host("mixed_host", (self._mixed_len,), torch.int64),
            mixed_dev=device("mixed_dev", (self._mixed_len,), torch.int64),
            fin_host=host("fin_host", (rows, N_FIN), torch.int64),
            fin_dev=device("fin_dev", (rows, N_FIN), torch.int64),
            hidden=device("hidden", (rows, dim), self.dtype),
            # A copy of outputs not yet written waited on the wrong event, or none (I3).
            out_dev=device("out_dev", (rows, N_OUT), torch.float32, early_read="I3"),
            out_host=host("out_host", (rows, N_OUT), torch.float32),
            inputs_ready=dev.event(f"slot{slot}.inputs_ready"),
            mask_ready=dev.event(f"slot{slot}.mask_ready"),
            step_done=dev.event(f"slot{slot}.step_done"),
            d2h_done=dev.event(f"slot{slot}.d2h_done"),
        )

    # ---- host-to-device uploads (copy stream, ordered by events) -------------------------

    def _upload_block_table(self, buf: SlotBuffers) -> None:
        dirty = self.pages.take_dirty()
        if not dirty:
            return
        lo, hi = dirty[0], dirty[-1] + 1  # one copy covering every dirty row
        # Staged per slot: the host mirror may change again while this copy is queued, the
        # slot's stage only after the commit that frees the slot.
        self.dev.host_write(buf.block_stage, self.block_host.numpy()[lo:hi], start=lo)
        self.dev.copy(
            self.dev.copy_stream,
            "h2d block rows",
            partial(_copy_rows, self.block_dev, buf.block_stage, lo, hi),
            # Rows between dirty ones are rewritten with the values they hold: only the dirty
            # rows change, and only they may be read by no step still queued.
            lambda: ([buf.block_stage], [(self.block_dev, dirty)]),
        )

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
                partial(_copy_into, self.table_dev, first, hi, rows),
                lambda first=first, hi=hi: ([], [(self.table_dev, range(first, hi))]),
            )

    def _send_inputs(
        self, slot: int, host: torch.Tensor, device: torch.Tensor, values: np.ndarray
    ) -> None:
        """A step's inputs into the slot's pinned buffer and up in one copy, after the dirty
        block-table rows; the compute stream waits for both (inputs_ready), never the host."""
        buf, dev = self.slots[slot], self.dev
        n = len(values)
        dev.host_write(host, values)
        self._upload_block_table(buf)
        dev.copy(
            dev.copy_stream,
            f"h2d inputs slot{slot}",
            partial(_copy_rows, device, host, 0, n),
            lambda: ([host], [device]),
        )
        dev.record(buf.inputs_ready, dev.copy_stream)
        dev.wait(dev.compute_stream, buf.inputs_ready)

    # ---- forwards ---------------------------------------------------------------------

    @torch.inference_mode()
    def launch_decode(self, slot: int, seqs: list[Sequence]) -> None:
        """Enqueue one decode forward for ``seqs`` (row order = batch order). With graphs on,
        the batch is padded to its bucket with the pad row and the bucket's graph replays."""
        buf, dev = self.slots[slot], self.dev
        b = len(seqs)
        n = self._bucket(b) if self.decode_graphs else b
        host = self._launch_rows
        host[:b, 0] = np.fromiter((seq.row for seq in seqs), np.int64, b)
        host[:b, 1] = np.fromiter((seq.next_position() for seq in seqs), np.int64, b)
        host[b:n, 0], host[b:n, 1] = self.pad_row, 0
        n_blocks = int(host[:b, 1].max()) // self.cfg.page_size + 1
        self._send_inputs(slot, buf.launch_host, buf.launch_dev, host[:n])

        def access() -> tuple[list, list]:
            # Host numpy only, and only the fake device calls it: no device sync here.
            rows = host[:b, 0].tolist()
            return [buf.launch_dev, (self.block_dev, rows), (self.next_embed, rows)], [buf.hidden]

        dev.kernel(
            dev.compute_stream,
            f"decode slot{slot}",
            partial(self._decode_step, slot, n, n_blocks),
            access,
        )

    def _decode_step(self, slot: int, n: int, n_blocks: int) -> None:
        start = self._mark()
        if (slot, n) in self.decode_graphs:
            self.decode_graphs.replay((slot, n))
        else:
            self._decode_forward(self.slots[slot], n, n_blocks)
        if start is not None:
            self.observer.forward_timed("decode", start, self._mark())

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

    def _token_bucket(self, t: int) -> int:
        for size in self.token_buckets:
            if size >= t:
                return size
        raise ValueError(f"{t} tokens exceed the step budget {self.cfg.max_step_tokens}")

    @torch.inference_mode()
    def capture_graphs(self, progress: bool = True) -> None:
        """Capture the decode forward per (slot, batch bucket), the mixed step's token forward
        per (slot, token bucket), masks + sampling per (slot, batch bucket, constrained,
        regions, greedy) and the BOS + image forward per (prefix slot, images in the batch).
        CUDA only; the CPU keeps running the same work eagerly."""
        if not self.dev.is_cuda:
            return
        max_blocks = self.block_dev.shape[1]
        stream = self.dev.compute_stream

        def prepare_decode(key: tuple[int, int]) -> None:
            slot, n = key
            self.slots[slot].launch_dev[:n, 0] = self.pad_row
            self.slots[slot].launch_dev[:n, 1] = 0

        def run_decode(key: tuple[int, int]) -> None:
            self._decode_forward(self.slots[key[0]], key[1], max_blocks)

        keys = [(slot, n) for n in sorted(self.buckets, reverse=True) for slot in (0, 1)]
        self.decode_graphs.capture(keys, prepare_decode, run_decode, stream, progress)

        def prepare_mixed(key: tuple[int, int]) -> None:
            slot, t = key
            host = self.mixed_layout.pack(
                self._mixed_scratch,
                np.zeros((0, N_TOK), np.int64),
                np.zeros(0, np.int64),
                [],
                t,
                self.pad_row,
            )
            self.slots[slot].mixed_dev[: len(host)].copy_(torch.from_numpy(host))

        def run_mixed(key: tuple[int, int]) -> None:
            self._mixed_forward(self.slots[key[0]], key[1], max_blocks)

        keys = [(slot, t) for t in sorted(self.token_buckets, reverse=True) for slot in (0, 1)]
        self.mixed_graphs.capture(keys, prepare_mixed, run_mixed, stream, progress)

        def prepare_sample(key: tuple[int, int, bool, bool, bool]) -> None:
            slot, n = key[0], key[1]
            self.slots[slot].fin_dev[:n].copy_(torch.from_numpy(self._fin_pad[:n]))

        def run_sample(key: tuple[int, int, bool, bool, bool]) -> None:
            slot, n, constrained, regions, greedy = key
            self._sample(self.slots[slot], n, constrained, regions, greedy)

        flags = (False, True)
        keys = [
            (slot, n, constrained, regions, greedy)
            for n in sorted(self.buckets, reverse=True)
            for slot in (0, 1)
            for constrained in flags
            for regions in flags
            for greedy in flags
        ]
        self.sample_graphs.capture(keys, prepare_sample, run_sample, stream, progress)

        def prepare_prefix(key: tuple[int, int, int]) -> None:
            i, _, p = key
            if p:  # pad tokens only, held rows on the pad row
                scratch, jobs = self._prompt_scratch, self.cfg.max_prefill_batch
                scratch[: jobs + 1] = self.pad_row
                self.prompt_layout.pack(
                    scratch[jobs + 1 :],
                    np.zeros((0, N_TOK), np.int64),
                    np.zeros(0, np.int64),
                    [],
                    p,
                    jobs,
                )
                n = jobs + 1 + self.prompt_layout.size(p)
                self._prefix[i].prompt_dev[:n].copy_(torch.from_numpy(scratch[:n]))

        def run_prefix(key: tuple[int, int, int]) -> None:
            self._prefix_forward(*key)

        most, slots = self.cfg.max_prefill_batch, range(self.prefix_slots)
        keys = [
            (i, k, p)
            for p in [*sorted(self.prompt_buckets, reverse=True), 0]
            for k in range(most, 0, -1)
            for i in slots
        ]
        # Pages of the sink only (a fresh pages buffer holds zeros): the warm-up writes there.
        for lane in self.lanes:
            lane.prefix_graphs.capture(keys, prepare_prefix, run_prefix, lane.stream, progress)

    @torch.inference_mode()
    def capture_vision_graphs(self, progress: bool = True) -> None:
        """Capture the image path (normalize, vision tower, projection, BOS) once per tiling.
        CUDA only."""
        if not self.dev.is_cuda:
            return
        vc = self.model.config.vision

        def prepare(tiling: tuple[int, int]) -> None:
            n = 1 + tiling[0] * tiling[1]
            if n not in self._image_inputs:
                shape = (n, vc.crop_size, vc.crop_size, vc.in_channels)
                self._image_inputs[n] = self._zeros(shape, torch.uint8)

        def run(tiling: tuple[int, int]) -> torch.Tensor:
            crops = self._image_inputs[1 + tiling[0] * tiling[1]]
            return self._image_embedding(crops, tiling)

        tilings = image_tilings(vc.max_crops)
        for lane in self.lanes:
            lane.image_graphs.capture(tilings, prepare, run, lane.stream, progress)

    @torch.inference_mode()
    def launch_prefixes(self, jobs: list[PrefixJob], partitioned: bool = False) -> object:
        """Enqueue on a prefill lane, for each job: the image path, then the BOS + image
        forward of the whole batch straight into the jobs' pages, with the prompts that ride
        along (core/prefix_jobs.py). Returns the event the scheduler polls (`prefix_ready`);
        it keeps at most ``prefix_slots`` batches unfinished, so this slot's pinned buffers
        are free again. ``partitioned``: the partitioned lane, where there is one."""
        dev = self.dev
        n = 1 if partitioned and len(self.lanes) > 1 else 0
        lane = self.lanes[n]
        stream = lane.stream
        if len(self.lanes) > 1:
            if self._last_lane not in (None, n):  # the static buffers the other lane used
                dev.wait(stream, self._lane_done)
            self._last_lane = n
        i = self._next_prefix
        self._next_prefix = (i + 1) % self.prefix_slots
        slot = self._prefix[i]
        k = len(jobs)
        if not 0 < k <= self.cfg.max_prefill_batch:
            raise ValueError(f"{k} image prefixes in one batch")
        table = np.zeros((k, slot.pages_host.shape[1]), np.int64)
        written: list[int] = []
        for j, job in enumerate(jobs):
            pages = job.prompt.pages if job.prompt is not None else job.pages
            table[j, : len(pages)] = pages
            written += job.pages + pages
        dev.host_write(slot.pages_host, table)
        dev.copy(
            stream,
            f"h2d prefix pages {i}",
            partial(_copy_rows, slot.pages_dev, slot.pages_host, 0, k),
            lambda: ([slot.pages_host], [slot.pages_dev]),
        )
        p, n_tails, held_rows = self._send_prompts(i, jobs, stream)
        dev.kernel(
            stream,
            f"image prefixes {i}",
            partial(self._image_prefixes, i, jobs, p, n_tails, lane),
            lambda: (
                [slot.pages_dev, slot.prompt_dev],
                [(self.kv, sorted(set(written))), (self.held, held_rows), self.prefix_emb],
            ),
        )
        dev.record(slot.done, stream)
        if len(self.lanes) > 1:
            dev.record(self._lane_done, stream)
        return slot.done

    def _send_prompts(
        self, i: int, jobs: list[PrefixJob], stream: object
    ) -> tuple[int, int, list[int]]:
        """Upload the riding prompts of prefix slot ``i``'s jobs; returns their padded token
        count (0: none), the number of tail copies and the held rows written."""
        if all(job.prompt is None for job in jobs):
            return 0, 0, []
        slot, dev = self._prefix[i], self.dev
        tokens, last = pack_prompts(jobs, self.model.config.image_prefix_len)
        p = self._prompt_bucket(len(tokens))
        has_tail = self.model.config.image_prefix_len % self.cfg.page_size != 0
        tails = tail_copies(jobs, self._prefix_pages, has_tail)
        pad_job = self.cfg.max_prefill_batch  # its pages row stays on the sink page
        rows = [job.prompt.row if job.prompt is not None else self.pad_row for job in jobs]
        scratch = self._prompt_scratch
        scratch[: pad_job + 1] = self.pad_row
        scratch[: len(rows)] = rows
        lay = self.prompt_layout
        lay.pack(scratch[pad_job + 1 :], tokens, last, tails, p, pad_job)
        n = pad_job + 1 + lay.size(p)
        dev.host_write(slot.prompt_host, scratch[:n])
        dev.copy(
            stream,
            f"h2d prefix prompts {i}",
            partial(_copy_rows, slot.prompt_dev, slot.prompt_host, 0, n),
            lambda: ([slot.prompt_host], [slot.prompt_dev]),
        )
        return p, len(tails), [r for r in rows if r != self.pad_row]

    def _prompt_bucket(self, t: int) -> int:
        for size in self.prompt_buckets:
            if size >= t:
                return size
        raise ValueError(f"{t} riding prompt tokens exceed {self.cfg.prefix_prompt_tokens}")

    def prefix_ready(self, handle: object) -> bool:
        """Whether a `launch_prefixes` batch completed: a non-blocking event query."""
        return handle.query()  # type: ignore[attr-defined]

    def wait_prefix(self, handle: object) -> None:
        """Block the calling thread (not the scheduler's) until a batch completed: it sleeps
        on the blocking event instead of polling."""
        handle.synchronize()  # type: ignore[attr-defined]  # watcher thread only, off the tick

    @torch.inference_mode()
    def launch_mixed(
        self, slot: int, seqs: list[Sequence], plan: StepPlan, after: object | None = None
    ) -> None:
        """Enqueue one mixed step: the cached prefix tail pages copied into the sequences
        starting their prompt, then one forward over the ragged token batch (decode rows +
        prompt chunks, core/step_plan.py); each row's last token's hidden state lands in the
        slot's ``hidden`` for finalize.

        Everything the device work needs from the host (the token layout, pages) is planned
        here, at launch: by the time the work runs, the sequences may have moved on. The inputs
        go up in one copy from the slot's pinned buffer (core/mixed_inputs.py). With ``after``
        (a `launch_prefixes` handle) the step waits on the device for that batch: its held
        rows may be sampled before the host saw the prefixes finish."""
        buf, dev = self.slots[slot], self.dev
        tokens, last = pack_tokens(seqs, plan)
        t = len(tokens)
        if t > self.cfg.max_step_tokens:
            raise ValueError(f"{t} tokens exceed the step budget {self.cfg.max_step_tokens}")
        # A step of held rows only (prompts that ran with their prefix) runs no forward.
        n = self._token_bucket(t) if self.mixed_graphs and t else t
        n_blocks = int(tokens[:, T_POS].max()) // self.cfg.page_size + 1 if t else 0
        held_rows = [HELD - h for h in last.tolist() if h <= HELD]  # host numpy: no sync
        tails, prefix_pages = [], []
        for i, chunk in enumerate(plan.chunks, start=plan.n_decode):
            entry = seqs[i].prefix
            if chunk.start == 0 and entry is not None:
                prefix_pages += entry.pages  # written on the prefill stream: read only if ready
                if entry.tail_page is not None:
                    # The prompt continues the prefix's partly filled last page: a private copy.
                    tails.append((entry.tail_page, seqs[i].own_pages[0]))
        values = self.mixed_layout.pack(self._mixed_scratch, tokens, last, tails, n, self.pad_row)
        self._send_inputs(slot, buf.mixed_host, buf.mixed_dev, values)
        if after is not None:  # held rows of a prefix batch still running: a device wait
            dev.wait(dev.compute_stream, after)

        def access() -> tuple[list, list]:
            # Host numpy only, and only the fake device calls it: no device sync here.
            rows = sorted(set(tokens[:, T_ROW].tolist()))
            decode_rows = tokens[: plan.n_decode, T_ROW].tolist()
            reads = [
                buf.mixed_dev,
                (self.block_dev, rows),
                (self.next_embed, decode_rows),
                (self.kv, prefix_pages),
                (self.held, held_rows),
            ]
            return reads, [buf.hidden]

        dev.kernel(
            dev.compute_stream,
            f"mixed slot{slot}",
            partial(self._mixed_step, slot, len(tails), t, n, n_blocks),
            access,
        )

    def _mixed_step(self, slot: int, n_tails: int, t: int, n: int, n_blocks: int) -> None:
        buf = self.slots[slot]
        start = self._mark()
        if n_tails:
            at = self.mixed_layout.tails_at
            pairs = buf.mixed_dev[at : at + 2 * n_tails].view(n_tails, 2)
            # Every layer's keys and values of the tail pages, in one gather and one scatter.
            self.kv[:, :, pairs[:, 1]] = self.kv[:, :, pairs[:, 0]]
        if not n:
            last = buf.mixed_dev[: self.mixed_layout.rows]
            buf.hidden[: len(last)] = self._held_states(last)
        elif (slot, n) in self.mixed_graphs:
            self.mixed_graphs.replay((slot, n))
        else:
            self._mixed_forward(buf, n, n_blocks)
        if start is not None:
            self.observer.forward_timed("mixed", start, self._mark())

    def _mixed_forward(self, buf: SlotBuffers, n: int, n_blocks: int) -> None:
        """The token forward of a mixed step over the slot's ``n`` (padded) tokens. On CUDA
        every token is a row of the rotary + KV-write kernel, and attention runs per tile of a
        row's consecutive tokens over its pages up to each token's position (causal: every
        prefix was computed before), so no shape depends on the host; elsewhere the PyTorch
        varlen path over the first ``n_blocks`` pages."""
        m, lay = self.model, self.mixed_layout
        tokens = buf.mixed_dev[lay.tokens_at : lay.tiles_at(n)].view(n, N_TOK)
        last = buf.mixed_dev[: lay.rows]
        rows, pos, ids = tokens[:, T_ROW], tokens[:, T_POS], tokens[:, T_ID]
        # Decode rows (id -1) take the input finalize left on the device.
        x = torch.where((ids < 0)[:, None], self.next_embed[rows], m.text.embed(ids.clamp(min=0)))
        x = x.to(self.dtype)
        if self.use_triton:
            text = m.text
            rope = (text.rope_cos, text.rope_sin)
            tiles = buf.mixed_dev[lay.tiles_at(n) : lay.size(n)].view(-1, 2)
            kv = DecodeKV(
                self.k_pools,
                self.v_pools,
                self.block_dev,
                rows,
                0,
                rope,
                text.cfg.n_heads,
                True,
                tiles=tiles,
                tile_tokens=lay.tile_tokens,
            )
            h = text(x[:, None], pos[:, None], kv)[:, 0]
        else:
            kv = RaggedKV(self.k_pools, self.v_pools, self.block_dev, rows, n_blocks)
            h = m.text(x[None], pos[None], kv)[0]
        # Rows without a token here (-1) sample nothing: any row's state will do. Held rows
        # take what their prefix batch left.
        held = self._held_states(last)
        buf.hidden[: lay.rows] = torch.where((last <= HELD)[:, None], held, h[last.clamp(min=0)])

    def _held_states(self, last: torch.Tensor) -> torch.Tensor:
        """The kept hidden state of each step row's sequence (``last`` <= HELD; other rows get
        row 0's, which they do not use)."""
        return self.held[(HELD - last).clamp(min=0)]

    def _image_prefixes(
        self, i: int, jobs: list[PrefixJob], p: int, n_tails: int, lane: PrefillLane
    ) -> None:
        """BOS + image embeddings of each new image (one graph replay per image, captured per
        tiling; tilings beyond the crop budget run eagerly), then the BOS + image forward of
        all of them at once (with ``p`` riding prompt tokens), straight into their pages."""
        for j, job in enumerate(jobs):
            tiling = job.image.tiling
            crops = self._crops_on_device(self._crops_of(job.image, lane.crop_graphs))
            if tiling in lane.image_graphs:
                self._image_inputs[crops.shape[0]].copy_(crops)
                emb = lane.image_graphs.replay(tiling)
            else:
                emb = self._image_embedding(crops, tiling)
            # Copied out before the next replay overwrites the graph's output.
            self.prefix_emb[j].copy_(emb[0])  # type: ignore[index]
        k = len(jobs)
        if (i, k, p) in lane.prefix_graphs:
            lane.prefix_graphs.replay((i, k, p))
        else:
            self._prefix_forward(i, k, p)
        if n_tails:
            # Each riding prompt's stand-in page holds its prefix's last positions: into the
            # entry's own last page, every layer in one gather and one scatter.
            at = self.cfg.max_prefill_batch + 1 + self.prompt_layout.tails_at
            pairs = self._prefix[i].prompt_dev[at : at + 2 * n_tails].view(n_tails, 2)
            self.kv[:, :, pairs[:, 1]] = self.kv[:, :, pairs[:, 0]]

    def _image_embedding(self, crops: torch.Tensor, tiling: tuple[int, int]) -> torch.Tensor:
        """uint8 crops of one image -> BOS + image embeddings [1, prefix_len, dim]."""
        m = self.model
        with sm_carveout(self._prefill_carveout):
            x = normalize_crops(crops, self.dtype)
            return m.prefix_embeddings(m.vision.project(m.vision.encode(x), tiling))

    def _prefix_forward(self, i: int, k: int, p: int = 0) -> None:
        """BOS + image of prefix slot ``i``'s ``k`` images (``prefix_emb[:k]``) into their
        pages, with ``p`` (padded) riding prompt tokens. A prefix sees only itself, both ways,
        so without prompts attention needs no mask."""
        if p:
            self._prefix_prompt_forward(i, k, p)
            return
        pages = self._prefix[i].pages_dev[:k]
        length = self.prefix_emb.shape[1]
        text = self.model.text
        kv: PagedKV | PrefixKV
        if self.use_triton:
            rope = (text.rope_cos, text.rope_sin)
            kv = PrefixKV(
                self.k_pools,
                self.v_pools,
                self._prefix[i].pages_dev,
                self._prefix_image_of_token,
                rope,
                text.cfg.n_heads,
            )
        else:
            kv = PagedKV(self.k_pools, self.v_pools, pages, length, fresh_prefix=True)
        pos = self._prefix_pos[None].expand(k, length)
        with sm_carveout(self._prefill_carveout):
            self.model.text(self.prefix_emb[:k], pos, kv)

    def _prefix_prompt_forward(self, i: int, k: int, p: int) -> None:
        """The prefixes and their riding prompts as one token batch [1, k * length + p]; each
        prompt's last hidden state is kept at its sequence's row of ``held``."""
        slot, lay, text = self._prefix[i], self.prompt_layout, self.model.text
        at = self.cfg.max_prefill_batch + 1  # the held rows come first
        buf = slot.prompt_dev
        held_rows, last = buf[:k], buf[at : at + k]
        tokens = buf[at + lay.tokens_at : at + lay.tiles_at(p)].view(p, N_TOK)
        tiles = buf[at + lay.tiles_at(p) : at + lay.size(p)].view(-1, 2)
        rows, pos, ids = tokens[:, T_ROW], tokens[:, T_POS], tokens[:, T_ID]
        length, dim = self.prefix_emb.shape[1:]
        n = k * length
        x = torch.cat([self.prefix_emb[:k].reshape(n, dim), text.embed(ids).to(self.dtype)])
        positions = torch.cat([self._prefix_pos.repeat(k), pos])
        kv = PrefixPromptKV(
            self.k_pools,
            self.v_pools,
            slot.pages_dev,
            k,
            length,
            self._prefix_image_of_token,
            rows,
            pos,
            (text.rope_cos, text.rope_sin),
            text.cfg.n_heads,
            tiles if self.use_triton else None,
            lay.tile_tokens,
        )
        with sm_carveout(self._prefill_carveout):
            h = text(x[None], positions[None], kv)[0]
        self.held[held_rows] = h[n + last.clamp(min=0)]

    def _crops_of(
        self, image: PreparedImage | HostImage | EncodedImage, graphs: CropGraphs | None = None
    ) -> torch.Tensor:
        """The image's crops; a host-decoded image's are made here, queued on the current
        (prefill) stream, so they cost this thread only the staging copy and the launches.
        ``graphs``: the crop graphs of the lane it runs on."""
        if isinstance(image, EncodedImage):
            # Rare: admitted encoded because its prefix was cached, which went before the
            # request ran. Decoding here blocks this thread for the decode (the crops are
            # complete when it returns): said, since the steps wait meanwhile.
            log.info("decoding an image on the scheduler thread: its prefix left the cache")
            return self.image_preparer.prepare_encoded(image).crops
        if isinstance(image, HostImage):
            if graphs is not None:
                return graphs.crops(image)  # consumed below, before the next call
            return self.image_preparer.crops_of(image)
        return image.crops

    def _crops_on_device(self, crops: torch.Tensor) -> torch.Tensor:
        """The image preparer may have made the crops on this device already; host crops go
        up through pinned memory (a pageable source would make the copy block the host)."""
        if crops.device.type != "cpu":
            return crops.to(self.torch_device, non_blocking=True)  # no-op on the same GPU
        if self.dev.is_cuda and not crops.is_pinned():
            crops = crops.pin_memory()
        return crops.to(self.torch_device, non_blocking=True)

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
        buf, dev = self.slots[slot], self.dev
        b = len(seqs)
        # With sampling graphs, the batch is padded to its bucket with harmless rows.
        n = self._bucket(b) if self.sample_graphs else b
        dev.host_write(buf.fin_host, fin)
        if n > b:
            dev.host_write(buf.fin_host, self._fin_pad[: n - b], start=b)
        if constrained:
            self._upload_table_rows()
        dev.copy(
            dev.copy_stream,
            f"h2d fin slot{slot}",
            partial(_copy_rows, buf.fin_dev, buf.fin_host, 0, n),
            lambda: ([buf.fin_host], [buf.fin_dev]),
        )
        dev.record(buf.mask_ready, dev.copy_stream)
        dev.wait(dev.compute_stream, buf.mask_ready)

        def access() -> tuple[list, list]:
            # Host numpy only, and only the fake device calls it: no device sync here.
            rows = fin[:, F_ROW].tolist()
            masks = sorted(set(fin[:, F_MASK].tolist()) - {NO_MASK})
            reads = [buf.fin_dev, buf.hidden, *([(self.table_dev, masks)] if masks else [])]
            return reads, [buf.out_dev, (self.next_embed, rows)]

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
            partial(_copy_rows, buf.out_host, buf.out_dev, 0, b),
            lambda: ([buf.out_dev], [buf.out_host]),
        )
        dev.record(buf.d2h_done, dev.copy_stream)

    def _sample_step(
        self, slot: int, n: int, constrained: bool, regions: bool, greedy: bool
    ) -> None:
        start = self._mark()
        key = (slot, n, constrained, regions, greedy)
        if key in self.sample_graphs:
            self.sample_graphs.replay(key)
        else:
            self._sample(self.slots[slot], n, constrained, regions, greedy)
        if start is not None:
            self.observer.sample_timed(start, self._mark())

    def _sample(
        self, buf: SlotBuffers, b: int, constrained: bool, regions: bool, greedy: bool
    ) -> None:
        """Masks and sampling of the slot's first ``b`` rows (static shapes, no host sync:
        graph-capturable)."""
        m = self.model
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
            is_size = (phase == RowPhase.SIZE)[:, None]
            is_token = (phase == RowPhase.TOKEN)[:, None]
            region_emb = torch.where(
                is_size, m.region.encode_size(size), m.region.encode_coord(coord)
            )
            nxt = torch.where(is_token, nxt, region_emb)
        self.next_embed[fin_dev[:, F_ROW]] = nxt.to(self.dtype)

    def _mark(self) -> object | None:
        """A timing event on the current stream, only while an observer asks for them."""
        if not self.observer.device_timing:
            return None
        event = torch.cuda.Event(enable_timing=True) if self.dev.is_cuda else CpuEvent()
        event.record()
        return event

    def read_outputs(self, slot: int, b: int) -> np.ndarray:
        """Wait for the slot's D2H copy (the scheduler's one intended sync) and view it."""
        buf = self.slots[slot]
        self.dev.host_wait(buf.d2h_done)  # the tick's single wait: this step's results
        return self.dev.host_read(buf.out_host)[:b]

    def release_row(self, row: int) -> None:
        self.pages.clear(row)


def _copy_rows(dst: torch.Tensor, src: torch.Tensor, lo: int, hi: int) -> None:
    dst[lo:hi].copy_(src[lo:hi], non_blocking=True)


def _copy_into(dst: torch.Tensor, lo: int, hi: int, src: torch.Tensor) -> None:
    dst[lo:hi].copy_(src, non_blocking=True)


__all__ = ["ModelRuntime", "kv_page_bytes"]
