"""Inter-token latency of running caption streams while new requests arrive.

The serving-path target: with caption streams running and new requests arriving at 20 req/s,
the streams' inter-token latency p99 stays within 2x the decode period at that batch size
(prefilling the newcomers never stalls decode for longer than one budgeted step).

One run, two phases on the same server, back to back:

    A  baseline   S caption streams (closed loop, S = ``--streams``), nothing else
    B  arrivals   the same S streams, plus open-loop Poisson arrivals of short queries
                  (max_tokens 3) at ``--rate`` req/s, each on a picture of its own

The streams caption one repeated picture (temperature 0, max_tokens ``--caption-tokens``), so
the image prefix is cached and their own restarts cost a short prefill only; a stream that
ends is restarted at once. Stream starts are staggered over the first half of the warm-up so
they do not all end and restart in the same step. Every arrival stamps its index into its
picture (``--size``), so each brings a new image (vision tower plus the image prefix's
prefill) into the mixed steps. Arrival latencies count from the scheduled arrival time.

An inter-token gap is the time between two consecutive streamed deltas of one stream, counted
in the phase in which it ends; gaps of the first ``--warmup`` seconds are dropped. Deltas are
text pieces: one can carry several tokens, and a token that ends inside a UTF-8 character
streams nothing, so the output tokens per stream (from each stream's final message) are
reported next to the deltas. Phase A's gap p50 is the decode period estimate at batch S;
where the server's Prometheus endpoint can be reached, its ``vlm_step_period_ms`` (the last
engine step, commit to commit) and ``vlm_batch_size`` gauges are sampled every
``--scrape-every`` s as well. The figure of merit is phase B's gap p99 over phase A's gap
p50, against the target 2.0. The client's own event-loop lag is sampled too (a lagging
client inflates every gap it measures; ``--client-processes N`` spreads the streams over N
processes, each with its own loop, so that one loop does not receive every delta), and so is
the server's ``vlm_step_interval_seconds``
histogram: the time between commits of steps with decode rows, i.e. the gaps the server gives
every running stream, with no client scheduling in them. Its growth over each phase gives the
same ratio from the server's side (``server_ratio_b_p99_over_a_p50``; histogram percentiles,
interpolated inside buckets of 0.5 ms up to 4 ms, coarser above).

On a GPU (the server's batch must hold the S streams plus the arrivals in flight):

    python -m bench.arrival_itl --spawn --streams 16 --rate 20 --duration 10 -- \
        --model DIR --device cuda --dtype bf16 --max-batch-size 64
    python -m bench.arrival_itl --target localhost:50051 \
        --metrics-url http://localhost:9464/metrics --streams 32 --rate 20

With ``--spawn`` the server (``vlm serve`` with the flags after ``--``) runs as a subprocess
on a free loopback port and its log goes to ``<out>/<tag>_server.log``. Prints a table and
writes ``<tag>.json`` and ``<tag>.png`` (gap CDFs of both phases, and gaps over time with
the arrivals marked) under ``--out`` (default bench/results/<device>/).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import multiprocessing
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.load_gen import (
    REPO_ROOT,
    ImageSource,
    Record,
    Scenario,
    SpawnedServer,
    Workload,
    _model_info,
    _terminate,
    add_run_args,
    device_name,
    fetch_metrics,
    finite,
    histogram_from_text,
    histogram_quantile,
    open_loop,
    percentile,
    poisson_schedule,
    portable,
    portable_settings,
    run_one,
    split_server_args,
    summarize,
)
from bench.soak import _metrics_port, unlabelled_values
from bench.synth_images import parse_size
from bench.targets import IDLE_SPREAD_MAX
from vlm_server.client import AsyncVisionLanguageClient

TARGET_RATIO = 2.0
PHASES = ("A", "B")
PHASE_NAMES = {"A": "A baseline", "B": "B +arrivals"}
QUANTILES = (50, 90, 99, 99.9)


# ---- what is recorded -----------------------------------------------------------------------


@dataclass
class Gap:
    end: float  # perf_counter seconds of the later delta
    seconds: float
    stream: int


@dataclass
class Timeline:
    """The phase windows (perf_counter seconds) and everything seen during the run."""

    start: float
    warmup_end: float
    a_end: float
    b_end: float
    gaps: list[Gap] = field(default_factory=list)
    streams: list[tuple[float, int, Record]] = field(default_factory=list)  # (end, worker, rec)
    step_samples: list[tuple[float, float, float]] = field(default_factory=list)  # t, ms, batch
    loop_lag: list[tuple[float, float]] = field(default_factory=list)  # t, seconds late
    # The server's step-interval histogram (vlm_step_interval_seconds) as sampled: t, buckets.
    intervals: list[tuple[float, dict[float, float]]] = field(default_factory=list)
    # The server's engine-events delay histogram (vlm_engine_events_delay_seconds), likewise.
    delays: list[tuple[float, dict[float, float]]] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # issue times (perf_counter)
    stopping: bool = False

    def phase(self, at: float) -> str | None:
        """The phase a moment belongs to (None: warm-up or after the run)."""
        if self.warmup_end <= at < self.a_end:
            return "A"
        if self.a_end <= at < self.b_end:
            return "B"
        return None


def stream_deltas(rec: Record, t0: float) -> list[float]:
    """The perf_counter times of a finished stream's deltas, rebuilt from its record: the
    first at ``t0 + ttft``, each later one a gap after the one before."""
    if not rec.ok or not rec.streamed:
        return []
    times = [t0 + rec.ttft_s]
    for g in rec.gaps_s:
        times.append(times[-1] + g)
    return times


# ---- the load -------------------------------------------------------------------------------


async def caption_worker(
    index: int,
    client: AsyncVisionLanguageClient,
    wl: Workload,
    image: bytes,
    delay: float,
    tl: Timeline,
    timeout: float,
) -> None:
    """One closed-loop stream: caption, record its gaps, start over until the run stops."""
    await asyncio.sleep(delay)
    n = 0
    while not tl.stopping:
        t0 = time.perf_counter()
        rec = await run_one(client, wl, image, index * 100_003 + n, t0, timeout)
        n += 1
        deltas = stream_deltas(rec, t0)
        tl.gaps.extend(
            Gap(end, gap, index) for end, gap in zip(deltas[1:], rec.gaps_s, strict=True)
        )
        tl.streams.append((time.perf_counter(), index, rec))
        if not rec.ok:
            await asyncio.sleep(0.05)  # an overloaded or failing server: no hot loop


@dataclass
class Shard:
    """What one client process of ``--client-processes`` measured: its streams' gaps and
    records, and its own event loop's lag."""

    gaps: list[Gap]
    streams: list[tuple[float, int, Record]]
    loop_lag: list[tuple[float, float]]


