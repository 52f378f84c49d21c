"""Running a server inside a process (tests, notebooks): its own event loop on a thread.

`ServerThread` starts a `VisionLanguageServer` on a background loop, so blocking clients can
call it from the calling thread; `in_process` makes the factory of a server serving a batched
engine in its own process, and `engine_of` finds that engine again. `GatedBatchedEngine` lets
a test hold the engine at start or before a decode commit, to put the server in a known state
without sleeping. `wait_for` polls a condition until a deadline.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Iterator
from types import TracebackType
from typing import Any, TypeVar

import pytest

from tests.support import early
from tests.support.observers import StepLog
from vlm_server.engine.api import EngineError, Finished
from vlm_server.engine.core.pipeline import LaunchKind, Step
from vlm_server.engine.core.sequence import Sequence
from vlm_server.engine.engine import BatchedEngine
from vlm_server.http.server import Authorizer
from vlm_server.options.table import ServerConfig
from vlm_server.server.in_process import InProcessEngine
from vlm_server.server.lifecycle import EngineFactory, VisionLanguageServer

T = TypeVar("T")

GATE_TIMEOUT_S = 60.0  # a forgotten gate must not hang a test run forever


def wait_for(
    predicate: Callable[[], T],
    timeout: float = 20.0,
    interval: float = 0.005,
    what: str = "the condition",
) -> T:
    """Poll ``predicate`` until it returns something truthy; TimeoutError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def in_process(make: Callable[[], BatchedEngine]) -> EngineFactory:
    """The factory of a server serving what ``make`` builds in the server's own process."""
    return lambda: InProcessEngine(make())


def engine_of(server: ServerThread) -> BatchedEngine:
    """The batched engine a server (built with `in_process`) serves."""
    assert server.server is not None
    engine = server.server.engine
    assert isinstance(engine, InProcessEngine), engine
    return engine.batched


def local_config(**overrides: Any) -> ServerConfig:
    """A config for a server on loopback with free ports; HTTP is off unless ``http_port`` is
    given (-1: any free port)."""
    values: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "http_port": 0,
        "metrics_port": 0,
        "decode_threads": 2,
        "grace_period": 20.0,
    }
    values.update(overrides)
    return ServerConfig(**values)


class ServerThread:
    """A server on a private event loop in a daemon thread; use as a context manager."""

    def __init__(
        self,
        config: ServerConfig,
        engine_factory: EngineFactory,
        http_auth: Authorizer | None = None,
    ) -> None:
        self.config = config
        self._factory = engine_factory
        self._http_auth = http_auth
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, daemon=True, name="vlm-server-loop"
        )
        self.server: VisionLanguageServer | None = None

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = 60.0) -> T:
        """Run ``coro`` on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro: Coroutine[Any, Any, T]) -> Any:
        """Start ``coro`` on the server's loop; returns a concurrent.futures.Future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def start(self, wait_ready: bool = True) -> ServerThread:
        self._thread.start()

        async def create() -> VisionLanguageServer:
            server = VisionLanguageServer(self.config, self._factory, self._http_auth)
            await server.start()
            return server

        self.server = self.run(create())
        if wait_ready:
            self.run(self.server.wait_ready())
        return self

    @property
    def target(self) -> str:
        assert self.server is not None
        return f"{self.config.host}:{self.server.port}"

    @property
    def http_url(self) -> str:
        """Base URL of the HTTP door's API (``.../v1``)."""
        assert self.server is not None and self.server.http_port, "HTTP is off"
        return f"http://{self.config.host}:{self.server.http_port}/v1"

    @property
    def metrics_url(self) -> str:
        assert self.server is not None
        return f"http://{self.config.host}:{self.server.metrics_port}/metrics"

    def stop(self, grace: float = 10.0) -> None:
        """Drain and stop the server, then the loop."""
        if self.server is not None and not self.loop.is_closed():
            self.run(self.server.shutdown(grace))
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
        if not self.loop.is_closed() and not self.loop.is_running():
            self.loop.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class GatedBatchedEngine(BatchedEngine):
    """A `BatchedEngine` a test can hold and watch.

    Gates, open until cleared: `start_gate` holds `start`; `token_gate` holds the scheduler
    thread before it commits a decode step, so every request of that batch has streamed at
    least its first token and none advances while held (`holding` is set then, and
    `held_requests` names the batch's request ids).

    Records, by request id: `prefilled` lists every request whose prefill was launched, in
    order, once per prompt chunk (a request absent from it never ran); `outcomes` maps each
    request the scheduler ended to its finish reason (eos, length, max_objects) or error code
    (CANCELLED, DEADLINE_EXCEEDED), and `ended` to a weak reference to its sequence.
    `largest_batch` is the most sequences decoded in one step.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, observer=StepLog(self._on_step, self._on_end), **kwargs)
        self.start_gate = threading.Event()
        self.start_gate.set()
        self.token_gate = threading.Event()
        self.token_gate.set()
        self.holding = threading.Event()
        self.held_requests: tuple[str, ...] = ()
        self.prefilled: list[str] = []
        self.outcomes: dict[str, str] = {}
        self.ended: dict[str, weakref.ref[Sequence]] = {}
        self.largest_batch = 0

    def _on_end(self, seq: Sequence, event: Finished | EngineError) -> None:
        rid = seq.request.request_id
        self.ended[rid] = weakref.ref(seq)
        if isinstance(event, Finished):
            self.outcomes[rid] = event.finish_reason
        else:
            self.outcomes[rid] = event.code.value

    def start(self) -> None:
        self.start_gate.wait(GATE_TIMEOUT_S)
        super().start()

    def cached_prefix_pages(self) -> int:
        """KV pages held by cached image prefixes (call when `idle`: none is in use then)."""
        return self.scheduler.prefix_cache.evictable_pages()

    def _on_step(self, phase: str, step: Step) -> None:
        """Called on the scheduler thread around each pipeline action."""
        if phase == "launch":
            plan = step.plan
            n_decode = len(step.seqs) if plan is None else plan.n_decode
            self.largest_batch = max(self.largest_batch, n_decode)
            self.prefilled.extend(s.request.request_id for s in step.seqs[n_decode:])
        if phase != "commit" or step.kind is not LaunchKind.DECODE or self.token_gate.is_set():
            return
        self.held_requests = tuple(s.request.request_id for s in step.seqs)
        self.holding.set()
        self.token_gate.wait(GATE_TIMEOUT_S)
        self.holding.clear()


def module_server(
    request: pytest.FixtureRequest, test_name: str, make_config: Callable[[], ServerConfig]
) -> Iterator[ServerThread | None]:
    """A module fixture's body: the server of the test ``test_name`` alone (no other test
    uses it), started without waiting when the module starts and that test is in the run, so
    its model (and engine process) loads while the tests before it run; else None."""
    if not early.in_run(request, test_name):
        yield None
        return
    from vlm_server.server.engines import engine_factory

    config = make_config()
    running = ServerThread(config, engine_factory(config))
    try:
        yield running.start(wait_ready=False)
    finally:
        running.stop()
