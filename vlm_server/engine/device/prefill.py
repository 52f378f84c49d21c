"""New images' prefixes, on a prefill lane beside the steps.

New image prefixes are not part of any step: `Prefill.launch` runs the image path (one graph
per tiling) and the BOS + image forward (one graph per number of images and riding prompt
tokens) on the prefill stream, a low-priority stream beside the compute stream, so a new
image overlaps the decode steps instead of lengthening one. Only the prefix's own pages are
written there (and those of the prompts riding the batch, core/prefix_jobs.py, with their
last hidden states in ``held``), and the scheduler launches no step that reads them before
the batch's event said it completed, unless the step itself waits for the batch on the device.
With an SM partition used only while requests stream (``prefill_sms_when_streaming``) there
are two prefill lanes, each with its own graphs; a batch that changes lane waits for the
other lane's last one (``prefill.lane_done``), as both read the same static buffers.

The interactive lane is a second `Prefill` (``interactive=True``) with static buffers, slots
and graphs of its own, on a stream ahead of the compute stream: while background work runs,
the scheduler sends new interactive pictures there, so they wait neither for a background
batch on the prefill stream nor for SMs the decode steps hold. Its batches are smaller
(``interactive_prefill_batch``), so it captures fewer prefix graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from image_pipeline.crop_graphs import CropGraphs
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.mixed_inputs import MixedLayout
from vlm_server.engine.core.prefix_jobs import PrefixJob, pack_prompts, tail_copies
from vlm_server.engine.core.step_plan import N_TOK, T_ID, T_POS, T_ROW
from vlm_server.engine.device.adapter_rows import AdapterRows
from vlm_server.engine.device.buffers import StepBuffers, copy_rows, zeros
from vlm_server.engine.device.crops import ImageCrops
from vlm_server.engine.device.graphs import (
    GraphSet,
    bucket,
    image_tilings,
    prompt_buckets,
    sm_carveout,
)
from vlm_server.engine.device.kv_pool import KVPool
from vlm_server.engine.device.model_entry import ModelEntryPoints
from vlm_server.engine.device.streams import Device, Event


@dataclass
class PrefixSlot:
    """The pinned staging buffers and the event of one batch of image prefixes in flight.

    Its values go up on the lane's stream into the path's one set of device buffers
    (`Prefill.pages_dev`, `Prefill.prompt_dev`) just ahead of its forward: a lane runs its
    batches in order, so the graphs read the same device buffers whatever the slot (one graph
    per batch shape, not per slot)."""

    # [max_prefill_batch + 1, pages of prefix + riding prompt] int64: each job's pages
    # (core/prefix_jobs.py); the last row stays on the sink page, for pad tokens.
    pages_host: torch.Tensor
    # The riding prompts: each job's held row, then their tokens as core/mixed_inputs.py lays
    # out a step's (the pad row is the sink row above).
    prompt_host: torch.Tensor
    done: Event


@dataclass
class PrefillLane:
    """A stream new images' prefixes run on, with the graphs captured on it (a graph keeps the
    SM partition of the stream it was captured on, so each lane has its own)."""

    stream: object
    image_graphs: GraphSet[tuple[int, int]]
    prefix_graphs: GraphSet[tuple[int, int]]
    crop_graphs: CropGraphs | None
    # With adapters on, the same forwards with the jobs' adapter deltas: a batch runs them
    # only when one of its jobs uses an adapter, so the others pay nothing for LoRA.
    lora_prefix_graphs: GraphSet[tuple[int, int]]
    # Its stream runs in the SM partition (the early-launch rule of the steps reads it).
    partitioned: bool = False


class Prefill:
    """Image prefixes: batches of up to ``max_prefill_batch`` images, ``prefill_batches`` in
    flight, with up to ``prefix_prompt_tokens`` of their first users' prompts riding along."""

    def __init__(
        self,
        dev: Device,
        entry: ModelEntryPoints,
        cfg: EngineConfig,
        pool: KVPool,
        buffers: StepBuffers,
        crops: ImageCrops,
        adapters: AdapterRows | None = None,
        interactive: bool = False,
    ) -> None:
        self.dev, self.entry, self.pool, self.buffers, self.crops = dev, entry, pool, buffers, crops
        self.adapters = adapters  # the jobs' adapter slots; None: adapters are off
        self.interactive = interactive
        # Buffer names, and the adapter rows' staging slots and device buffer (the path's).
        self.name = "iprefix" if interactive else "prefix"
        self.adapter_base = cfg.prefill_batches if interactive else 0
        self.adapter_path = 1 if interactive else 0
        jobs = cfg.interactive_prefill_batch if interactive else cfg.max_prefill_batch
        self.max_jobs, self.page_size = jobs, cfg.page_size
        self.prompt_tokens = cfg.prefix_prompt_tokens
        self.prompt_buckets = prompt_buckets(cfg.prefix_prompt_tokens)
        prefix_len, device = entry.image_prefix_len, entry.device
        self.prefix_pages = -(-prefix_len // cfg.page_size)
        self.prompt_layout = MixedLayout(rows=jobs + 1, max_tails=jobs)
        # Each job's held row, then its prompt tokens as the layout packs them.
        prompt_len = jobs + 1 + self.prompt_layout.size(cfg.prefix_prompt_tokens)
        self.prompt_scratch = np.zeros(prompt_len, np.int64)
        # One set of buffers per batch that may be in flight, used in turn.
        self.slots = self._slots(cfg.prefill_batches, prefix_len, prompt_len)
        self.next_slot = 0
        pages_shape = tuple(self.slots[0].pages_host.shape)
        self.pages_dev = dev.buffer(
            f"{self.name}.pages_dev", zeros(pages_shape, torch.int64, device)
        )
        self.prompt_dev = dev.buffer(
            f"{self.name}.prompt_dev", zeros((prompt_len,), torch.int64, device)
        )
        # BOS + image embeddings of one batch (written and read on the prefill stream only).
        # Registered: both prefill lanes' batches write it (the fake device versions it).
        self.prefix_emb = dev.buffer(
            f"{self.name}_emb", zeros((jobs, prefix_len, entry.dim), entry.dtype, device)
        )
        self.prefix_pos = torch.arange(prefix_len, device=device)
        # Which image of a prefix batch each flattened token belongs to (the Triton path).
        self.image_of_token = torch.arange(jobs, device=device).repeat_interleave(prefix_len)
        # The image path's static input per crop count (graphs read it), made at capture.
        self.image_inputs: dict[int, torch.Tensor] = {}
        # SMs the prefill path's matmuls leave free (a cuBLAS setting: CUDA only).
        self.carveout = cfg.prefill_sm_carveout if dev.is_cuda else 0
        self.lanes = self._lanes()
        self.image_graphs = self.lanes[0].image_graphs
        self.prefix_graphs = self.lanes[0].prefix_graphs
        self.lane_done = dev.event(f"{self.name}.lane_done")
        self.last_lane: int | None = None

    def _slots(self, n: int, prefix_len: int, prompt_len: int) -> list[PrefixSlot]:
        dev, name = self.dev, self.name
        pages = -(-(prefix_len + self.prompt_tokens) // self.page_size)
        pages_shape = (self.max_jobs + 1, pages)
        return [
            PrefixSlot(
                dev.host_buffer(f"{name}{i}.pages_host", pages_shape, torch.int64),
                dev.host_buffer(f"{name}{i}.prompt_host", (prompt_len,), torch.int64),
                # Blocking: the engine's prefix watcher sleeps on it (`ModelRuntime.wait_prefix`).
                dev.event(f"{name}{i}.prefix_done", blocking=True),
            )
            for i in range(n)
        ]

    def _lanes(self) -> list[PrefillLane]:
        """The prefill stream, and with a partition used only while requests stream
        (cfg.prefill_sms_when_streaming) a second, partitioned lane with graphs of its own.
        Both lanes share the static buffers the graphs read (`prefix_emb`, `image_inputs`),
        so a batch waits for the other lane's last one."""
        dev = self.dev
        if self.interactive:  # the whole GPU, ahead of the steps: no partition
            return [
                PrefillLane(
                    dev.interactive_prefill_stream,
                    GraphSet("interactive image"),
                    GraphSet("interactive image prefix"),
                    self.crops.graphs(None),
                    GraphSet("interactive image prefix (adapters)"),
                )
            ]
        two_lanes = dev.partitioned_prefill_stream is not None
        partition_capture = dev.prefill_capture_stream
        lanes = [
            PrefillLane(
                dev.prefill_stream,
                GraphSet("image"),
                GraphSet("image prefix"),
                self.crops.graphs(None if two_lanes else partition_capture),
                GraphSet("image prefix (adapters)"),
                # One lane is the partition when there is one and it serves every batch.
                partitioned=not two_lanes and partition_capture is not None,
            )
        ]
        if two_lanes:
            lanes.append(
                PrefillLane(
                    dev.partitioned_prefill_stream,
                    GraphSet("image (partitioned)"),
                    GraphSet("image prefix (partitioned)"),
                    self.crops.graphs(partition_capture),
                    GraphSet("image prefix (partitioned, adapters)"),
                    partitioned=True,
                )
            )
        return lanes

    # ---- launch (the scheduler's thread) ----------------------------------------------

    def lane_index(self, partitioned: bool) -> int:
        """The lane `launch` takes for ``partitioned``: the partitioned one, where there is
        one."""
        return 1 if partitioned and len(self.lanes) > 1 else 0

    def on_partition(self, partitioned: bool) -> bool:
        """Whether a batch `launch` gets with ``partitioned`` runs in the SM partition."""
        return self.lanes[self.lane_index(partitioned)].partitioned

    def launch(self, jobs: list[PrefixJob], partitioned: bool = False) -> object:
        """Enqueue on a prefill lane, for each job: the image path, then the BOS + image
        forward of the whole batch straight into the jobs' pages, with the prompts that ride
        along. Returns the batch's event; the scheduler keeps at most ``prefill_batches``
        batches unfinished, so this slot's pinned buffers are free again. ``partitioned``: the
        partitioned lane, where there is one."""
        dev = self.dev
        n = self.lane_index(partitioned)
        lane = self.lanes[n]
        stream = lane.stream
        if len(self.lanes) > 1:
            if self.last_lane not in (None, n):  # the static buffers the other lane used
                dev.wait(stream, self.lane_done)
            self.last_lane = n
        i = self.next_slot
        self.next_slot = (i + 1) % len(self.slots)
        slot = self.slots[i]
        k = len(jobs)
        if not 0 < k <= self.max_jobs:
            raise ValueError(f"{k} image prefixes in one batch")
        table = np.zeros((k, slot.pages_host.shape[1]), np.int64)
        written: list[int] = []
        for j, job in enumerate(jobs):
            pages = job.prompt.pages if job.prompt is not None else job.pages
            table[j, : len(pages)] = pages
            written += [*job.pages, *pages]
        dev.host_write(slot.pages_host, table)
        dev.copy(
            stream,
            f"h2d prefix pages {i}",
            partial(copy_rows, self.pages_dev, slot.pages_host, 0, k),
            lambda: ([slot.pages_host], [self.pages_dev]),
        )
        p, n_tails, held_rows = self._send_prompts(i, jobs, stream)
        if self.adapters:
            slots = [job.adapter_slot for job in jobs]
            self.adapters.send_jobs(self.adapter_base + i, self.adapter_path, slots, stream)
        lora = self.adapters is not None and any(job.adapter_slot >= 0 for job in jobs)
        kv, held = self.pool.kv, self.buffers.held
        dev.kernel(
            stream,
            f"image prefixes {i}",
            partial(self._image_prefixes, jobs, p, n_tails, lane, lora),
            lambda: (
                [self.pages_dev, self.prompt_dev, *self._adapter_reads()],
                [(kv, sorted(set(written))), (held, held_rows), self.prefix_emb],
            ),
        )
        dev.record(slot.done, stream)
        if len(self.lanes) > 1:
            dev.record(self.lane_done, stream)
        return slot.done

    def _adapter_reads(self) -> list[torch.Tensor]:
        return [self.adapters.job_dev[self.adapter_path]] if self.adapters is not None else []

    def _send_prompts(
        self, i: int, jobs: list[PrefixJob], stream: object
    ) -> tuple[int, int, list[int]]:
        """Upload the riding prompts of prefix slot ``i``'s jobs; returns their padded token
        count (0: none), the number of tail copies and the held rows written."""
        if all(job.prompt is None for job in jobs):
            return 0, 0, []
        slot, dev, pad_row = self.slots[i], self.dev, self.buffers.pad_row
        prefix_len = self.entry.image_prefix_len
        tokens, last = pack_prompts(jobs, prefix_len)
        p = self._prompt_bucket(len(tokens))
        has_tail = prefix_len % self.page_size != 0
        tails = tail_copies(jobs, self.prefix_pages, has_tail)
        pad_job = self.max_jobs  # its pages row stays on the sink page
        rows = [job.prompt.row if job.prompt is not None else pad_row for job in jobs]
        scratch = self.prompt_scratch
        scratch[: pad_job + 1] = pad_row
        scratch[: len(rows)] = rows
        lay = self.prompt_layout
        lay.pack(scratch[pad_job + 1 :], tokens, last, tails, p, pad_job)
        n = pad_job + 1 + lay.size(p)
        dev.host_write(slot.prompt_host, scratch[:n])
        dev.copy(
            stream,
            f"h2d prefix prompts {i}",
            partial(copy_rows, self.prompt_dev, slot.prompt_host, 0, n),
            lambda: ([slot.prompt_host], [self.prompt_dev]),
        )
        return p, len(tails), [r for r in rows if r != pad_row]

    def _prompt_bucket(self, t: int) -> int:
        size = bucket(self.prompt_buckets, t)
        if size is None:
            raise ValueError(f"{t} riding prompt tokens exceed {self.prompt_tokens}")
        return size

    # ---- device work (on the lane's stream) -------------------------------------------

    def _image_prefixes(
        self,
        jobs: list[PrefixJob],
        p: int,
        n_tails: int,
        lane: PrefillLane,
        lora: bool = True,
    ) -> None:
        """BOS + image embeddings of each new image (one graph replay per image, captured per
        tiling; tilings beyond the crop budget run eagerly), then the BOS + image forward of
        all of them at once (with ``p`` riding prompt tokens), straight into their pages;
        ``lora``: with the jobs' adapters (a job uses one)."""
        for j, job in enumerate(jobs):
            tiling = job.image.tiling
            crops = self.crops.on_device(self.crops.crops_of(job.image, lane.crop_graphs))
            if tiling in lane.image_graphs:
                self.image_inputs[crops.shape[0]].copy_(crops)
                emb = lane.image_graphs.replay(tiling)
            else:
                emb = self.image_embedding(crops, tiling)
            # Copied out before the next replay overwrites the graph's output.
            self.prefix_emb[j].copy_(emb[0])  # type: ignore[index]
        k = len(jobs)
        graphs = lane.lora_prefix_graphs if lora else lane.prefix_graphs
        if (k, p) in graphs:
            graphs.replay((k, p))
        else:
            self.prefix_forward(k, p, lora)
        if n_tails:
            # Each riding prompt's stand-in page holds its prefix's last positions: into the
            # entry's own last page, every layer in one gather and one scatter.
            at = self.max_jobs + 1 + self.prompt_layout.tails_at
            pairs = self.prompt_dev[at : at + 2 * n_tails].view(n_tails, 2)
            self.pool.copy_pages(pairs)

    def image_embedding(self, crops: torch.Tensor, tiling: tuple[int, int]) -> torch.Tensor:
        """uint8 crops of one image -> BOS + image embeddings [1, prefix_len, dim]."""
        with sm_carveout(self.carveout):
            return self.entry.image_prefix(crops, tiling)

    def prefix_forward(self, k: int, p: int = 0, lora: bool = True) -> None:
        """BOS + image of the batch's ``k`` images (``prefix_emb[:k]``) into their pages, with
        ``p`` (padded) riding prompt tokens. A prefix sees only itself, both ways, so without
        prompts attention needs no mask. ``lora``: with the jobs' adapters (when adapters are
        on)."""
        if p:
            self._prefix_prompt_forward(k, p, lora)
            return
        length = self.prefix_emb.shape[1]
        kv = self.pool.prefix_view(self.pages_dev, k, length, self.image_of_token)
        pos = self.prefix_pos[None].expand(k, length)
        deltas = (
            self.adapters.for_prefix(self.adapter_path, self.image_of_token[: k * length])
            if self.adapters and lora
            else None
        )
        with sm_carveout(self.carveout):
            self.entry.text_forward(self.prefix_emb[:k], pos, kv, deltas)

    def _prefix_prompt_forward(self, k: int, p: int, lora: bool) -> None:
        """The prefixes and their riding prompts as one token batch [1, k * length + p]; each
        prompt's last hidden state is kept at its sequence's row of ``held``."""
        lay, entry = self.prompt_layout, self.entry
        at = self.max_jobs + 1  # the held rows come first
        buf = self.prompt_dev
        held_rows, last = buf[:k], buf[at : at + k]
        tokens = buf[at + lay.tokens_at : at + lay.tiles_at(p)].view(p, N_TOK)
        tiles = buf[at + lay.tiles_at(p) : at + lay.size(p)].view(-1, 2)
        rows, pos, ids = tokens[:, T_ROW], tokens[:, T_POS], tokens[:, T_ID]
        length, dim = self.prefix_emb.shape[1:]
        n = k * length
        x = torch.cat([self.prefix_emb[:k].reshape(n, dim), entry.embed(ids).to(entry.dtype)])
        positions = torch.cat([self.prefix_pos.repeat(k), pos])
        kv = self.pool.prefix_prompt_view(
            self.pages_dev, k, length, self.image_of_token, rows, pos, tiles, lay.tile_tokens
        )
        adapters = self.adapters if lora else None
        path = self.adapter_path
        deltas = adapters.for_prefix(path, self.image_of_token[:n], rows) if adapters else None
        with sm_carveout(self.carveout):
            h = entry.text_forward(x[None], positions[None], kv, deltas)[0]
        self.buffers.held[held_rows] = h[n + last.clamp(min=0)]

    # ---- graphs -----------------------------------------------------------------------

    def capture_prefixes(self, progress: bool) -> None:
        """Capture the BOS + image forward per (images in the batch, riding prompt tokens) on
        every lane (CUDA only)."""
        pad_row, jobs = self.buffers.pad_row, self.max_jobs

        def prepare(key: tuple[int, int]) -> None:
            _, p = key
            if p:  # pad tokens only, held rows on the pad row
                scratch = self.prompt_scratch
                scratch[: jobs + 1] = pad_row
                none = np.zeros((0, N_TOK), np.int64)
                self.prompt_layout.pack(
                    scratch[jobs + 1 :], none, np.zeros(0, np.int64), [], p, jobs
                )
                n = jobs + 1 + self.prompt_layout.size(p)
                self.prompt_dev[:n].copy_(torch.from_numpy(scratch[:n]))

        def run(key: tuple[int, int], lora: bool = False) -> None:
            self.prefix_forward(*key, lora)

        prompts = [*sorted(self.prompt_buckets, reverse=True), 0]
        keys = [(k, p) for p in prompts for k in range(jobs, 0, -1)]
        # Pages of the sink only (a fresh pages buffer holds zeros): the warm-up writes there.
        for lane in self.lanes:
            lane.prefix_graphs.capture(keys, prepare, run, lane.stream, progress)
            if self.adapters is not None:
                run_lora = partial(run, lora=True)
                lane.lora_prefix_graphs.capture(keys, prepare, run_lora, lane.stream, progress)

    def capture_images(self, progress: bool) -> None:
        """Capture the image path (normalize, vision tower, projection, BOS) once per tiling
        on every lane (CUDA only)."""
        entry = self.entry

        def prepare(tiling: tuple[int, int]) -> None:
            n = 1 + tiling[0] * tiling[1]
            if n not in self.image_inputs:
                self.image_inputs[n] = zeros((n, *entry.crop_shape), torch.uint8, entry.device)

        def run(tiling: tuple[int, int]) -> torch.Tensor:
            crops = self.image_inputs[1 + tiling[0] * tiling[1]]
            return self.image_embedding(crops, tiling)

        tilings = image_tilings(entry.max_crops)
        for lane in self.lanes:
            lane.image_graphs.capture(tilings, prepare, run, lane.stream, progress)