def run_shard(
    target: str,
    caption: Workload,
    picture: bytes,
    indices: list[int],
    stagger: float,
    window: tuple[float, float, float, float],
    timeout: float,
) -> Shard:
    """Run caption streams ``indices`` in this (child) process on the parent's timeline.
    ``window`` is (start, warm-up end, A end, B end) in perf_counter seconds, which on Linux
    and macOS count from one system-wide clock, so every process reads the same time."""

    async def run() -> Shard:
        tl = Timeline(*window)
        lag = asyncio.create_task(watch_loop(tl))
        async with AsyncVisionLanguageClient(target, timeout=timeout) as client:
            workers = [
                asyncio.create_task(
                    caption_worker(
                        i,
                        client,
                        caption,
                        picture,
                        max(0.0, tl.start + i * stagger - time.perf_counter()),
                        tl,
                        timeout,
                    )
                )
                for i in indices
            ]
            await asyncio.sleep(max(0.0, tl.b_end - time.perf_counter()))
            tl.stopping = True
            await asyncio.gather(*workers)
        lag.cancel()
        await asyncio.gather(lag, return_exceptions=True)
        return Shard(tl.gaps, tl.streams, tl.loop_lag)

    return asyncio.run(run())


def _ready(seconds: float) -> bool:
    """Keeps a pool worker busy a moment, so that every worker gets started."""
    time.sleep(seconds)
    return True


def read_metrics(url: str) -> tuple[dict | None, dict | None, dict[str, float]] | None:
    """One scrape: the step-interval and events-delay histograms and the unlabelled values;
    None when the endpoint cannot be read."""
    text = fetch_metrics(url)
    if text is None:
        return None
    return (
        histogram_from_text(text, STEP_INTERVAL),
        histogram_from_text(text, EVENTS_DELAY),
        unlabelled_values(text),
    )


