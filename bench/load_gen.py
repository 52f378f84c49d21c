"""gRPC load generator: client-side latency and throughput of a running (or spawned) server.

Closed loop keeps C requests in flight (C = each ``--concurrency`` level); open loop issues
requests at Poisson arrival times (each ``--rates`` level, req/s) whatever the server's pace,
and counts latency from the scheduled arrival, so a slow server cannot hide its queueing.
Each level stops issuing after ``--requests`` requests or ``--duration`` seconds, whichever
comes first; requests in flight then finish and count.

Workloads (temperature 0, fixed limits; random weights stop early at times, so the actual
output tokens are reported next to every figure):

    query3     Query, streamed, max_tokens 3 (a short direct answer)
    query30    Query, streamed, max_tokens 30 (a short reasoning answer)
    reason64   Query with grounded reasoning, streamed: 64 reasoning tokens, then a 3-token
               answer (a regex of three digits reserves its tokens in max_tokens 67)
    caption64  Caption, streamed, max_tokens 64
    caption128 Caption, streamed, max_tokens 128 (decode throughput under load)
    point5     Point, max_objects 5 (unary)
    detect5    Detect, max_objects 5 (unary)
    segment    Segment, max_tokens --segment-tokens (unary)

Images are generated JPEGs (e.g. 800x600, 4000x3000), made before a level's clock starts:
``unique`` stamps the request index into every picture (no prefix or image-cache hits),
``repeated`` sends one picture every time (prefix reuse).

Reported per level: time to first token (first streamed delta; unary: the whole call),
inter-token latency (gaps between streamed deltas) and time per output token after the first,
end-to-end p50/p90/p99, req/s, output tokens/s, goodput (requests within ``--slo-ms`` end to
end, per second), the server's own metrics (queue wait, prefill, cached tokens) and its
event-loop lag over the level (p50 / p99 from the ``vlm_event_loop_lag_seconds`` histogram,
scraped before and after each level; a spawned server's metrics port is known, a running one's
is ``--metrics-url``, by default port 9464 on the target's host; unreachable: no lag columns).

    python -m bench.load_gen --target localhost:50051 --workloads query3 caption64
    python -m bench.load_gen --spawn --concurrency 1 4 --requests 50 -- --model DIR \
        --device cuda --dtype bf16 --max-batch-size 64
    python -m bench.load_gen --spawn --scenario query3:800x600:unique:c1,c4,r10 -- --preset tiny

``--doors grpc http`` runs every level through each front door in turn (gRPC, and the HTTP
door's Moondream API with server-sent events), with the same pictures and settings; rows carry
their ``door``. HTTP vs gRPC on the same server, short answers on one repeated picture:

    python -m bench.load_gen --spawn --doors grpc http \
        --scenario query3:800x600:repeated:c64 -- --model DIR --device cuda --dtype bf16

With ``--spawn`` the server (``vlm serve`` with the flags after ``--``) runs as a subprocess on
a free loopback port, is waited on through gRPC health readiness and stopped with SIGTERM at
the end; its log goes to ``<out>/<tag>_server.log``. Writes ``<tag>.json`` and two PNG plots
under ``--out`` (default bench/results/<device>/) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from tqdm import tqdm

from bench.http_client import HttpLoadClient
from bench.synth_images import parse_size, unique_images
from vlm_server.client import AsyncVisionLanguageClient
from vlm_server.client import types as t

SERVICE_NAME = "vlm.v1.VisionLanguage"
REPO_ROOT = Path(__file__).resolve().parent.parent
DOORS = ("grpc", "http")
Client = AsyncVisionLanguageClient | HttpLoadClient


# ---- workloads ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """One kind of request with fixed output limits."""

    name: str
    rpc: str  # query | caption | point | detect | segment
    streamed: bool
    max_tokens: int | None = None
    max_objects: int | None = None
    question: str = ""
    reasoning: bool = False
    regex: str | None = None


def workloads(segment_tokens: int) -> dict[str, Workload]:
    """The named workloads; ``segment_tokens`` caps the outline's path tokens."""
    items = [
        Workload("query3", "query", True, max_tokens=3, question="What is in this image?"),
        Workload(
            "query30",
            "query",
            True,
            max_tokens=30,
            question="Describe the main object in this image and explain your reasoning.",
        ),
        Workload(
            "reason64",
            "query",
            True,
            max_tokens=67,
            question="How many objects are in this image?",
            reasoning=True,
            regex="[0-9] [0-9] [0-9]",
        ),
        Workload("caption64", "caption", True, max_tokens=64),
        Workload("caption128", "caption", True, max_tokens=128),
        Workload("point5", "point", False, max_objects=5),
        Workload("detect5", "detect", False, max_objects=5),
        Workload("segment", "segment", False, max_tokens=segment_tokens),
    ]
    return {w.name: w for w in items}


