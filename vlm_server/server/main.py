"""``vlm-server`` (and ``vlm serve``): run the gRPC server until SIGTERM or SIGINT.

On the signal it drains: readiness goes NOT_SERVING, new calls get UNAVAILABLE, accepted ones
finish within the grace period, then the process exits 0. ``--engine`` picks the engine behind
the service (`engines.ENGINES`): ``batched`` (continuous batching) or ``reference`` (the same
engine one request at a time, blocking: a baseline and a debugging aid).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Callable, Sequence

from vlm_server.chip_features import check_config
from vlm_server.devices import resolve_device
from vlm_server.engine.api import Engine
from vlm_server.frontend.logs import configure_logging
from vlm_server.options.command_line import load_config
from vlm_server.options.table import ServerConfig
from vlm_server.server.engines import ENGINES, configure_process, engine_factory
from vlm_server.server.lifecycle import VisionLanguageServer
from vlm_server.server.memory import freeze

log = logging.getLogger("vlm_server.server.main")  # also when run with -m


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
        assert server.engine is not None  # ready: loaded
        server.engine.warm_constraints()
    await stopping
    log.info("signal received: draining")
    await server.shutdown()
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "vlm-server") -> int:
    """Entry point of ``vlm-server`` (and ``vlm serve``, with ``prog="vlm serve"``); ``argv``
    as for argparse (None: sys.argv[1:])."""
    config = load_config(argv, prog=prog)
    configure_logging(config.log_format, config.log_level)  # for the errors below
    if config.engine not in ENGINES:
        log.error("unknown engine %r; choose one of %s", config.engine, sorted(ENGINES))
        return 2
    try:
        resolve_device(config.device)
        check_config(config)  # chip-gated flags: one line naming the flag (chip_features.py)
    except ValueError as err:
        log.error("%s", err)
        return 2
    configure_process(config)
    log.info("config", extra={"fields": dict(config.items())})
    return asyncio.run(serve(config, engine_factory(config)))


if __name__ == "__main__":
    sys.exit(main())