async def sample_steps(url: str, every: float, tl: Timeline) -> None:
    """Sample the server's step-period and batch-size gauges, and its step-interval and
    events-delay histograms, until cancelled: one scrape each time, since a scrape holds the
    server's GIL for milliseconds, a stall every stream would then show."""
    while True:
        with contextlib.suppress(OSError, ValueError):
            at = time.perf_counter()
            read = await asyncio.to_thread(read_metrics, url)
            if read is not None:
                buckets, delays, values = read
                if buckets:
                    tl.intervals.append((at, buckets))
                if delays:
                    tl.delays.append((at, delays))
                if "vlm_step_period_ms" in values:
                    tl.step_samples.append(
                        (
                            time.perf_counter(),
                            values["vlm_step_period_ms"],
                            values.get("vlm_batch_size", math.nan),
                        )
                    )
        await asyncio.sleep(every)


async def watch_loop(tl: Timeline, every: float = 0.005) -> None:
    """How late this process's event loop wakes a sleeper: the client's own share of gaps."""
    while True:
        before = time.perf_counter()
        await asyncio.sleep(every)
        now = time.perf_counter()
        tl.loop_lag.append((now, now - before - every))


async def progress(tl: Timeline, quiet: bool, done_arrivals: list[int]) -> None:
    total = tl.b_end - tl.start
    with tqdm(
        total=round(total, 1),
        desc="warm-up",
        unit="s",
        leave=False,
        disable=quiet,
        bar_format="{desc} {n:.1f}/{total} s |{bar}|{postfix}",
    ) as bar:
        counts: Counter[str | None] = Counter()
        seen = 0
        while True:
            now = time.perf_counter()
            phase = tl.phase(now)
            bar.set_description(
                "warm-up" if now < tl.warmup_end else PHASE_NAMES[phase] if phase else "draining"
            )
            # Only the new gaps: a pass over all of them would stall this loop, whose
            # lateness every gap measured here includes.
            fresh = tl.gaps[seen:]
            seen += len(fresh)
            counts.update(tl.phase(g.end) for g in fresh)
            bar.set_postfix_str(
                f"streams done {len(tl.streams)}, gaps A {counts['A']} B {counts['B']}, "
                f"arrivals {done_arrivals[0]}/{len(tl.arrivals)}"
            )
            bar.n = round(min(now - tl.start, total), 1)
            bar.refresh()
            await asyncio.sleep(1.0)