@dataclass(frozen=True)
class Level:
    """A closed-loop concurrency (``kind`` "closed") or an open-loop rate ("open", req/s)."""

    kind: str
    value: float

    @property
    def label(self) -> str:
        return f"c={int(self.value)}" if self.kind == "closed" else f"r={self.value:g}/s"


@dataclass(frozen=True)
class Scenario:
    workload: Workload
    size: tuple[int, int]
    mode: str  # unique | repeated
    levels: tuple[Level, ...]

    @property
    def name(self) -> str:
        return f"{self.workload.name}/{self.size[0]}x{self.size[1]}/{self.mode}"


def parse_levels(text: str) -> tuple[Level, ...]:
    """``"c1,c4,r2.5"`` -> closed loop at 1 and 4, open loop at 2.5 req/s."""
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if len(item) < 2 or item[0] not in "cr":
            raise ValueError(f"a level is cN (concurrency) or rX (req/s), not {item!r}")
        if item[0] == "c":
            out.append(Level("closed", int(item[1:])))
        else:
            out.append(Level("open", float(item[1:])))
        if out[-1].value <= 0:
            raise ValueError(f"a level must be positive, not {item!r}")
    return tuple(out)


def parse_scenario(
    text: str, known: dict[str, Workload], default_levels: tuple[Level, ...]
) -> Scenario:
    """``WORKLOAD[:WxH[:unique|repeated[:LEVELS]]]``, e.g. ``query3:800x600:unique:c1,c16``."""
    parts = text.split(":")
    if parts[0] not in known:
        raise ValueError(f"unknown workload {parts[0]!r}; choose from {sorted(known)}")
    size = parse_size(parts[1]) if len(parts) > 1 and parts[1] else (800, 600)
    mode = parts[2] if len(parts) > 2 and parts[2] else "unique"
    if mode not in ("unique", "repeated"):
        raise ValueError(f"image mode must be unique or repeated, not {mode!r}")
    levels = parse_levels(parts[3]) if len(parts) > 3 and parts[3] else default_levels
    return Scenario(known[parts[0]], size, mode, levels)


# ---- one request ----------------------------------------------------------------------------


@dataclass
class Record:
    """What the client saw of one request (seconds), plus the server's own metrics."""

    ok: bool
    error: str = ""
    streamed: bool = False
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)  # between consecutive deltas
    output_tokens: int = 0
    objects: int = 0
    finish_reason: str = ""
    server: t.Metrics | None = None


async def run_one(
    client: Client,
    wl: Workload,
    image: bytes,
    seed: int,
    t0: float,
    timeout: float,
) -> Record:
    """Issue one request; latencies count from ``t0`` (perf_counter seconds)."""
    settings: dict[str, Any] = {"temperature": 0.0, "seed": seed}
    if wl.max_tokens is not None:
        settings["max_tokens"] = wl.max_tokens
    if wl.max_objects is not None:
        settings["max_objects"] = wl.max_objects
    try:
        if wl.streamed:
            if wl.rpc == "query":
                extra: dict[str, Any] = {"reasoning": True} if wl.reasoning else {}
                if wl.regex is not None:
                    extra["regex"] = wl.regex
                events = client.query_stream(
                    image, wl.question, timeout=timeout, **extra, **settings
                )
            else:
                events = client.caption_stream(image, "normal", timeout=timeout, **settings)
            first: float | None = None
            last = 0.0
            gaps: list[float] = []
            result: t.TextResult | None = None
            async for event in events:
                now = time.perf_counter()
                if isinstance(event, t.TextDelta):
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
                else:
                    result = event
            end = time.perf_counter()
            if result is None:
                return Record(False, "NO_RESULT", e2e_s=end - t0)
            return Record(
                True,
                streamed=True,
                ttft_s=(first if first is not None else end) - t0,
                e2e_s=end - t0,
                gaps_s=gaps,
                output_tokens=result.metrics.output_tokens,
                finish_reason=result.finish_reason,
                server=result.metrics,
            )
        method = {"point": client.point, "detect": client.detect, "segment": client.segment}[wl.rpc]
        res = await method(image, "object", timeout=timeout, **settings)
        end = time.perf_counter()
        objects = (
            len(res.points)
            if isinstance(res, t.PointResult)
            else len(res.boxes)
            if isinstance(res, t.DetectResult)
            else len(res.polygons)
        )
        return Record(
            True,
            ttft_s=end - t0,
            e2e_s=end - t0,
            output_tokens=res.metrics.output_tokens,
            objects=objects,
            finish_reason=res.finish_reason,
            server=res.metrics,
        )
    except t.VlmError as err:
        return Record(False, err.code.name, e2e_s=time.perf_counter() - t0)
    except (grpc.RpcError, aiohttp.ClientError, OSError) as err:  # OSError: TimeoutError too
        return Record(False, type(err).__name__, e2e_s=time.perf_counter() - t0)


