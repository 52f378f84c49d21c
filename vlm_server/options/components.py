"""The configurations of the components the option table feeds (the engine, its constraint
limits, the image checks), built from a `ServerConfig`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from decoding.limits import ConstraintLimits
from image_pipeline import ImageLimits
from vlm_server.engine.config import COMPILE_THREADS_AUTO, PREFILL_SMS_AUTO, EngineConfig

if TYPE_CHECKING:
    from vlm_server.options.table import ServerConfig


def engine_config(config: ServerConfig) -> EngineConfig:
    """The batched engine's configuration (``--engine reference`` narrows it)."""
    return EngineConfig(
        max_batch_size=config.max_batch_size,
        max_step_tokens=config.max_step_tokens,
        pipeline_depth=config.pipeline_depth,
        max_queue=config.max_queue,
        kv_budget_bytes=config.kv_budget_bytes or None,
        kv_dtype=config.kv_dtype,
        gpu_memory_bytes=config.memory_cap_bytes or None,
        prefill_sm_carveout=config.prefill_sm_carveout,
        prefill_sms=PREFILL_SMS_AUTO if config.prefill_sms == "auto" else int(config.prefill_sms),
        compile_threads=(
            COMPILE_THREADS_AUTO
            if config.compile_threads == "auto"
            else int(config.compile_threads)
        ),
        prefill_sms_when_streaming=config.prefill_sms_when_streaming,
        max_prefill_batch=config.max_prefill_batch,
        decode_pace_ms=config.decode_pace_ms,
        background_reserved_rows=config.reserved_rows_value,
        background_prefill_batch=config.background_prefill_batch,
        interactive_prefill_batch=config.interactive_prefill_batch,
        background_yield=config.background_yield,
        background_pace_ms=config.background_pace_ms,
        prefill_batches=config.prefill_batches,
        prefix_prompt_tokens=config.prefix_prompt_tokens,
        crop_graph_sizes=config.crop_graph_sizes,
        vision_fp8=_switch(config.vision_fp8),
        vision_weights=config.vision_weights,
        experts_fp8_activations=_switch(config.experts_fp8_activations),
        fused_decode=config.fused_decode,
        launch_overlap=config.launch_overlap,
        max_spatial_refs=config.max_spatial_refs,
        constraint_limits=config.constraint_limits,
        adapters_dir=config.adapters_dir,
        adapter_endpoint=config.adapter_endpoint,
        adapter_api_key=config.adapter_api_key,
        max_adapters=config.max_adapters,
        max_adapter_rank=config.max_adapter_rank,
        adapter_wait_s=config.adapter_wait_s,
        adapter_download_bytes=config.adapter_download_bytes,
        adapter_download_timeout_s=config.adapter_download_timeout_s,
    )


def _switch(value: str) -> bool | None:
    """An auto/on/off option's engine value (None: auto, the engine decides)."""
    return None if value == "auto" else value == "on"


def constraint_limits(config: ServerConfig) -> ConstraintLimits:
    """The engine's bounds on client constraints (choices / regex)."""
    return ConstraintLimits(
        max_choices=config.max_choices,
        max_choice_chars=config.max_choice_chars,
        max_regex_chars=config.max_regex_chars,
        max_constraint_states=config.max_constraint_states,
        constraint_compile_seconds=config.constraint_compile_seconds,
    )


def image_limits(config: ServerConfig) -> ImageLimits:
    """The checks of every uploaded image (0 turns the side and ratio rules off)."""
    return ImageLimits(
        max_image_bytes=config.max_image_bytes,
        max_image_pixels=config.max_image_pixels,
        max_image_side=config.max_image_side or None,
        max_image_pixels_per_byte=config.max_image_pixels_per_byte or None,
        image_free_pixels=config.image_free_pixels,
    )