async def run_phases(
    target: str, args: argparse.Namespace, metrics_url: str | None
) -> tuple[Timeline, list[Record], float, int, dict[str, Any]]:
    """Warm up, then phases A and B; the timeline, the arrivals' records, their wall time and
    peak in flight, and what the warm-up saw."""
    size = parse_size(args.size)
    caption = Workload("caption", "caption", True, max_tokens=args.caption_tokens)
    query = Workload(
        "query", "query", True, max_tokens=args.query_tokens, question="What is in this image?"
    )
    repeated = ImageSource(Scenario(caption, size, "repeated", ()), args.seed, 1)
    unique = ImageSource(Scenario(query, size, "unique", ()), args.seed, args.image_threads)
    picture = repeated.take(1, 0)[0]
    schedule = poisson_schedule(
        args.rate, max(1, math.ceil(args.rate * args.duration * 4) + 16), args.duration, args.seed
    )
    # Pictures before the clock starts; stamps from 1 (0 is the captions' picture).
    warm_pictures = unique.take(args.warmup_arrivals, 1)
    pictures = unique.take(len(schedule), 1 + args.warmup_arrivals)
    procs = min(args.client_processes, args.streams)
    with contextlib.ExitStack() as stack:
        pool: ProcessPoolExecutor | None = None
        if procs > 1:
            context = multiprocessing.get_context("spawn")
            pool = stack.enter_context(ProcessPoolExecutor(procs, mp_context=context))
            list(pool.map(_ready, [0.2] * procs))  # children import all before the clock
        async with AsyncVisionLanguageClient(target, timeout=args.timeout) as client:
            # Untimed: the captions' prefix enters the cache; the arrivals' path (vision tower,
            # long prefills) meets its kernels and allocator once.
            t0 = time.perf_counter()
            warm = await asyncio.gather(
                run_one(client, caption, picture, 0, time.perf_counter(), args.timeout),
                *(
                    run_one(client, query, img, i, time.perf_counter(), args.timeout)
                    for i, img in enumerate(warm_pictures)
                ),
            )
            warm_info = {
                "seconds": time.perf_counter() - t0,
                "ok": sum(r.ok for r in warm),
                "requests": len(warm),
                "errors": dict(Counter(r.error for r in warm if not r.ok)),
            }
            if not args.quiet:
                print(
                    f"warm-up requests: {warm_info['ok']}/{warm_info['requests']} ok in "
                    f"{warm_info['seconds']:.1f} s",
                    flush=True,
                )
            start = time.perf_counter()
            tl = Timeline(
                start=start,
                warmup_end=start + args.warmup,
                a_end=start + args.warmup + args.duration,
                b_end=start + args.warmup + 2 * args.duration,
            )
            helpers = [asyncio.create_task(watch_loop(tl))]
            if metrics_url and args.scrape_every > 0:
                helpers.append(
                    asyncio.create_task(sample_steps(metrics_url, args.scrape_every, tl))
                )
            done_arrivals = [0]
            helpers.append(asyncio.create_task(progress(tl, args.quiet, done_arrivals)))
            stagger = args.warmup / 2 / args.streams
            shards: list[asyncio.Future[Shard]] = []
            if pool is None:
                workers = [
                    asyncio.create_task(
                        caption_worker(i, client, caption, picture, i * stagger, tl, args.timeout)
                    )
                    for i in range(args.streams)
                ]
            else:  # the streams in child processes, dealt round-robin; their gaps come back
                workers = []
                loop = asyncio.get_running_loop()
                window = (tl.start, tl.warmup_end, tl.a_end, tl.b_end)
                shards = [
                    loop.run_in_executor(
                        pool,
                        run_shard,
                        target,
                        caption,
                        picture,
                        list(range(k, args.streams, procs)),
                        stagger,
                        window,
                        args.timeout,
                    )
                    for k in range(procs)
                ]

            class Counting(tqdm):  # open_loop's bar, silent: counts for the progress line
                def update(self, n: float | None = 1) -> bool | None:
                    done_arrivals[0] += int(n or 0)
                    return None

            try:
                await asyncio.sleep(max(0.0, tl.a_end - time.perf_counter()))
                if not args.quiet:
                    tqdm.write(f"phase B: arrivals at {args.rate:g} req/s for {args.duration:g} s")
                # open_loop starts its clock 10 ms after it is called.
                tl.arrivals = [tl.a_end + 0.01 + offset for offset in schedule]
                records, wall, peak = await open_loop(
                    client, query, pictures, schedule, args.timeout, Counting(disable=True)
                )
                await asyncio.sleep(max(0.0, tl.b_end - time.perf_counter()))
                tl.stopping = True
                if not args.quiet:
                    tqdm.write("phases done: letting the running streams finish")
                await asyncio.gather(*workers)
                for shard in await asyncio.gather(*shards):
                    tl.gaps.extend(shard.gaps)
                    tl.streams.extend(shard.streams)
                    tl.loop_lag.extend(shard.loop_lag)
            finally:
                tl.stopping = True
                for task in [*helpers, *workers, *shards]:
                    task.cancel()
                await asyncio.gather(*helpers, *workers, *shards, return_exceptions=True)
    return tl, records, wall, peak, warm_info


# ---- statistics -----------------------------------------------------------------------------


def _pcts(values: Sequence[float], prefix: str, scale: float = 1e3) -> dict[str, float]:
    xs = [v * scale for v in values]
    out = {f"{prefix}_p{q:g}_ms": percentile(xs, q) for q in QUANTILES}
    out[f"{prefix}_max_ms"] = max(xs) if xs else math.nan
    out[f"{prefix}_mean_ms"] = sum(xs) / len(xs) if xs else math.nan
    return out


STEP_INTERVAL = "vlm_step_interval_seconds"
EVENTS_DELAY = "vlm_engine_events_delay_seconds"


def _phase_growth(
    samples: list[tuple[float, dict[float, float]]], tl: Timeline, phase: str
) -> dict[float, float] | None:
    """A sampled cumulative histogram's growth over a phase (between the samples at its start
    and end), or None without two samples in it."""
    lo, hi = (tl.warmup_end, tl.a_end) if phase == "A" else (tl.a_end, tl.b_end)
    first = next((b for at, b in samples if at >= lo), None)
    last = next((b for at, b in reversed(samples) if at <= hi), None)
    if first is None or last is None or first is last:
        return None
    return {b: last[b] - first.get(b, 0.0) for b in last}


def phases_unix(tl: Timeline) -> dict[str, tuple[float, float]]:
    """Each phase's window in time.time() seconds (the timeline keeps perf_counter's)."""
    offset = time.time() - time.perf_counter()
    return {
        "A": (tl.warmup_end + offset, tl.a_end + offset),
        "B": (tl.a_end + offset, tl.b_end + offset),
    }


