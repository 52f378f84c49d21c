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

This module holds the command line and the run's JSON; what is recorded is in
`bench.arrival_timeline`, the load in `bench.arrival_load`, the statistics in
`bench.arrival_stats`, the table and the figure in `bench.arrival_report`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from bench.arrival_load import run_phases
from bench.arrival_report import plot, print_table
from bench.arrival_stats import cdf_points, phase_summary, phases_unix, verdict
from bench.arrival_timeline import PHASES
from bench.load_gen import (
    REPO_ROOT,
    SpawnedServer,
    _model_info,
    _terminate,
    add_run_args,
    device_name,
    finite,
    portable,
    portable_settings,
    split_server_args,
    summarize,
)
from bench.soak import _metrics_port
from bench.synth_images import parse_size


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