# ---- statistics -----------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); NaN for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _dist_ms(values: Sequence[float], prefix: str) -> dict[str, float]:
    ms = [v * 1e3 for v in values]
    out = {f"{prefix}_p{q}_ms": percentile(ms, q) for q in (50, 90, 99)}
    out[f"{prefix}_mean_ms"] = sum(ms) / len(ms) if ms else float("nan")
    return out


def summarize(records: Sequence[Record], wall_s: float, slo_ms: float) -> dict[str, Any]:
    """Aggregate one level: counts, latency percentiles (ms), rates and goodput."""
    ok = [r for r in records if r.ok]
    errors = Counter(r.error for r in records if not r.ok)
    tokens = [r.output_tokens for r in ok]
    # Time per output token after the first: the decode pace one stream sees.
    tpot = [
        (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)
        for r in ok
        if r.streamed and r.output_tokens > 1
    ]
    within = sum(1 for r in ok if r.e2e_s * 1e3 <= slo_ms)
    servers = [r.server for r in ok if r.server is not None]
    wall = max(wall_s, 1e-9)
    row: dict[str, Any] = {
        "requests": len(records),
        "ok": len(ok),
        "errors": dict(errors),
        "wall_s": wall_s,
        "req_per_s": len(ok) / wall,
        "tokens_per_s": sum(tokens) / wall,
        "output_tokens_total": sum(tokens),
        "output_tokens_mean": sum(tokens) / len(tokens) if tokens else float("nan"),
        "output_tokens_min": min(tokens) if tokens else 0,
        "output_tokens_max": max(tokens) if tokens else 0,
        "objects_mean": sum(r.objects for r in ok) / len(ok) if ok else float("nan"),
        "finish_reasons": dict(Counter(r.finish_reason for r in ok)),
        "slo_ms": slo_ms,
        "goodput_req_per_s": within / wall,
        "slo_attainment": within / len(records) if records else float("nan"),
    }
    row |= _dist_ms([r.ttft_s for r in ok], "ttft")
    row |= _dist_ms([g for r in ok for g in r.gaps_s], "itl")
    row |= _dist_ms(tpot, "tpot")
    row |= _dist_ms([r.e2e_s for r in ok], "e2e")
    row["server_queue_wait_p50_ms"] = percentile([m.queue_wait_ms for m in servers], 50)
    row["server_ttft_p50_ms"] = percentile([m.time_to_first_token_ms for m in servers], 50)
    row["server_prefill_p50_ms"] = percentile([m.prefill_ms for m in servers], 50)
    row["server_intake_p50_ms"] = percentile([m.intake_ms for m in servers], 50)
    row["server_prefix_wait_p50_ms"] = percentile([m.prefix_wait_ms for m in servers], 50)
    row["server_total_p50_ms"] = percentile([m.total_ms for m in servers], 50)
    row["cached_tokens_mean"] = (
        sum(m.cached_tokens for m in servers) / len(servers) if servers else float("nan")
    )
    return row


# ---- the server's event-loop lag ------------------------------------------------------------

LOOP_LAG = "vlm_event_loop_lag_seconds"


def scrape_loop_lag(url: str | None) -> dict[float, float] | None:
    """The loop-lag histogram at ``url`` (see `scrape_histogram`)."""
    return scrape_histogram(url, LOOP_LAG)


def fetch_metrics(url: str | None) -> str | None:
    """The Prometheus text at ``url``; None when there is no URL or it cannot be read."""
    if not url:
        return None
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode()
    except OSError:
        return None


def histogram_from_text(text: str, name: str) -> dict[float, float] | None:
    """Histogram ``name`` in Prometheus ``text`` as {upper bound: cumulative count}, the +Inf
    bucket included; None when it is not there."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets = {
        float(s.labels["le"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == f"{name}_bucket"
    }
    return buckets or None


def scrape_histogram(url: str | None, name: str) -> dict[float, float] | None:
    """Histogram ``name`` at ``url`` (see `histogram_from_text`); None when there is no URL or
    it cannot be read."""
    text = fetch_metrics(url)
    return None if text is None else histogram_from_text(text, name)


def histogram_quantile(q: float, buckets: dict[float, float]) -> float:
    """The ``q`` quantile (0..1) of cumulative ``buckets``, interpolated linearly inside its
    bucket as Prometheus does (the +Inf bucket answers its lower bound); NaN when empty."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return float("nan")
    rank = q * total
    lower, below = 0.0, 0.0
    for upper in bounds:
        count = buckets[upper]
        if count >= rank:
            if math.isinf(upper):
                return lower
            if count == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


