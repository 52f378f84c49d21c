"""What builds the server's engine: the model loader, the engines by name (``--engine``), and
whether the engine runs in this process or in one of its own (``--engine-process``).

Everything here is importable by name, so that an engine process can be handed the same
factory the server would call itself (a process started as ``python -m ...`` could not).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from vlm_server.chip_features import use_chip_profile
from vlm_server.default_model import default_model_dir
from vlm_server.devices import cap_memory, resolve_device
from vlm_server.engine.api import Engine
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.memory_plan import kv_format_of, plan_memory
from vlm_server.frontend.logs import configure_logging
from vlm_server.models import capabilities
from vlm_server.models.interface import LoadedModel, QuantizedWeights
from vlm_server.models.registry import FORMAT_NAMES, load_model, memory_shape, segment_refiner
from vlm_server.options.table import ServerConfig
from vlm_server.plan_view import plan_lines
from vlm_server.server.memory import freeze, limit_arenas, limit_mmap_threshold, trim
from vlm_server.server.weights_start import start_weights

if TYPE_CHECKING:
    from vlm_server.engine.engine import BatchedEngine

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _loader(config: ServerConfig) -> Callable[[], LoadedModel]:
    """A function that loads the configured model (with a progress bar for large files)."""
    device = resolve_device(config.device)
    dtype = (
        DTYPES[config.dtype]
        if config.dtype
        else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    )

    def load() -> LoadedModel:
        if config.model is None:
            log.warning(
                "no --model given: serving the built-in random tiny model, which "
                "answers with random words"
            )
        source = config.model or default_model_dir()
        if config.memory_cap_bytes:
            cap_memory(device, config.memory_cap_bytes)
        # auto resolved (and any format checked to fit) before a byte of weights is read.
        weights = start_weights(
            config.model, config.preset, config.weights, config.engine_config, device
        )
        return load_model(
            source,
            preset_name=config.preset,
            dtype=dtype,
            device=device,
            tokenizer_path=config.tokenizer,
            progress=True,
            weights=weights,
            vision_weights=config.vision_weights,
        )

    return load


def batched_engine(config: ServerConfig, one_at_a_time: bool = False) -> BatchedEngine:
    """Continuous batching; loads the model here (the server calls this off its loop).
    ``one_at_a_time``: batch 1, blocking (depth 1), what ``--engine reference`` serves."""
    from vlm_server.engine.core.observer import NO_OBSERVER
    from vlm_server.engine.engine import BatchedEngine
    from vlm_server.engine.step_trace import StepTrace
    from vlm_server.frontend.images import crop_maker

    cfg = config.engine_config
    if one_at_a_time:
        # One row: nothing to keep back from background work.
        cfg = dataclasses.replace(
            cfg, max_batch_size=1, pipeline_depth=1, background_reserved_rows=0
        )
    started = time.perf_counter()
    loaded = _loader(config)()
    loaded_at = time.perf_counter()
    capabilities.check(loaded.model, vars(config))  # every flag the family cannot serve, at once
    refine = segment_refiner(loaded, config.segment_refiner) if config.segment_refiner else None
    trace = StepTrace(config.step_trace, config.step_trace_steps) if config.step_trace else None
    refined_at = time.perf_counter()
    engine = BatchedEngine(
        loaded,
        cfg,
        preset_name=config.preset,
        observer=trace or NO_OBSERVER,
        image_preparer=crop_maker(config),
        segment_refiner=refine,
    )
    # Where start-up goes (the graphs' captures follow, each set with its own line).
    log.info(
        "start-up: model loaded in %.1f s, refiner %.1f s, engine (KV pages, buffers) %.1f s",
        loaded_at - started,
        refined_at - loaded_at,
        time.perf_counter() - refined_at,
    )
    if trace is not None:
        trace.prefill_busy = engine.runtime.prefill_busy
    log_weights(loaded, cfg.fused_decode and not engine.runtime.fused_decode)
    log_memory_plan(loaded, cfg, engine.runtime.kv_pages)
    return engine


def log_weights(loaded: LoadedModel, fused_off: bool) -> None:
    """One start-up line on weights held in 4 or 8 bits: how many, those kept 16-bit and why,
    and (``fused_off``) that ``--fused-decode`` found no fused products for them."""
    caps = loaded.model.capabilities
    if caps.vision_quantized is not None:
        log.info("vision weights: %s", _held_line(caps.vision_quantized))
    quantized = caps.quantized
    if quantized is None:
        return
    line = f"weights: {_held_line(quantized)}"
    if fused_off:
        line += (
            "; --fused-decode: off, the fused products stack no block that mixes 16-bit and "
            "quantized linears nor INT4 groups other than the kernels' (the quantized layers' "
            "own kernels serve decode steps)"
        )
    log.info(line)


def _held_line(quantized: QuantizedWeights) -> str:
    """How many linears ``quantized`` holds in which format, those kept 16-bit and why."""
    group = f" in groups of {quantized.group_size}" if quantized.group_size else ""
    line = f"{len(quantized.weights)} linears in {quantized.format}{group}"
    if quantized.kept:
        line += f"; kept 16-bit: {', '.join(f'{k} ({v})' for k, v in quantized.kept.items())}"
    return line


def log_memory_plan(loaded: LoadedModel, cfg: EngineConfig, kv_pages: int) -> None:
    """The memory plan `vlm plan` prints for this device, beside the pages the engine took
    (they differ by what the plan estimates: the CUDA context, what was free)."""
    device = loaded.model.device
    activations = FORMAT_NAMES[loaded.model.dtype]
    quantized = loaded.model.capabilities.quantized
    weights = activations if quantized is None else quantized.format
    shape = memory_shape(loaded.config)
    kv = kv_format_of(cfg.kv_dtype, activations)
    if device.type != "cuda":
        plan = plan_memory(shape, cfg, 0, weights, kv, cuda=False)
        log.info("memory plan: %d KV pages planned, %d taken", plan.kv_pages, kv_pages)
        return
    props = torch.cuda.get_device_properties(device)
    plan = plan_memory(shape, cfg, props.total_memory, weights, kv)
    lines = plan_lines(plan, loaded.config.name, props.name)
    log.info("%s\n  engine: %d KV pages taken", "\n".join(lines), kv_pages)


# Engine implementations by name (--engine); picklable, for an engine process.
ENGINES: dict[str, Callable[[ServerConfig], BatchedEngine]] = {
    "batched": batched_engine,
    "reference": functools.partial(batched_engine, one_at_a_time=True),
}


def uses_engine_process(config: ServerConfig) -> bool:
    """``--engine-process``, with auto resolved: on where the model runs on CUDA."""
    if config.engine_process == "auto":
        return resolve_device(config.device).type == "cuda"
    return config.engine_process == "on"


def configure_process(config: ServerConfig) -> None:
    """Logging, allocator and GIL settings of a server or engine process."""
    configure_logging(config.log_format, config.log_level)
    # Before any thread allocates: arenas that exist stay.
    limit_arenas(config.malloc_arena_max)
    limit_mmap_threshold(config.malloc_mmap_threshold)
    sys.setswitchinterval(config.gil_switch_interval_ms / 1000)
    if config.chip_profile is not None:  # read by chip_features, here and in the engine process
        use_chip_profile(config.chip_profile)


def _collect_and_trim() -> None:
    gc.collect()
    trim()


def _in_process(build: Callable[[], BatchedEngine]) -> Engine:
    from vlm_server.server.in_process import InProcessEngine

    return InProcessEngine(build())


def engine_factory(config: ServerConfig) -> Callable[[], Engine]:
    """What builds the configured engine: in this process, or in one of its own."""
    build = functools.partial(ENGINES[config.engine], config)
    if not uses_engine_process(config):
        return functools.partial(_in_process, build)
    from vlm_server.engine.process.client import ProcessEngine

    return functools.partial(
        ProcessEngine,
        build,
        setup=functools.partial(configure_process, config),
        on_ready=freeze,
        housekeeping=_collect_and_trim,
        housekeeping_interval=config.memory_trim_interval,
    )
