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
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# The load generator's parts live in their own modules; their names stay importable from here,
# where the other benchmarks have long found them.
from bench.load_levels import (
    ImageSource,
    closed_loop,
    open_loop,
    poisson_schedule,
    run_scenarios,
)
from bench.load_records import Client, Record, percentile, run_one, summarize
from bench.load_report import (
    TABLE_HEAD,
    _model_info,
    device_name,
    finite,
    plot,
    portable,
    portable_settings,
    print_table,
    series,
)
from bench.load_scenarios import (
    Level,
    Scenario,
    Workload,
    parse_levels,
    parse_scenario,
    workloads,
)
from bench.server_metrics import (
    LOOP_LAG,
    fetch_metrics,
    histogram_from_text,
    histogram_quantile,
    loop_lag_summary,
    scrape_histogram,
    scrape_loop_lag,
)
from bench.spawned_server import REPO_ROOT, SERVICE_NAME, SpawnedServer, free_port
from bench.synth_images import parse_size

__all__ = [
    "DOORS",
    "LOOP_LAG",
    "REPO_ROOT",
    "SERVICE_NAME",
    "TABLE_HEAD",
    "Client",
    "ImageSource",
    "Level",
    "Record",
    "Scenario",
    "SpawnedServer",
    "Workload",
    "add_run_args",
    "build_parser",
    "closed_loop",
    "device_name",
    "fetch_metrics",
    "finite",
    "free_port",
    "histogram_from_text",
    "histogram_quantile",
    "loop_lag_summary",
    "main",
    "open_loop",
    "parse_levels",
    "parse_scenario",
    "percentile",
    "plot",
    "poisson_schedule",
    "portable",
    "portable_settings",
    "print_table",
    "run_one",
    "run_scenarios",
    "scrape_histogram",
    "scrape_loop_lag",
    "series",
    "split_server_args",
    "summarize",
    "workloads",
]

DOORS = ("grpc", "http")


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