def loop_lag_summary(
    before: dict[float, float] | None, after: dict[float, float] | None
) -> dict[str, Any]:
    """Loop-lag p50 / p99 (ms) and sample count over a level: the histogram's growth."""
    if before is None or after is None:
        return {"loop_lag_samples": 0, "loop_lag_p50_ms": None, "loop_lag_p99_ms": None}
    delta = {b: after[b] - before.get(b, 0.0) for b in after}
    return {
        "loop_lag_samples": int(delta[max(delta)]),
        "loop_lag_p50_ms": histogram_quantile(0.50, delta) * 1e3,
        "loop_lag_p99_ms": histogram_quantile(0.99, delta) * 1e3,
    }


# ---- levels ---------------------------------------------------------------------------------


class ImageSource:
    """Pictures for one scenario; unique ones never repeat across the whole run."""

    def __init__(self, scenario: Scenario, seed: int, threads: int) -> None:
        self.scenario = scenario
        self.seed = seed
        self.threads = threads
        self._repeated: bytes | None = None

    def take(self, n: int, start_index: int) -> list[bytes]:
        w, h = self.scenario.size
        if self.scenario.mode == "repeated":
            if self._repeated is None:
                self._repeated = unique_images(w, h, [0], seed=self.seed, threads=1)[0]
            return [self._repeated]
        return unique_images(
            w,
            h,
            range(start_index, start_index + n),
            seed=self.seed,
            threads=self.threads,
            desc=f"images {w}x{h}" if n > 8 else None,
        )


async def closed_loop(
    client: Client,
    wl: Workload,
    images: list[bytes],
    concurrency: int,
    max_requests: int,
    duration: float,
    timeout: float,
    bar: tqdm,
) -> tuple[list[Record], float]:
    """``concurrency`` workers issue back to back until the request or time budget is spent."""
    records: list[Record] = []
    issued = 0
    start = time.perf_counter()
    deadline = start + duration

    async def worker() -> None:
        nonlocal issued
        while issued < max_requests and time.perf_counter() < deadline:
            i = issued
            issued += 1
            rec = await run_one(
                client, wl, images[i % len(images)], i, time.perf_counter(), timeout
            )
            records.append(rec)
            bar.update(1)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records, time.perf_counter() - start


def poisson_schedule(rate: float, max_requests: int, duration: float, seed: int) -> list[float]:
    """Arrival offsets (s) of a Poisson process at ``rate``/s; at least one arrival."""
    rng = random.Random(seed)
    times: list[float] = []
    now = 0.0
    while len(times) < max_requests:
        now += rng.expovariate(rate)
        if now > duration and times:
            break
        times.append(min(now, duration))
    return times


async def open_loop(
    client: Client,
    wl: Workload,
    images: list[bytes],
    arrivals: list[float],
    timeout: float,
    bar: tqdm,
) -> tuple[list[Record], float, int]:
    """Issue at the scheduled offsets regardless of completions; returns the records, the
    wall time and the most requests seen in flight at once."""
    in_flight = peak = 0

    async def one(i: int, t0: float) -> Record:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            return await run_one(client, wl, images[i % len(images)], i, t0, timeout)
        finally:
            in_flight -= 1
            bar.update(1)

    start = time.perf_counter() + 0.01
    tasks = []
    for i, offset in enumerate(arrivals):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, start + offset)))
    records = list(await asyncio.gather(*tasks))
    return records, time.perf_counter() - start, peak


