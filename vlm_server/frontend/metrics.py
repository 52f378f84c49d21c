"""Prometheus metrics of one server, on a registry of its own (several servers per process
stay apart), served over HTTP on their own port.

Request metrics are recorded by every front door's calls, labelled by door (grpc, http); engine
gauges are read from `Engine.stats()` at scrape time, on the event loop (engines expect to be
called there, not from the HTTP thread).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import threading
from collections.abc import Callable, Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from vlm_server.engine.api import STEP_INTERVAL_BOUNDS_MS, EngineStats
from vlm_server.gc_pauses import GC_BUCKETS, GcPauseCounter, GcPauseTotals

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
# Event-loop lag: from a timer's resolution up to a loop stalled for seconds.
_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Engine events' delay: a fraction of a decode step (~2 ms) matters.
_DELAY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1, 0.5, 2.5)
LOOP_LAG_INTERVAL_S = 0.05
_SCRAPE_TIMEOUT_S = 2.0
_DT = ("door", "task")

StatsSource = Callable[[], EngineStats | None]


class _EngineCollector(Collector):
    """Engine gauges, fetched from the event loop at each scrape."""

    def __init__(self, loop: asyncio.AbstractEventLoop, source: StatsSource) -> None:
        self._loop = loop
        self._source = source

    def _stats(self) -> EngineStats | None:
        if self._loop.is_closed():
            return None
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            return self._source()  # already on the loop (waiting for it would deadlock)

        async def read() -> EngineStats | None:
            return self._source()

        future = asyncio.run_coroutine_threadsafe(read(), self._loop)
        try:
            return future.result(_SCRAPE_TIMEOUT_S)
        except (concurrent.futures.TimeoutError, RuntimeError):
            future.cancel()
            return None

    def describe(self) -> Iterator[Metric]:
        # Registration asks for the names; answering without stats keeps it off the loop.
        return self._families(EngineStats())

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is None:
            return iter(())
        return self._families(stats)

    @staticmethod
    def _families(stats: EngineStats) -> Iterator[Metric]:
        gauges = {
            "vlm_queue_depth": ("requests waiting for the engine", stats.queue_depth),
            "vlm_active_sequences": ("sequences being decoded", stats.active_sequences),
            "vlm_images_decoding": (
                "requests whose JPEG the engine process decodes before admitting them",
                stats.images_decoding,
            ),
            "vlm_kv_pages_in_use": ("KV cache pages in use", stats.kv_pages_in_use),
            "vlm_kv_pages_total": ("KV cache pages in the pool", stats.kv_pages_total),
            "vlm_batch_size": ("rows in the last engine step", stats.last_batch_size),
            "vlm_step_period_ms": ("duration of the last engine step", stats.last_step_ms),
            "vlm_prefix_cache_hit_ratio": (
                "image-prefix cache hits / lookups (0 before any lookup)",
                stats.prefix_hits / stats.prefix_lookups if stats.prefix_lookups else 0.0,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily(
            "vlm_prefix_cache_hits", "image-prefix cache hits", value=stats.prefix_hits
        )
        yield CounterMetricFamily(
            "vlm_prefix_cache_lookups", "image-prefix cache lookups", value=stats.prefix_lookups
        )
        counts = stats.step_interval_counts or (0,) * (len(STEP_INTERVAL_BOUNDS_MS) + 1)
        cumulative, buckets = 0, []
        for bound, count in zip((*STEP_INTERVAL_BOUNDS_MS, math.inf), counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if math.isinf(bound) else repr(bound / 1e3), cumulative))
        yield HistogramMetricFamily(
            "vlm_step_interval_seconds",
            "time between the commits of steps with decode rows: running streams' token gaps",
            buckets=buckets,
            sum_value=stats.step_interval_sum_ms / 1e3,
        )
        yield gc_pause_family(
            "vlm_engine_gc_pause_seconds",
            "Python garbage collection pauses in the engine's own process, by generation "
            "(zero while the engine runs in the server's process: see vlm_gc_pause_seconds)",
            stats.gc_pauses,
        )


def gc_pause_family(name: str, doc: str, totals: GcPauseTotals | None) -> Metric:
    """A histogram by generation of garbage-collection pauses (zeros without totals)."""
    family = HistogramMetricFamily(name, doc, labels=["generation"])
    for generation in range(3):
        counts = totals.counts[generation] if totals else (0,) * (len(GC_BUCKETS) + 1)
        cumulative, buckets = 0, []
        for bound, count in zip((*GC_BUCKETS, math.inf), counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if math.isinf(bound) else repr(bound), cumulative))
        family.add_metric([str(generation)], buckets, totals.sums[generation] if totals else 0.0)
    return family


class GcPauses(Collector):
    """``vlm_gc_pause_seconds``: this process's garbage collections by generation."""

    def __init__(self) -> None:
        self.counter = GcPauseCounter()

    def install(self) -> None:
        self.counter.install()

    def uninstall(self) -> None:
        self.counter.uninstall()

    def collect(self) -> Iterator[Metric]:
        yield gc_pause_family(
            "vlm_gc_pause_seconds",
            "Python garbage collection pauses, by generation (every thread waits)",
            self.counter.totals(),
        )


