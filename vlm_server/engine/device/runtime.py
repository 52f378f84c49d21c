"""The device side of the engine: KV pools, per-slot buffers, forwards, finalize (mask, sample,
region values, next inputs) and the result copy back to the host.

Contract with the scheduler: every method here only enqueues device work (no host-device
synchronization) except `read_outputs`, which waits for one step's device-to-host copy. A step
arrives as values (core/step_inputs.py, and finalize's ``fin``), never as sequences.
Sampled ids and region values never visit the host before the next forward: finalize writes
each row's next input embedding into ``next_embed[row]`` on the device, and the next
forward reads it from there. The scheduler owns the KV pages (core/pages.py); its allocator
writes the block table into the pool's pinned mirror, and each launch brings the rows it
changed, which go up in one copy ahead of the step's inputs.

`ModelRuntime` composes parts, each holding its own state:

    model_entry.py  every call into the model (embeddings, text forward, logits, image path,
                    region heads, KV and buffer shapes, FP8 switch)
    kv_pool.py      the KV pool, the block table (pinned mirror, device copy, row uploads)
                    and the attention views the forwards read and write it through
    buffers.py      fixed-address buffers: each pipeline slot's, and per row next_embed, held
    forwards.py     decode and mixed steps (inputs upload, forward, their graphs)
    prefill.py      image prefixes on the prefill lanes (image path, BOS + image forward,
                    riding prompts, their graphs); crops.py makes an image's crops;
                    prefill_launcher.py enqueues them off the scheduler's thread
    sampler.py      finalize: masks, sampling, region values, next inputs, outputs to host
    adapter_rows.py each row's (and prefix job's) adapter slot, and the stacked adapter
                    weights the forwards read (only with adapters on)
    graphs.py       graph sets and the buckets they are captured for

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
import os
from typing import TYPE_CHECKING

import numpy as np
import torch

from decoding.mask_table import MaskTable
from image_pipeline import ImagePreparer
from vlm_server.engine.config import AUTO_COMPILE_THREADS, COMPILE_THREADS_AUTO, EngineConfig
from vlm_server.engine.core.observer import NO_OBSERVER, Observer
from vlm_server.engine.core.prefix_jobs import PrefixJob
from vlm_server.engine.core.step_inputs import StepInputs
from vlm_server.engine.device import graphs, precompile
from vlm_server.engine.device.adapter_rows import AdapterRows
from vlm_server.engine.device.buffers import StepBuffers
from vlm_server.engine.device.crops import ImageCrops
from vlm_server.engine.device.forwards import StepForwards
from vlm_server.engine.device.kv_pool import KVPool
from vlm_server.engine.device.model_entry import ModelEntryPoints
from vlm_server.engine.device.prefill import Prefill
from vlm_server.engine.device.prefill_launcher import PrefillLauncher, PrefixBatch
from vlm_server.engine.device.sampler import Sampler
from vlm_server.engine.device.spatial_refs import SpatialRefSlots
from vlm_server.engine.device.streams import Device, TorchDevice, resolved_prefill_sms
from vlm_server.models import capabilities
from vlm_server.models.common import launch_overlap
from vlm_server.models.lora import formats
from vlm_server.models.lora.bank import LoraBank

if TYPE_CHECKING:
    from vlm_server.models.interface import DeviceModel

log = logging.getLogger(__name__)


def compile_threads(asked: int) -> int:
    """``EngineConfig.compile_threads`` resolved: itself, or for auto one per core, at most
    AUTO_COMPILE_THREADS."""
    if asked == COMPILE_THREADS_AUTO:
        return min(AUTO_COMPILE_THREADS, os.cpu_count() or 1)
    return asked


def adapter_bank(entry: ModelEntryPoints, cfg: EngineConfig) -> LoraBank | None:
    """The stacked adapter weights, when the config takes adapters and the family has
    targets; None otherwise."""
    targets = entry.lora_targets
    if not cfg.adapters_enabled or targets is None:
        return None
    return formats.new_bank(
        targets, cfg.max_adapters, cfg.max_adapter_rank, entry.dtype, entry.device
    )


def kv_page_bytes(model: DeviceModel, page_size: int, kv_dtype: str = "auto") -> int:
    """Bytes of one KV page of every layer of ``model`` in ``kv_dtype``'s format."""
    return ModelEntryPoints(model).kv_page_bytes(page_size, kv_dtype)