async def run_scenarios(
    target: str,
    scenarios: Sequence[Scenario],
    args: argparse.Namespace,
    on_row: Callable[[list[dict[str, Any]]], None] | None = None,
    http_url: str | None = None,
    metrics_url: str | None = None,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Every level of every scenario against ``target``, through each of ``args.doors`` (HTTP
    at ``http_url``): one summary row per level and door, and the levels skipped because
    ``args.time_budget`` ran out. ``on_row`` sees the rows so far. With ``metrics_url``, each
    row carries the server's event-loop lag over its level."""
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    next_index = 1  # picture stamps are global, so no level reuses another's pictures
    deadline = time.monotonic() + args.time_budget if args.time_budget else math.inf
    doors: list[str] = list(dict.fromkeys(args.doors))
    async with contextlib.AsyncExitStack() as stack:
        clients: dict[str, Client] = {}
        for door in doors:
            if door == "grpc":
                clients[door] = AsyncVisionLanguageClient(target, timeout=args.timeout)
            else:
                assert http_url is not None, "the http door needs its URL"
                clients[door] = HttpLoadClient(http_url, timeout=args.timeout)
            await stack.enter_async_context(clients[door])
        for sc in scenarios:
            for door in doors:
                client = clients[door]
                if time.monotonic() >= deadline:
                    skipped += [f"{sc.name} {level.label} {door}" for level in sc.levels]
                    continue
                source = ImageSource(sc, args.seed, args.image_threads)
                if args.warmup > 0:
                    warm = source.take(args.warmup, next_index)
                    next_index += args.warmup
                    # Warm-up: kernels, allocator and (repeated mode) the image prefix.
                    await asyncio.gather(
                        *(
                            run_one(client, sc.workload, img, i, time.perf_counter(), args.timeout)
                            for i, img in enumerate(warm)
                        )
                    )
                for level in sc.levels:
                    if time.monotonic() >= deadline:
                        skipped.append(f"{sc.name} {level.label} {door}")
                        continue
                    lag_before = await asyncio.to_thread(scrape_loop_lag, metrics_url)
                    records, wall, peak, taken = await _level(
                        client, sc, level, source, next_index, deadline, len(rows), args
                    )
                    lag_after = await asyncio.to_thread(scrape_loop_lag, metrics_url)
                    next_index += taken
                    row = {
                        "scenario": sc.name,
                        "door": door,
                        "workload": sc.workload.name,
                        "image": f"{sc.size[0]}x{sc.size[1]}",
                        "image_mode": sc.mode,
                        "loop": level.kind,
                        "level": level.label,
                        "concurrency": int(level.value) if level.kind == "closed" else None,
                        "rate": level.value if level.kind == "open" else None,
                        "peak_in_flight": peak,
                        "max_tokens": sc.workload.max_tokens,
                        "max_objects": sc.workload.max_objects,
                        **summarize(records, wall, args.slo_ms),
                        **loop_lag_summary(lag_before, lag_after),
                    }
                    rows.append(row)
                    if on_row is not None:
                        on_row(rows)
                    if not args.quiet:
                        tqdm.write(_table_line(row))
    return rows, skipped


async def _level(
    client: Client,
    sc: Scenario,
    level: Level,
    source: ImageSource,
    first_index: int,
    deadline: float,
    seed_offset: int,
    args: argparse.Namespace,
) -> tuple[list[Record], float, int, int]:
    """Run one level: its records, wall time, peak in flight and the pictures it took."""
    # A level never runs past the overall budget.
    duration = min(args.duration, max(1.0, deadline - time.monotonic()))
    desc = f"{sc.name} {level.label}"
    if level.kind == "closed":
        conc = int(level.value)
        cap = max(args.requests, conc)  # the level must reach its concurrency
        images = source.take(cap, first_index)
        with tqdm(total=cap, desc=desc, unit="req", leave=False, disable=args.quiet) as bar:
            records, wall = await closed_loop(
                client, sc.workload, images, conc, cap, duration, args.timeout, bar
            )
        return records, wall, conc, cap
    arrivals = poisson_schedule(level.value, args.requests, duration, args.seed + seed_offset)
    images = source.take(len(arrivals), first_index)
    with tqdm(total=len(arrivals), desc=desc, unit="req", leave=False, disable=args.quiet) as bar:
        records, wall, peak = await open_loop(
            client, sc.workload, images, arrivals, args.timeout, bar
        )
    return records, wall, peak, len(arrivals)


# ---- spawned server -------------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now on ``host`` (the server binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


async def _health_status(target: str, service: str) -> str:
    """The health status name of ``service`` ("" = liveness), or the failure's status code."""
    try:
        from grpc_health.v1 import health_pb2, health_pb2_grpc
    except ImportError:  # no health package: a served GetModelInfo means ready
        async with AsyncVisionLanguageClient(target, timeout=2) as client:
            try:
                await client.model_info()
                return "SERVING"
            except t.VlmError as err:
                return err.code.name
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        except grpc.RpcError as err:
            return err.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


class SpawnedServer:
    """``vlm serve`` in a subprocess on a free loopback port; a context manager that waits
    for readiness on entry and drains it with SIGTERM on exit."""

    def __init__(
        self,
        server_args: Sequence[str],
        log_path: Path,
        startup_timeout: float = 900.0,
        stop_timeout: float = 60.0,
        quiet: bool = False,
        http: bool = False,
    ) -> None:
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        # The HTTP door only when measured (its default port would clash between servers).
        self.http_port = free_port() if http else 0
        self.http_url = f"http://127.0.0.1:{self.http_port}/v1" if http else None
        self.metrics_port = free_port()  # known, so its loop lag can be scraped
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.log_path = log_path
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.quiet = quiet
        # Our own port flags come last, so they win over anything in server_args.
        self.cmd = [
            sys.executable,
            "-m",
            "vlm_server.cli",
            "serve",
            *server_args,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--metrics-port",
            str(self.metrics_port),
            "--http-port",
            str(self.http_port),
        ]
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_s = float("nan")

    def __enter__(self) -> SpawnedServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        # The server must import this checkout; keep whatever PYTHONPATH the caller set.
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p
        )
        start = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT
            )
        try:
            asyncio.run(self._wait_ready())
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - start
        return self

    async def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        with tqdm(
            desc="waiting for the server",
            leave=False,
            bar_format="{desc}: {elapsed}",
            mininterval=1.0,
            disable=self.quiet,
        ) as bar:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"the server exited with {self.proc.returncode} while "
                        f"starting:\n{self._log_tail()}"
                    )
                if await _health_status(self.target, SERVICE_NAME) == "SERVING":
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"the server was not ready after {self.startup_timeout}"
                        f" s:\n{self._log_tail()}"
                    )
                bar.update(0)
                await asyncio.sleep(0.2)

    def _log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self) -> int | None:
        """SIGTERM (the server drains), then SIGKILL after ``stop_timeout``; the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- output ---------------------------------------------------------------------------------


def portable(values: Sequence[str]) -> list[str]:
    """Command-line values with absolute paths cut to their last part: results name no
    machine's folders."""
    return [Path(v).name if v.startswith("/") else v for v in values]


