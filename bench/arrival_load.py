"""The arrivals benchmark's load (`bench.arrival_itl`): the closed-loop caption streams (in this
process or spread over client processes), the metric and event-loop samplers, the progress
line, and the two phases run back to back with the open-loop arrivals in phase B."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import multiprocessing
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from bench.arrival_timeline import (
    EVENTS_DELAY,
    PHASE_NAMES,
    STEP_INTERVAL,
    Gap,
    Timeline,
    stream_deltas,
)
from bench.load_gen import (
    ImageSource,
    Record,
    Scenario,
    Workload,
    fetch_metrics,
    histogram_from_text,
    open_loop,
    poisson_schedule,
    run_one,
)
from bench.soak import unlabelled_values
from bench.synth_images import parse_size
from vlm_server.client import AsyncVisionLanguageClient


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