def events_delays(tl: Timeline, phase: str) -> dict[str, Any]:
    """How long the engine process's events took to reach the server's streams over a phase
    (the delivery share of the clients' gaps; absent with the engine in the server's
    process)."""
    delta = _phase_growth(tl.delays, tl, phase)
    if not delta or not delta[max(delta)]:
        return {"events_delay_p50_ms": None, "events_delay_p99_ms": None}
    return {
        "events_delay_p50_ms": histogram_quantile(0.50, delta) * 1e3,
        "events_delay_p99_ms": histogram_quantile(0.99, delta) * 1e3,
    }


def server_intervals(tl: Timeline, phase: str) -> dict[str, Any]:
    """The server's own inter-token gaps over a phase (the step-interval histogram's growth
    between the samples at its start and end): free of the client's scheduling noise."""
    delta = _phase_growth(tl.intervals, tl, phase)
    if delta is None:
        return {"server_steps": 0, "server_itl_p50_ms": None, "server_itl_p99_ms": None}
    return {
        "server_steps": int(delta[max(delta)]),
        "server_itl_p50_ms": histogram_quantile(0.50, delta) * 1e3,
        "server_itl_p90_ms": histogram_quantile(0.90, delta) * 1e3,
        "server_itl_p99_ms": histogram_quantile(0.99, delta) * 1e3,
        # Cumulative counts by upper bound (seconds): where the tail sits, bucket by bucket.
        "server_itl_buckets": {repr(b): int(n) for b, n in sorted(delta.items())},
    }


def phase_summary(tl: Timeline, phase: str) -> dict[str, Any]:
    gaps = [g.seconds for g in tl.gaps if tl.phase(g.end) == phase]
    # Streams count in the phase in which they ended.
    recs = [r for end, _, r in tl.streams if tl.phase(end) == phase]
    ok = [r for r in recs if r.ok]
    tokens = [r.output_tokens for r in ok]
    # run_one puts the first delta at the end when there was none.
    deltas = [len(r.gaps_s) + (r.ttft_s < r.e2e_s) for r in ok]
    steps = [(ms, b) for at, ms, b in tl.step_samples if tl.phase(at) == phase]
    lag = [s for at, s in tl.loop_lag if tl.phase(at) == phase]
    row: dict[str, Any] = {
        "phase": phase,
        **server_intervals(tl, phase),
        **events_delays(tl, phase),
        "gaps": len(gaps),
        "streams_with_gaps": len({g.stream for g in tl.gaps if tl.phase(g.end) == phase}),
        **_pcts(gaps, "itl"),
        "streams_finished": len(recs),
        "stream_errors": dict(Counter(r.error for r in recs if not r.ok)),
        "finish_reasons": dict(Counter(r.finish_reason for r in ok)),
        "output_tokens_mean": sum(tokens) / len(tokens) if tokens else math.nan,
        "output_tokens_min": min(tokens) if tokens else 0,
        "output_tokens_max": max(tokens) if tokens else 0,
        "deltas_mean": sum(deltas) / len(deltas) if deltas else math.nan,
        "tokens_per_delta": sum(tokens) / sum(deltas) if deltas else math.nan,
        "server_step_samples": len(steps),
        "server_step_p50_ms": percentile([ms for ms, _ in steps], 50),
        "server_step_p90_ms": percentile([ms for ms, _ in steps], 90),
        "server_step_max_ms": max((ms for ms, _ in steps), default=math.nan),
        "server_batch_p50": percentile([b for _, b in steps if not math.isnan(b)], 50),
        "client_loop_lag_p99_ms": percentile([s * 1e3 for s in lag], 99),
        "client_loop_lag_max_ms": max(lag, default=math.nan) * 1e3,
    }
    return row


def cdf_points(tl: Timeline, phase: str) -> list[list[float]]:
    """(quantile %, gap ms) pairs from 0 to 100 in 0.5 steps, and the tail above 99: enough
    to redraw the CDF from the JSON."""
    ms = [g.seconds * 1e3 for g in tl.gaps if tl.phase(g.end) == phase]
    if not ms:
        return []
    qs = [q / 2 for q in range(0, 199)] + [99.0 + q / 10 for q in range(1, 10)] + [99.95, 100.0]
    return [[q, percentile(ms, q)] for q in qs]