def portable_settings(args: argparse.Namespace) -> dict[str, Any]:
    """A benchmark's settings for its results: paths as `portable` gives them."""
    out: dict[str, Any] = {}
    for k, v in vars(args).items():
        if isinstance(v, Path) or (isinstance(v, str) and v.startswith("/")):
            v = Path(v).name
        out[k] = v
    return out


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinity replaced by None (strict JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def _fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


TABLE_HEAD = (
    f"{'scenario':<30} {'door':>5} {'level':>9} {'ok/n':>9} {'req/s':>7} {'tok/s':>8} "
    f"{'ttft50':>7} {'e2e50':>7} {'e2e90':>7} {'e2e99':>7} {'itl50':>6} "
    f"{'tok':>5} {'good/s':>7} {'lag50':>6} {'lag99':>6}"
)


def _table_line(r: dict[str, Any]) -> str:
    return (
        f"{r['scenario']:<30} {r.get('door', 'grpc'):>5} {r['level']:>9} "
        f"{str(r['ok']) + '/' + str(r['requests']):>9} "
        f"{_fmt(r['req_per_s'], '.2f'):>7} {_fmt(r['tokens_per_s']):>8} "
        f"{_fmt(r['ttft_p50_ms']):>7} {_fmt(r['e2e_p50_ms']):>7} "
        f"{_fmt(r['e2e_p90_ms']):>7} {_fmt(r['e2e_p99_ms']):>7} "
        f"{_fmt(r['itl_p50_ms'], '.2f'):>6} {_fmt(r['output_tokens_mean']):>5} "
        f"{_fmt(r['goodput_req_per_s'], '.2f'):>7} {_fmt(r.get('loop_lag_p50_ms')):>6} "
        f"{_fmt(r.get('loop_lag_p99_ms')):>6}"
    )


def print_table(rows: Sequence[dict[str, Any]], title: str) -> None:
    print(
        f"\n{title}\n(latencies ms, client side; tok = mean output tokens; good/s = requests "
        f"within the objective per second; lag = the server's event-loop lag, ms)"
    )
    print(TABLE_HEAD)
    for r in rows:
        print(_table_line(r))


def series(row: dict[str, Any]) -> str:
    """A plot line's name: the scenario, and the door unless it is gRPC."""
    door = row.get("door", "grpc")
    return row["scenario"] if door == "grpc" else f"{row['scenario']} [{door}]"


def plot(rows: Sequence[dict[str, Any]], out: Path, tag: str, title: str) -> list[Path]:
    """Latency percentiles by concurrency, and throughput against latency; the PNG paths."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots", file=sys.stderr)
        return []
    scenarios = list(dict.fromkeys(series(r) for r in rows))
    paths = []
    closed = [s for s in scenarios if any(series(r) == s and r["loop"] == "closed" for r in rows)]
    if closed:
        cols = min(3, len(closed))
        nrows = math.ceil(len(closed) / cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.6 * nrows), squeeze=False)
        for ax, s in zip(axes.flat, closed, strict=False):
            pts = sorted(
                (r["concurrency"], r) for r in rows if series(r) == s and r["loop"] == "closed"
            )
            xs = [c for c, _ in pts]
            for q, style in ((50, "o-"), (90, "s--"), (99, "^:")):
                ax.plot(xs, [r[f"e2e_p{q}_ms"] for _, r in pts], style, label=f"e2e p{q}")
            ax.plot(xs, [r["ttft_p50_ms"] for _, r in pts], "x-", label="ttft p50")
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.set_title(s, fontsize=9)
            ax.set_xlabel("concurrency")
            ax.set_ylabel("ms")
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(closed) :]:
            ax.set_visible(False)
        axes.flat[0].legend(fontsize=7)
        fig.suptitle(f"latency by concurrency - {title}", fontsize=10)
        fig.tight_layout()
        path = out / f"{tag}_latency.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in scenarios:
        colour = None
        # One line per loop kind, in load order, each point labelled with its level.
        for loop, key, style in (("closed", "concurrency", "o-"), ("open", "rate", "s--")):
            pts = sorted(
                (r for r in rows if series(r) == s and r["loop"] == loop),
                key=lambda r, k=key: r[k],
            )
            if not pts:
                continue
            line = ax.plot(
                [r["req_per_s"] for r in pts],
                [r["e2e_p50_ms"] for r in pts],
                style,
                color=colour,
                label=f"{s} ({'closed' if loop == 'closed' else 'open'} loop)",
            )
            colour = line[0].get_color()
            for r in pts:
                ax.annotate(
                    r["level"],
                    (r["req_per_s"], r["e2e_p50_ms"]),
                    fontsize=6,
                    textcoords="offset points",
                    xytext=(3, 3),
                )
    ax.set_xlabel("throughput (req/s)")
    ax.set_ylabel("end-to-end latency p50 (ms)")
    ax.set_yscale("log")
    ax.set_title(f"throughput vs latency - {title}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / f"{tag}_throughput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
    return paths


def device_name(info: t.ModelInfo | None, local: bool) -> str:
    """The GPU's marketing name when the server runs here on CUDA, else the server's device."""
    if info is None:
        return "unknown"
    if info.device.startswith("cuda") and local:
        with contextlib.suppress(Exception):
            import torch

            index = int(info.device.split(":")[1]) if ":" in info.device else 0
            return torch.cuda.get_device_name(index)
    return "cpu" if info.device.startswith("cpu") else info.device


async def _model_info(target: str) -> t.ModelInfo | None:
    async with AsyncVisionLanguageClient(target, timeout=10) as client:
        try:
            return await client.model_info()
        except t.VlmError:
            return None


# ---- main -----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Flags after a lone -- go to the spawned server (vlm serve --help).",
    )
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", help="host:port of a running server")
    where.add_argument(
        "--spawn",
        action="store_true",
        help="start vlm serve (flags after --) on a free loopback port",
    )
    ap.add_argument(
        "--doors",
        nargs="+",
        default=["grpc"],
        choices=DOORS,
        help="front doors to measure, each in turn (http: the Moondream API)",
    )
    ap.add_argument(
        "--http-url",
        help="API root of a running server's HTTP door (default with --target: "
        "http://HOST:2020/v1)",
    )
    ap.add_argument(
        "--metrics-url",
        help="Prometheus endpoint of a running server, for its event-loop lag (default with "
        "--target: http://HOST:9464/metrics)",
    )
    ap.add_argument(
        "--workloads",
        nargs="+",
        default=["query3"],
        help="query3 query30 caption64 caption128 point5 detect5 segment",
    )
    ap.add_argument("--image-sizes", nargs="+", default=["800x600"], help="e.g. 4000x3000")
    ap.add_argument("--image-modes", nargs="+", default=["unique"], choices=["unique", "repeated"])
    ap.add_argument(
        "--concurrency",
        type=int,
        nargs="*",
        default=[1, 4, 16, 64],
        help="closed-loop levels (requests in flight)",
    )
    ap.add_argument(
        "--rates",
        type=float,
        nargs="*",
        default=[],
        help="open-loop levels (Poisson arrivals, req/s)",
    )
    ap.add_argument(
        "--scenario",
        action="append",
        default=[],
        help="WORKLOAD[:WxH[:unique|repeated[:LEVELS]]], LEVELS like c1,c16,r10; "
        "repeatable; replaces --workloads/--image-sizes/--image-modes",
    )
    ap.add_argument("--requests", type=int, default=200, help="most requests per level")
    ap.add_argument("--duration", type=float, default=20.0, help="most seconds per level")
    ap.add_argument(
        "--time-budget",
        type=float,
        default=0.0,
        help="most seconds for all levels; later levels are skipped (0: no limit)",
    )
    ap.add_argument("--warmup", type=int, default=4, help="untimed requests per scenario")
    ap.add_argument(
        "--slo-ms", type=float, default=500.0, help="end-to-end latency objective for goodput"
    )
    ap.add_argument(
        "--segment-tokens",
        type=int,
        default=128,
        help="max_tokens of segment requests (caps the outline path)",
    )
    add_run_args(ap, "load_gen")
    return ap


def add_run_args(ap: argparse.ArgumentParser, tag: str) -> None:
    """Options every client-side benchmark of a (spawned) server shares."""
    ap.add_argument("--timeout", type=float, default=300.0, help="deadline per request (s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--image-threads", type=int, default=min(8, os.cpu_count() or 1))
    ap.add_argument(
        "--startup-timeout",
        type=float,
        default=900.0,
        help="seconds to wait for a spawned server's readiness",
    )
    ap.add_argument(
        "--out", type=Path, default=None, help="results folder (default bench/results/<device>)"
    )
    ap.add_argument("--tag", default=tag, help="file name stem of the results")
    ap.add_argument("--quiet", action="store_true", help="no progress output")


def _scenarios(args: argparse.Namespace) -> list[Scenario]:
    known = workloads(args.segment_tokens)
    default_levels = tuple(
        [Level("closed", c) for c in args.concurrency] + [Level("open", r) for r in args.rates]
    )
    if args.scenario:
        return [parse_scenario(s, known, default_levels) for s in args.scenario]
    for name in args.workloads:
        if name not in known:
            raise ValueError(f"unknown workload {name!r}; choose from {sorted(known)}")
    if not default_levels:
        raise ValueError("no levels: give --concurrency and/or --rates")
    return [
        Scenario(known[w], parse_size(size), mode, default_levels)
        for w in args.workloads
        for size in args.image_sizes
        for mode in args.image_modes
    ]


def _terminate(signum: int, frame: object) -> None:
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so a spawned server is drained and
    # the rows measured so far stay written.
    raise KeyboardInterrupt(f"signal {signum}")


def split_server_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """A bench's own arguments, and the server's after ``--`` (none without it)."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


def main(argv: Sequence[str] | None = None) -> int:
    argv, server_args = split_server_args(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    if server_args and not args.spawn:
        ap.error("server flags after -- need --spawn")
    try:
        scenarios = _scenarios(args)
    except ValueError as err:
        ap.error(str(err))
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if in_main_thread else None
    try:
        return _run(args, scenarios, server_args)
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace, scenarios: list[Scenario], server_args: list[str]) -> int:
    """Spawn (or reach) the server, run the scenarios, write and print the results."""
    log_dir = args.out or REPO_ROOT / "bench" / "results"
    log_path = log_dir / f"{args.tag}_server.log"
    server: SpawnedServer | None = None
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {}
    out = log_dir
    with contextlib.ExitStack() as stack:
        if args.spawn:
            server = stack.enter_context(
                SpawnedServer(
                    server_args,
                    log_path,
                    args.startup_timeout,
                    quiet=args.quiet,
                    http="http" in args.doors,
                )
            )
            print(f"server ready on {server.target} after {server.startup_s:.1f} s", flush=True)
            target, http_url = server.target, server.http_url
            metrics_url: str | None = server.metrics_url
        else:
            target = args.target
            host = target.rsplit(":", 1)[0]
            http_url = args.http_url or f"http://{host}:2020/v1"
            metrics_url = args.metrics_url or f"http://{host}:9464/metrics"
        info = asyncio.run(_model_info(target))
        local = args.spawn or target.split(":")[0] in ("localhost", "127.0.0.1", "[::1]")
        name = device_name(info, local)
        out = args.out or REPO_ROOT / "bench" / "results" / name.replace(" ", "_")
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{args.tag}.json"
        result = {
            "device": name,
            "target": target,
            "http_url": http_url if "http" in args.doors else None,
            "metrics_url": metrics_url,
            "spawned": args.spawn,
            "server_args": portable(server_args),
            "server_startup_s": server.startup_s if server else None,
            "model": dataclasses.asdict(info) if info else None,
            "started_unix": time.time(),
            "slo_ms": args.slo_ms,
            "settings": portable_settings(args),
            "complete": False,
            "skipped_levels": [],
            "rows": rows,
        }

        def write(so_far: list[dict[str, Any]]) -> None:
            result["rows"] = so_far
            path.write_text(json.dumps(finite(result), indent=2, default=str, allow_nan=False))

        write(rows)
        try:
            rows, skipped = asyncio.run(
                run_scenarios(target, scenarios, args, write, http_url, metrics_url)
            )
            result["complete"] = True
            result["skipped_levels"] = skipped
        except KeyboardInterrupt:
            print("interrupted: keeping the levels measured so far", file=sys.stderr)
            rows = result["rows"]
        result["server_exit_code"] = server.stop() if server is not None else None
        write(rows)
    if server is not None and log_path.parent != out and log_path.exists():
        log_path.replace(out / log_path.name)
    title = (
        f"{info.model_name if info else '?'} ({info.preset if info else '?'}, "
        f"{info.dtype if info else '?'}) on {name}, objective {args.slo_ms:g} ms"
    )
    print_table(rows, title)
    if result["skipped_levels"]:
        print(f"skipped (time budget): {', '.join(result['skipped_levels'])}")
    pngs = plot(rows, out, args.tag, title) if rows else []
    print(f"\nwrote {path}" + "".join(f", {p}" for p in pngs))
    failed = sum(r["requests"] - r["ok"] for r in rows)
    if failed:
        print(f"{failed} request(s) failed: see 'errors' in the JSON", file=sys.stderr)
    return 0 if result["complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
