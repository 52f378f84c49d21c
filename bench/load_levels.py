"""The load generator's levels: each scenario's pictures, the closed and open loops, and
every level of every scenario through each front door, one summary row per level and door."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from tqdm import tqdm

from bench.http_client import HttpLoadClient
from bench.load_records import Client, Record, run_one, summarize
from bench.load_report import _table_line
from bench.load_scenarios import Level, Scenario, Workload
from bench.server_metrics import loop_lag_summary, scrape_loop_lag
from bench.synth_images import unique_images
from vlm_server.client import AsyncVisionLanguageClient


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