def verdict(tl: Timeline, a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    period = a["itl_p50_ms"]
    known = bool(period) and not math.isnan(period)
    ratio = b["itl_p99_ms"] / period if known else math.nan
    step = a["server_step_p50_ms"]

    def over(phase: str) -> float:
        """The fraction of the phase's gaps longer than the target (2x phase A's p50)."""
        ms = [g.seconds * 1e3 for g in tl.gaps if tl.phase(g.end) == phase]
        if not ms or not known:
            return math.nan
        return sum(1 for x in ms if x > TARGET_RATIO * period) / len(ms)

    return {
        "decode_period_ms": period,
        "decode_period_source": "phase A gap p50 (client)",
        "server_step_period_ms": step,
        "batch_size": a["server_batch_p50"],
        "ratio_b_p99_over_a_p50": ratio,
        "ratio_b_p99_over_server_step": (
            b["itl_p99_ms"] / step if step and not math.isnan(step) else math.nan
        ),
        "ratio_a_p99_over_a_p50": a["itl_p99_ms"] / period if known else math.nan,
        "a_gaps_over_target_fraction": over("A"),
        "b_gaps_over_target_fraction": over("B"),
        "target_ratio": TARGET_RATIO,
        "meets_target": bool(ratio <= TARGET_RATIO) if not math.isnan(ratio) else None,
        # The same ratio from the server's own step intervals (no client noise in it).
        "server_ratio_b_p99_over_a_p50": _ratio(
            b.get("server_itl_p99_ms"), a.get("server_itl_p50_ms")
        ),
        # Phase A's own tail (server side): over IDLE_SPREAD_MAX the idle phase jittered.
        "server_idle_spread": _ratio(a.get("server_itl_p99_ms"), a.get("server_itl_p50_ms")),
    }


def _ratio(top: float | None, bottom: float | None) -> float:
    if top is None or not bottom or math.isnan(bottom):
        return math.nan
    return top / bottom


# ---- output ---------------------------------------------------------------------------------


def _fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def print_table(result: dict[str, Any], title: str) -> None:
    print(f"\n{title}\n(inter-token gaps of the caption streams, ms, client side)")
    print(
        f"{'phase':<12} {'gaps':>7} {'itl50':>7} {'itl90':>7} {'itl99':>7} {'max':>8} "
        f"{'step50':>7} {'batch':>6} {'tok/str':>7} {'tok/dlt':>7} {'lag99':>6}"
    )
    for p in PHASES:
        r = result["phases"][p]
        print(
            f"{PHASE_NAMES[p]:<12} {r['gaps']:>7} {_fmt(r['itl_p50_ms'], '.2f'):>7} "
            f"{_fmt(r['itl_p90_ms'], '.2f'):>7} {_fmt(r['itl_p99_ms'], '.2f'):>7} "
            f"{_fmt(r['itl_max_ms'], '.2f'):>8} {_fmt(r['server_step_p50_ms'], '.2f'):>7} "
            f"{_fmt(r['server_batch_p50'], '.0f'):>6} {_fmt(r['output_tokens_mean']):>7} "
            f"{_fmt(r['tokens_per_delta'], '.2f'):>7} {_fmt(r['client_loop_lag_p99_ms'], '.2f'):>6}"
        )
    a = result["arrivals"]
    print(
        f"arrivals: offered {_fmt(a['offered_req_per_s'], '.2f')} req/s, achieved "
        f"{_fmt(a['achieved_req_per_s'], '.2f')} req/s, ok {a['ok']}/{a['requests']}, "
        f"peak in flight {a['peak_in_flight']}, e2e p50 {_fmt(a['e2e_p50_ms'])} "
        f"p99 {_fmt(a['e2e_p99_ms'])}, ttft p50 {_fmt(a['ttft_p50_ms'])} ms"
    )
    v = result["verdict"]
    met = {True: "met", False: "NOT met", None: "unknown"}[v["meets_target"]]
    print(
        f"decode period (A gap p50) {_fmt(v['decode_period_ms'], '.2f')} ms, server step p50 "
        f"{_fmt(v['server_step_period_ms'], '.2f')} ms at batch {_fmt(v['batch_size'], '.0f')}"
    )
    print(
        f"target: B gap p99 / A gap p50 = {_fmt(v['ratio_b_p99_over_a_p50'], '.2f')} "
        f"<= {TARGET_RATIO:g}: {met}; gaps over {TARGET_RATIO:g}x A p50: A "
        f"{_fmt(v['a_gaps_over_target_fraction'] * 100, '.2f')}%, B "
        f"{_fmt(v['b_gaps_over_target_fraction'] * 100, '.2f')}%"
    )
    a_srv, b_srv = result["phases"]["A"], result["phases"]["B"]
    print(
        f"server side (step intervals): A p50 / p99 {_fmt(a_srv['server_itl_p50_ms'], '.2f')} / "
        f"{_fmt(a_srv['server_itl_p99_ms'], '.2f')} ms, B p50 / p99 "
        f"{_fmt(b_srv['server_itl_p50_ms'], '.2f')} / "
        f"{_fmt(b_srv['server_itl_p99_ms'], '.2f')} ms; B p99 / A p50 = "
        f"{_fmt(v['server_ratio_b_p99_over_a_p50'], '.2f')}"
    )
    spread = v.get("server_idle_spread", math.nan)
    if spread > IDLE_SPREAD_MAX:
        print(
            f"warning: phase A's own p99 / p50 is {spread:.2f} (over {IDLE_SPREAD_MAX:g}): the "
            "idle phase jittered, so the ratio overstates the engine's (a host stall?)"
        )
    if a_srv.get("events_delay_p99_ms") is not None:
        print(
            f"engine events to the server's streams: A p50 / p99 "
            f"{_fmt(a_srv['events_delay_p50_ms'], '.2f')} / "
            f"{_fmt(a_srv['events_delay_p99_ms'], '.2f')} ms, B p50 / p99 "
            f"{_fmt(b_srv.get('events_delay_p50_ms'), '.2f')} / "
            f"{_fmt(b_srv.get('events_delay_p99_ms'), '.2f')} ms"
        )


def plot(tl: Timeline, result: dict[str, Any], path: Path, title: str) -> bool:
    """Gap CDFs of both phases, and every gap over time with the arrivals marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return False
    period = result["verdict"]["decode_period_ms"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    colours = {"A": "tab:blue", "B": "tab:orange"}
    for p in PHASES:
        ms = sorted(g.seconds * 1e3 for g in tl.gaps if tl.phase(g.end) == p)
        if not ms:
            continue
        n = len(ms)
        left.plot(ms, [(i + 1) / n for i in range(n)], color=colours[p], label=PHASE_NAMES[p])
        at = [g.end - tl.start for g in tl.gaps if tl.phase(g.end) == p]
        gaps = [g.seconds * 1e3 for g in tl.gaps if tl.phase(g.end) == p]
        right.scatter(at, gaps, s=2, color=colours[p], alpha=0.4, label=PHASE_NAMES[p])
    if period is not None and not math.isnan(period):
        left.axvline(period, color="grey", ls=":", label=f"A p50 {period:.1f} ms")
        left.axvline(TARGET_RATIO * period, color="red", ls="--", label=f"{TARGET_RATIO:g}x A p50")
        right.axhline(TARGET_RATIO * period, color="red", ls="--", lw=0.8)
    left.set_xscale("log")
    left.set_xlabel("inter-token gap (ms)")
    left.set_ylabel("fraction of gaps")
    left.set_ylim(0.0, 1.0)
    left.grid(alpha=0.3)
    left.legend(fontsize=7)
    left.set_title("gap CDF", fontsize=9)
    for at in tl.arrivals:
        right.axvline(at - tl.start, color="green", alpha=0.15, lw=0.5)
    right.set_yscale("log")
    right.set_xlabel(f"seconds since the streams started (green: arrivals, {len(tl.arrivals)})")
    right.set_ylabel("gap (ms)")
    right.grid(alpha=0.3)
    right.legend(fontsize=7, markerscale=4)
    right.set_title("gaps over time", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---- main -----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench.arrival_itl",
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
        "--metrics-url",
        help="the server's Prometheus /metrics URL for the step-period gauge (default: found "
        "in a spawned server's log; with --target, http://HOST:9464/metrics)",
    )
    ap.add_argument("--streams", type=int, default=16, help="caption streams kept running")
    ap.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="processes the caption streams are spread over (one Python event loop receiving "
        "thousands of deltas a second lags, and its lag lands in every gap it measures); "
        "the arrivals stay in this process",
    )
    ap.add_argument("--rate", type=float, default=20.0, help="phase B arrivals (req/s)")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of each phase")
    ap.add_argument(
        "--warmup", type=float, default=3.0, help="seconds of streams before phase A (dropped)"
    )
    ap.add_argument(
        "--warmup-arrivals", type=int, default=4, help="untimed queries before the streams start"
    )
    ap.add_argument("--size", default="800x600", help="picture size (arrivals and captions)")
    ap.add_argument("--caption-tokens", type=int, default=256, help="max_tokens of a caption")
    ap.add_argument("--query-tokens", type=int, default=3, help="max_tokens of an arrival")
    ap.add_argument(
        "--scrape-every",
        type=float,
        default=0.5,
        help="seconds between metric samples (0: off); each scrape stalls the server's event "
        "loop about 2 ms, so sampling often shows up in the gaps measured",
    )
    add_run_args(ap, "arrival_itl")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv, server_args = split_server_args(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    if server_args and not args.spawn:
        ap.error("server flags after -- need --spawn")
    if args.client_processes < 1:
        ap.error("--client-processes must be >= 1")
    if args.streams < 1 or args.rate <= 0 or args.duration <= 0 or args.warmup < 0:
        ap.error("--streams, --rate and --duration must be positive, --warmup not negative")
    try:
        parse_size(args.size)
    except ValueError as err:
        ap.error(str(err))
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if in_main_thread else None
    try:
        return _run(args, server_args)
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace, server_args: list[str]) -> int:
    log_dir = args.out or REPO_ROOT / "bench" / "results"
    log_path = log_dir / f"{args.tag}_server.log"
    server: SpawnedServer | None = None
    with contextlib.ExitStack() as stack:
        if args.spawn:
            server = stack.enter_context(
                SpawnedServer(server_args, log_path, args.startup_timeout, quiet=args.quiet)
            )
            print(f"server ready on {server.target} after {server.startup_s:.1f} s", flush=True)
            target = server.target
            port = _metrics_port(log_path)
            metrics_url = args.metrics_url or (f"http://127.0.0.1:{port}/metrics" if port else None)
        else:
            target = args.target
            metrics_url = args.metrics_url or f"http://{target.rsplit(':', 1)[0]}:9464/metrics"
        info = asyncio.run(_model_info(target))
        local = args.spawn or target.split(":")[0] in ("localhost", "127.0.0.1", "[::1]")
        name = device_name(info, local)
        out = args.out or REPO_ROOT / "bench" / "results" / name.replace(" ", "_")
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{args.tag}.json"
        result: dict[str, Any] = {
            "device": name,
            "target": target,
            "metrics_url": metrics_url,
            "spawned": args.spawn,
            "server_args": portable(server_args),
            "server_startup_s": server.startup_s if server else None,
            "model": dataclasses.asdict(info) if info else None,
            "started_unix": time.time(),
            "settings": portable_settings(args),
            "complete": False,
        }
        path.write_text(json.dumps(finite(result), indent=2, allow_nan=False))
        try:
            tl, records, wall, peak, warm = asyncio.run(run_phases(target, args, metrics_url))
        except KeyboardInterrupt:
            print("interrupted: nothing measured is kept", file=sys.stderr)
            result["server_exit_code"] = server.stop() if server is not None else None
            path.write_text(json.dumps(finite(result), indent=2, allow_nan=False))
            return 1
        result["server_exit_code"] = server.stop() if server is not None else None
    if server is not None and log_path.parent != out and log_path.exists():
        log_path.replace(out / log_path.name)
    phases = {p: phase_summary(tl, p) for p in PHASES}
    arrivals = summarize(records, wall, math.inf)
    for key in ("slo_ms", "goodput_req_per_s", "slo_attainment"):
        arrivals.pop(key, None)
    arrivals |= {
        "offered_req_per_s": len(records) / args.duration,
        # Completed arrivals over the time from the first arrival to the last completion.
        "achieved_req_per_s": arrivals["req_per_s"],
        "peak_in_flight": peak,
    }
    result |= {
        "complete": True,
        "warmup_requests": warm,
        "phases": phases,
        "arrivals": arrivals,
        "verdict": verdict(tl, phases["A"], phases["B"]),
        # The phases on the wall clock, for a --step-trace of the same run (bench/step_gaps.py).
        "phases_unix": phases_unix(tl),
        "gap_cdf_ms": {p: cdf_points(tl, p) for p in PHASES},
    }
    path.write_text(json.dumps(finite(result), indent=2, allow_nan=False))
    title = (
        f"{info.model_name if info else '?'} ({info.preset if info else '?'}, "
        f"{info.dtype if info else '?'}) on {name}: {args.streams} caption streams, "
        f"arrivals {args.rate:g} req/s at {args.size}"
    )
    print_table(result, title)
    png = out / f"{args.tag}.png"
    drawn = plot(tl, result, png, title)
    print(f"\nwrote {path}" + (f", {png}" if drawn else ""))
    failed = sum(sum(r["stream_errors"].values()) for r in phases.values())
    failed += arrivals["requests"] - arrivals["ok"]
    if failed:
        print(f"{failed} request(s) failed: see the errors in the JSON", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