class ModelRuntime:
    """The runtime the scheduler drives (core/runtime_protocol.py), composed of its parts."""

    def __init__(
        self,
        model: DeviceModel,
        cfg: EngineConfig,
        table: MaskTable,
        device: Device | None = None,
        observer: Observer = NO_OBSERVER,
        image_preparer: ImagePreparer | None = None,
    ) -> None:
        capabilities.check(model, vars(cfg))  # what the settings ask of the model's family
        self.entry = entry = ModelEntryPoints(model)
        self.cfg = cfg
        # Makes the crops of host-decoded images (`HostImage`), on the model's device.
        self.image_preparer = image_preparer or ImagePreparer(device=entry.device)
        # The partition in effect (0: none); `PREFILL_SMS_AUTO` is resolved from the chip here.
        self.prefill_sms = resolved_prefill_sms(cfg.prefill_sms, entry.device)
        self.dev: Device = device or TorchDevice(
            entry.device, self.prefill_sms, both_lanes=cfg.prefill_sms_when_streaming > 0
        )
        self._check_carveout()
        vision_fp8, why = entry.wants_fp8_vision(cfg.vision_fp8, cfg.vision_weights)
        if cfg.vision_fp8 is None:
            log.info("vision_fp8 %s", why)
        if vision_fp8:
            entry.use_fp8_vision()
        fp8_act, why = entry.wants_fp8_expert_activations(cfg.experts_fp8_activations)
        if cfg.experts_fp8_activations is None:
            log.info("experts_fp8_activations %s", why)
        if fp8_act:
            entry.use_fp8_expert_activations()
        self.fused_decode = entry.use_fused_decode(cfg.fused_decode)
        # Before any graph captures the kernels that read it.
        always = launch_overlap.enable(cfg.launch_overlap == "always", entry.device)
        early_when_idle = cfg.launch_overlap == "idle" and launch_overlap.supported(entry.device)
        # The mode in effect: "off" where the chip or Triton has no early launches.
        self.launch_overlap = "always" if always else "idle" if early_when_idle else "off"
        dev = self.dev
        self.pool = KVPool(dev, entry, cfg)
        self.buffers = StepBuffers.allocate(
            dev, cfg, entry.dim, entry.dtype, entry.device, tuple(self.pool.block_host.shape)
        )
        self.crops = ImageCrops(self.image_preparer, dev, cfg, entry.device)
        # Resident finetune adapters (models/lora/bank.py) and each row's slot: only when
        # the server takes adapters and the family declares targets.
        self.adapter_bank = adapter_bank(entry, cfg)
        lanes = 2 if cfg.interactive_prefill_batch else 1  # the interactive lane's slots
        self.adapters = (
            AdapterRows(
                dev,
                self.adapter_bank,
                cfg.max_rows + 1,
                lanes * cfg.prefill_batches,
                max(cfg.max_prefill_batch, cfg.interactive_prefill_batch),
                entry.image_prefix_len,
                prefix_paths=lanes,
            )
            if self.adapter_bank is not None
            else None
        )
        parts = (dev, entry, cfg, self.pool, self.buffers, self.crops, self.adapters)
        self.prefill = Prefill(*parts)
        # Batches enqueued off the scheduler's thread on CUDA (prefill_launcher.py says why),
        # one thread a lane: an interactive batch never waits behind a background launch.
        self.prefill_launcher = PrefillLauncher(
            self.prefill.launch, threaded=dev.is_cuda, device=entry.device
        )
        self.interactive_prefill = Prefill(*parts, interactive=True) if lanes > 1 else None
        self.interactive_launcher = (
            PrefillLauncher(
                self.interactive_prefill.launch, threaded=dev.is_cuda, device=entry.device
            )
            if self.interactive_prefill is not None
            else None
        )
        # Every row's spatial-reference embeddings: three slots per reference (a box's).
        refs = SpatialRefSlots(dev, entry, cfg.max_rows + 1, 3 * cfg.max_spatial_refs)
        self.steps = StepForwards(
            dev, entry, cfg, self.pool, self.buffers, observer, refs, self.adapters
        )
        # Launched prefix batches' handles, each with whether it runs in the SM partition and
        # whether on the interactive lane.
        self._prefixes_in_flight: list[tuple[object, bool, bool]] = []
        self.steps.capture_early = early_when_idle
        self.steps.prefill_contends = self.prefill_contends
        self.steps.prefill_busy = self.prefill_busy
        self.sampler = Sampler(dev, entry, cfg, self.buffers, table, observer)
        # What the scheduler's page allocator needs: the pool's size and the block table's
        # pinned host mirror (its rows; the pad row stays on the sink page).
        self.kv_pages = self.pool.n_pages
        self.block_table: np.ndarray = self.pool.block_table
        # Image prefixes: batches of up to max_prefill_batch images, prefill_batches in flight,
        # with up to prefix_prompt_tokens of their first users' prompts (core/prefix_jobs.py).
        self.prefix_slots = cfg.prefill_batches
        self.prefix_prompt_tokens = cfg.prefix_prompt_tokens
        # The interactive lane: its batches in flight at once and pictures a batch (0: none).
        self.interactive_prefix_slots = cfg.prefill_batches if lanes > 1 else 0
        self.interactive_prefill_batch = cfg.interactive_prefill_batch if lanes > 1 else 0

    def _check_carveout(self) -> None:
        cfg = self.cfg
        if self.dev.is_cuda and cfg.prefill_sm_carveout:
            sms = torch.cuda.get_device_properties(self.entry.device).multi_processor_count
            if cfg.prefill_sm_carveout >= sms:
                raise ValueError(
                    f"prefill_sm_carveout ({cfg.prefill_sm_carveout}) must leave the image "
                    f"path some of the device's {sms} SMs"
                )

    # ---- what the scheduler calls (core/runtime_protocol.py) --------------------------

    @torch.inference_mode()
    def launch_prefixes(
        self, jobs: list[PrefixJob], partitioned: bool = False, interactive: bool = False
    ) -> object:
        """Enqueue the image paths and the BOS + image forward of ``jobs`` on a prefill lane
        (prefill.py), the interactive lane when ``interactive``; returns the handle
        `prefix_ready` polls."""
        if interactive:
            if self.interactive_launcher is None:
                raise ValueError("an interactive prefix batch, but the lane is off")
            prefill, launcher, on_partition = (
                self.interactive_prefill,
                self.interactive_launcher,
                False,
            )
        else:
            prefill, launcher = self.prefill, self.prefill_launcher
            on_partition = prefill.on_partition(partitioned)
        # Its lane idle and no tiling twice: no replay can wait behind another.
        idle = not any(lane == interactive for _, _, lane in self._live_prefixes())
        inline = idle and len({job.image.tiling for job in jobs}) == len(jobs)
        handle = launcher.submit(jobs, partitioned, inline)
        self._prefixes_in_flight.append((handle, on_partition, interactive))
        return handle

    def close(self) -> None:
        """Stop the prefill launchers' threads (after the batches handed over)."""
        self.prefill_launcher.close()
        if self.interactive_launcher is not None:
            self.interactive_launcher.close()

    def _live_prefixes(self) -> list[tuple[object, bool, bool]]:
        """The launched prefix batches that may still run (event queries: no sync)."""
        if not self._prefixes_in_flight:  # the common case: nothing to query
            return self._prefixes_in_flight
        live = [b for b in self._prefixes_in_flight if not b[0].query()]  # type: ignore[attr-defined]
        self._prefixes_in_flight = live
        return live

    def prefill_busy(self) -> bool:
        """Whether a launched prefix batch may still run."""
        return bool(self._live_prefixes())

    def prefill_contends(self) -> bool:
        """Whether a prefix batch that may still run has the whole GPU (not the partition):
        decode kernels launched early would hold SMs its kernels need."""
        return any(not part for _, part, _ in self._live_prefixes())

    def prefix_ready(self, handle: object) -> bool:
        """Whether a `launch_prefixes` batch completed: a non-blocking event query."""
        return handle.query()  # type: ignore[attr-defined]

    def wait_prefix(self, handle: object) -> None:
        """Block the calling thread (not the scheduler's) until a batch completed: it sleeps
        on the blocking event instead of polling."""
        handle.synchronize()  # type: ignore[attr-defined]  # watcher thread only, off the tick

    @torch.inference_mode()
    def launch_mixed(self, slot: int, step: StepInputs, after: object | None = None) -> None:
        """Enqueue one mixed step (forwards.py), behind the upload of its block-table rows."""
        if isinstance(after, PrefixBatch):
            after = after.device_event()
        self.steps.launch_mixed(slot, step, after)

    @torch.inference_mode()
    def launch_decode(self, slot: int, step: StepInputs) -> None:
        """Enqueue one decode step (forwards.py), behind the upload of its block-table rows."""
        self.steps.launch_decode(slot, step)

    @torch.inference_mode()
    def finalize(
        self,
        slot: int,
        fin: np.ndarray,
        constrained: bool,
        regions: bool,
        greedy: bool = False,
    ) -> None:
        """Enqueue the sampling of the step in ``slot`` and its outputs' copy (sampler.py)."""
        self.sampler.finalize(slot, fin, constrained, regions, greedy)

    def wait_outputs(self, slot: int) -> None:
        """Block the calling thread (a watcher, not the scheduler's) until the slot's
        results landed on the host; `read_outputs` then returns at once."""
        self.sampler.wait_outputs(slot)

    def read_outputs(self, slot: int, b: int) -> np.ndarray:
        """Wait for the slot's D2H copy (the scheduler's one intended sync) and view it."""
        return self.sampler.read_outputs(slot, b)

    # ---- start-up ---------------------------------------------------------------------

    @torch.inference_mode()
    def capture_graphs(self, progress: bool = True) -> None:
        """Capture the decode forward per (slot, batch bucket), the mixed step's token forward
        per (slot, token bucket), masks + sampling per (slot, batch bucket, constrained,
        regions, greedy) and the BOS + image forward per (images in the batch,
        riding prompt tokens). CUDA only; the CPU keeps running the same work eagerly."""
        if not self.dev.is_cuda:
            return
        # The steps' warm-ups meet nearly every kernel compile (precompile.py).
        threads = compile_threads(self.cfg.compile_threads)
        line = precompile.ahead(self._warm_steps, threads)
        if threads > 1:
            log.info("start-up: %s", line)
        self.steps.capture(progress)
        self.sampler.capture(progress)
        self.prefill.capture_prefixes(progress)
        if self.interactive_prefill is not None:
            self.interactive_prefill.capture_prefixes(progress)

    def _warm_steps(self) -> None:
        """The decode and mixed steps' and the sampling's warm-ups, nothing captured."""
        with graphs.warm_ups_only():
            self.steps.capture(progress=False)
            self.sampler.capture(progress=False)

    @torch.inference_mode()
    def capture_vision_graphs(self, progress: bool = True) -> None:
        """Capture the image path (normalize, vision tower, projection, BOS) once per tiling.
        CUDA only."""
        if not self.dev.is_cuda:
            return
        self.prefill.capture_images(progress)
        if self.interactive_prefill is not None:
            self.interactive_prefill.capture_images(progress)


__all__ = ["ModelRuntime", "kv_page_bytes"]
