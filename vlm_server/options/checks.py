"""The checks of the option values the server process itself uses (not a component's)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vlm_server.options.table import ServerConfig

MIB = 1 << 20


def check_server_values(config: ServerConfig) -> None:
    """Checks of the values the server process itself uses (the values other components
    use are checked by those components)."""
    _at_least(
        config,
        1,
        "max_message_bytes",
        "max_http_body_bytes",
        "max_batch_file_bytes",
        "max_batch_lines",
        "max_object_chars",
        "max_question_chars",
        "decode_threads",
        "image_decode_budget",
        "image_cache_bytes",
        "image_cache_client_bytes",
        "step_trace_steps",
    )
    _at_least(
        config,
        0,
        "grace_period",
        "batch_concurrency",
        "image_gpu_decode_min_pixels",
        "malloc_arena_max",
        "malloc_mmap_threshold",
        "memory_trim_interval",
    )
    for name in ("port", "metrics_port"):
        if not 0 <= getattr(config, name) <= 65535:
            raise ValueError(f"{name} must be in 0..65535 (0 = any free port)")
    if not -1 <= config.http_port <= 65535:
        raise ValueError("http_port must be in -1..65535 (0 = off, -1 = any free port)")
    if not 0.01 <= config.gil_switch_interval_ms <= 100:
        raise ValueError(
            f"gil_switch_interval_ms must be in 0.01..100, got {config.gil_switch_interval_ms}"
        )
    if config.malloc_mmap_threshold > 32 * MIB:
        raise ValueError("malloc_mmap_threshold must be at most 32MiB (glibc's ceiling)")
    if (config.tls_cert is None) != (config.tls_key is None):
        raise ValueError("tls_cert and tls_key go together: give both or neither")
    if config.tls_client_ca is not None and config.tls_cert is None:
        raise ValueError("tls_client_ca needs tls_cert and tls_key (mutual TLS is TLS)")


def _at_least(config: ServerConfig, minimum: int, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")
