"""``vlm-server`` (and ``vlm serve``): run the gRPC server until SIGTERM or SIGINT.

On the signal it drains: readiness goes NOT_SERVING, new calls get UNAVAILABLE, accepted ones
finish within the grace period, then the process exits 0. ``--engine`` picks the engine behind
the service (`ENGINES`): ``batched`` (continuous batching) or ``reference`` (the same engine
one request at a time, blocking: a baseline and a debugging aid).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import sys
from collections.abc import Callable, Sequence

import torch

from decoding.limits import ConstraintLimits
from vlm_server.default_model import default_model_dir
from vlm_server.devices import resolve_device
from vlm_server.engine.api import Engine
from vlm_server.service.config import ServerConfig, load_config
from vlm_server.service.logs import configure_logging
from vlm_server.service.memory import freeze, limit_arenas, limit_mmap_threshold
from vlm_server.service.server import VisionLanguageServer
from vlm_server.weights.loader import LoadedModel, load_model

log = logging.getLogger("vlm_server.service.main")  # also when run with -m

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
        return load_model(
            source,
            preset_name=config.preset,
            dtype=dtype,
            device=device,
            tokenizer_path=config.tokenizer,
            progress=True,
        )

    return load


def constraint_limits(config: ServerConfig) -> ConstraintLimits:
    """The engine's bounds on client constraints, from the server's flags."""
    return ConstraintLimits(
        max_choices=config.max_choices,
        max_choice_chars=config.max_choice_chars,
        max_regex_chars=config.max_regex_chars,
        max_dfa_states=config.max_constraint_states,
        compile_seconds=config.constraint_compile_seconds,
    )


def batched_engine(config: ServerConfig, one_at_a_time: bool = False) -> Engine:
    """Continuous batching; loads the model here (the server calls this off its loop).
    ``one_at_a_time``: batch 1, blocking (depth 1), what ``--engine reference`` serves."""
    from vlm_server.engine.config import EngineConfig
    from vlm_server.engine.engine import BatchedEngine

    cfg = EngineConfig(
        max_batch=1 if one_at_a_time else config.max_batch_size,
        max_step_tokens=config.max_step_tokens,
        pipeline_depth=1 if one_at_a_time else config.pipeline_depth,
        max_queue=config.queue_limit,
        kv_budget_bytes=config.kv_budget or None,
        prefill_sm_carveout=config.prefill_sm_carveout,
        constraint_limits=constraint_limits(config),
    )
    return BatchedEngine(_loader(config)(), cfg, preset_name=config.preset)


# Engine implementations by name (--engine).
ENGINES: dict[str, Callable[[ServerConfig], Engine]] = {
    "batched": batched_engine,
    "reference": lambda config: batched_engine(config, one_at_a_time=True),
}


async def serve(config: ServerConfig, engine_factory: Callable[[], Engine]) -> int:
    """Run until a signal, then drain; returns the process exit code (1: it could not start)."""
    try:
        server = VisionLanguageServer(config, engine_factory)
        await server.start()
    except (OSError, ValueError) as err:  # a port in use, an unreadable key or certificate
        log.error("cannot start: %s", err)
        return 1
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ready = asyncio.ensure_future(server.wait_ready())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({ready, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if ready.done() and ready.exception() is not None:
        log.error("model loading failed: %s", ready.exception())
        stopping.cancel()
        await server.shutdown(0)
        return 1
    if ready.done():
        freeze()  # the model is loaded: later collections skip its objects
    await stopping
    log.info("signal received: draining")
    await server.shutdown()
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "vlm-server") -> int:
    """Entry point of ``vlm-server`` (and ``vlm serve``, with ``prog="vlm serve"``); ``argv``
    as for argparse (None: sys.argv[1:])."""
    config = load_config(argv, prog=prog)
    configure_logging(config.log_format, config.log_level)
    if config.engine not in ENGINES:
        log.error("unknown engine %r; choose one of %s", config.engine, sorted(ENGINES))
        return 2
    try:
        resolve_device(config.device)
    except ValueError as err:
        log.error("%s", err)
        return 2
    log.info("config", extra={"fields": dict(config.items())})
    # Before any thread allocates: arenas that exist stay.
    limit_arenas(config.malloc_arena_max)
    limit_mmap_threshold(config.malloc_mmap_threshold)
    sys.setswitchinterval(config.gil_switch_interval_ms / 1000)
    factory = functools.partial(ENGINES[config.engine], config)
    return asyncio.run(serve(config, factory))


if __name__ == "__main__":
    sys.exit(main())
