"""The service core every way of running the engine shares: the image cache, the image
resolver and the request limits around one engine, built from the options alone.

`vlm serve` puts its doors in front of it; `vlm batch` runs lines of a file through it with
no port at all. Both build it here, so a picture is checked, decoded and cached the same way.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from vlm_server.frontend.calls import Identify, Limits, ServiceCore
from vlm_server.frontend.images import (
    ImageCache,
    ImageResolver,
    engine_decode_min_pixels,
    host_image_preparer,
    image_preparer,
)
from vlm_server.frontend.metrics import ServiceMetrics
from vlm_server.options.table import ServerConfig
from vlm_server.server.engines import uses_engine_process


def decode_executor(config: ServerConfig) -> ThreadPoolExecutor:
    """The threads that decode pictures (``--decode-threads``)."""
    return ThreadPoolExecutor(config.decode_threads, thread_name_prefix="image-decode")


def service_core(
    config: ServerConfig,
    executor: ThreadPoolExecutor,
    metrics: ServiceMetrics,
    identify: Identify | None = None,
) -> ServiceCore:
    """A core with no engine yet (set ``core.engine`` once it has started): pictures decode on
    ``executor``, into crops here, or, with an engine process, into shared pixels for it."""
    cache = ImageCache(config.image_cache_bytes, owner_bytes=config.client_cache_bytes)
    in_process = not uses_engine_process(config)
    images = ImageResolver(
        config.image_limits,
        cache,
        executor,
        image_preparer(config) if in_process else host_image_preparer(config),
        host_only=not in_process,
        encoded_min_pixels=engine_decode_min_pixels(config),
    )
    limits = Limits(
        max_message_bytes=config.max_message_bytes,
        max_image_bytes=config.max_image_bytes,
        max_image_pixels=config.max_image_pixels,
        max_image_side=config.max_image_side,
        image_cache_bytes=config.image_cache_bytes,
        max_object_chars=config.max_object_chars,
        max_question_chars=config.max_question_chars,
    )
    return ServiceCore(images, metrics, limits, identify)