class ServiceMetrics:
    """The server's metrics and, once `serve` is called, their HTTP endpoint."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # process_resident_memory_bytes and friends (Linux): what a soak run watches.
        ProcessCollector(registry=r)
        # Request metrics carry the front door (grpc, http) they came through.
        self.received = Counter(
            "vlm_requests_received", "requests received, by door and task", _DT, registry=r
        )
        self.requests = Counter(
            "vlm_requests",
            "requests finished, by door, task and status code",
            [*_DT, "code"],
            registry=r,
        )
        self.in_flight = Gauge(
            "vlm_requests_in_flight", "requests being handled, by door", ["door"], registry=r
        )
        for door in ("grpc", "http"):  # exported as 0 before the first request
            self.in_flight.labels(door)
        self.ttft = Histogram(
            "vlm_time_to_first_token_seconds",
            "time from receiving a text request to its first token",
            _DT,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.intake = Histogram(
            "vlm_request_intake_seconds",
            "time from receiving a request to handing it to the engine: checks, image decode",
            _DT,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "vlm_request_duration_seconds",
            "time from receiving a request to its last message",
            _DT,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "vlm_queue_wait_seconds",
            "time requests waited for the engine",
            _DT,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.output_tokens = Counter(
            "vlm_output_tokens", "tokens generated, by door and task", _DT, registry=r
        )
        self.loop_lag = Histogram(
            "vlm_event_loop_lag_seconds",
            f"how late the event loop wakes a task sleeping {LOOP_LAG_INTERVAL_S:g} s "
            "(callbacks that ran long, or the GIL held by other threads)",
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self.events_delay = Histogram(
            "vlm_engine_events_delay_seconds",
            "time from the engine process sending a tick's events (tokens, results) to the "
            "event loop handing them to their streams: the pipe, and the loop and GIL waits "
            "every token crosses before it is sent (engine in its own process only)",
            buckets=_DELAY_BUCKETS,
            registry=r,
        )
        self._lag_task: asyncio.Task[None] | None = None
        self.gc_pauses = GcPauses()
        r.register(self.gc_pauses)
        self.image_cache_bytes = Gauge(
            "vlm_image_cache_bytes", "memory held by EncodeImage images", registry=r
        )
        self._http: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def watch_engine(self, loop: asyncio.AbstractEventLoop, source: StatsSource) -> None:
        """Export the gauges of the engine ``source`` returns (None while there is none)."""
        self.registry.register(_EngineCollector(loop, source))

    def watch_loop(self, interval: float = LOOP_LAG_INTERVAL_S) -> None:
        """Record the running loop's lag every ``interval`` seconds, and every garbage
        collection's pause, until `unwatch_loop`."""
        if self._lag_task is None:
            self._lag_task = asyncio.get_running_loop().create_task(self._sample_lag(interval))

        self.gc_pauses.install()

    async def unwatch_loop(self) -> None:
        self.gc_pauses.uninstall()
        task, self._lag_task = self._lag_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _sample_lag(self, interval: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + interval
            await asyncio.sleep(interval)
            # The loop may run a timer up to its clock resolution early: no negative lag.
            self.loop_lag.observe(max(0.0, loop.time() - due))

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP endpoint (``/metrics``); returns the bound port."""
        self._http, self._thread = start_http_server(port, addr=host, registry=self.registry)
        return int(self._http.server_port)

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
