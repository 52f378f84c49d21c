"""Event-loop lag under large bodies, measured from outside the server.

    python -m bench.loop_lag --spawn -- --device cpu        # the built-in tiny model
    python -m bench.loop_lag --target host:50051 --http-url http://host:8080/v1
    python -m bench.loop_lag --replot bench/results/cpu_tiny/loop_lag.json   # the plot again

A sender process posts ``--rounds`` large bodies over each door, one at a time: over gRPC a
Caption whose ``image_bytes`` is a fake JPEG (``FF D8 FF`` then zeros) filling ``--body-mb``;
over HTTP a JSON body of that size holding the same kind of picture as a base64 data URL.
Meanwhile this process times a cheap request again and again (``GET /health`` and the gRPC
health ``Check``, alternately): while the server's loop is held, the probe waits. Each
probe's lag is its latency beyond the median of an idle phase measured first. On a shared
machine a probe also waits whenever another process has the CPU, so besides the worst probe
the table gives the median over bodies of each body's worst probe: a stall a body causes
recurs with every body.

Writes ``loop_lag.json`` (every probe, every body's window, a summary per door), a plot of
the probes over time with the bodies' windows shaded (``loop_lag.png``, with matplotlib) and
prints a table. The sender is its own process, so that building 30 MB bodies takes none of
the prober's GIL.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import multiprocessing
import statistics
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.load_gen import (
    REPO_ROOT,
    SpawnedServer,
    percentile,
    portable,
    portable_settings,
    split_server_args,
)
from bench.plotting import pyplot, save

MIB = 1 << 20
DOORS = ("grpc", "http")


# ---- the sender (its own process) --------------------------------------------------------


def _fake_jpeg(size: int) -> bytes:
    return b"\xff\xd8\xff" + bytes(max(size - 3, 0))


def _send_grpc(target: str, body_bytes: int) -> str:
    from vlm_server.api.v1 import vision_language_pb2 as pb
    from vlm_server.api.v1 import vision_language_pb2_grpc as pb_grpc

    request = pb.CaptionRequest(image_bytes=_fake_jpeg(body_bytes - 16))
    limit = body_bytes + MIB
    options = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
    with grpc.insecure_channel(target, options=options) as channel:
        stub = pb_grpc.VisionLanguageStub(channel)
        try:
            list(stub.Caption(request, timeout=120))
        except grpc.RpcError as err:
            return err.code().name  # type: ignore[attr-defined]
    return "OK"


def _send_http(http_url: str, body_bytes: int) -> str:
    picture = _fake_jpeg((body_bytes - 64) * 3 // 4)
    url = "data:image/jpeg;base64," + base64.b64encode(picture).decode()
    body = json.dumps({"image_url": url}).encode()
    request = urllib.request.Request(
        f"{http_url}/caption", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return str(response.status)
    except urllib.error.HTTPError as err:
        return str(err.code)


def send(door: str, target: str, http_url: str, body_bytes: int) -> tuple[float, float, str]:
    """One body over ``door``: (start, end) on the shared monotonic clock, and its status."""
    start = time.monotonic()
    code = _send_grpc(target, body_bytes) if door == "grpc" else _send_http(http_url, body_bytes)
    return start, time.monotonic(), code


# ---- the prober (this process) -----------------------------------------------------------


class Prober:
    """Times ``GET /health`` and gRPC health ``Check`` alternately, one at a time."""

    def __init__(self, target: str, http_url: str, interval: float) -> None:
        self.health_url = http_url.removesuffix("/v1") + "/health"
        self.target = target
        self.interval = interval
        self.samples: list[tuple[float, str, float]] = []  # (sent at, probe, latency s)
        self.stopping = False

    async def run(self) -> None:
        async with (
            aiohttp.ClientSession() as session,
            grpc.aio.insecure_channel(self.target) as channel,
        ):
            stub = health_pb2_grpc.HealthStub(channel)
            check = health_pb2.HealthCheckRequest(service="")
            turn = 0
            while not self.stopping:
                kind = ("http", "grpc")[turn % 2]
                turn += 1
                start = time.monotonic()
                if kind == "http":
                    async with session.get(self.health_url) as response:
                        await response.read()
                else:
                    await stub.Check(check, timeout=30)
                self.samples.append((start, kind, time.monotonic() - start))
                await asyncio.sleep(self.interval)

    def between(self, start: float, end: float) -> list[float]:
        return [lat for t, _, lat in self.samples if start <= t <= end]


async def _measure(
    args: argparse.Namespace, target: str, http_url: str, pool: ProcessPoolExecutor
) -> dict[str, Any]:
    prober = Prober(target, http_url, args.interval)
    task = asyncio.create_task(prober.run())
    await asyncio.sleep(args.idle)
    idle = prober.between(0.0, time.monotonic())
    loop = asyncio.get_running_loop()
    windows: list[dict[str, Any]] = []
    body_bytes = int(args.body_mb * MIB)
    for _ in range(args.rounds):
        for door in DOORS:
            future: Future = pool.submit(send, door, target, http_url, body_bytes)
            start, end, code = await asyncio.wrap_future(future, loop=loop)
            windows.append({"door": door, "start": start, "end": end, "code": code})
            await asyncio.sleep(args.gap)
    prober.stopping = True
    await task
    return summarize(prober, idle, windows, args)


def summarize(
    prober: Prober, idle: list[float], windows: list[dict[str, Any]], args: argparse.Namespace
) -> dict[str, Any]:
    """Lag per door: probe latency beyond the idle median, over each body's window."""
    base = statistics.median(idle) if idle else 0.0
    rows = []
    for door in DOORS:
        lags: list[float] = []
        worst: list[float] = []  # each body's worst probe
        for w in windows:
            if w["door"] == door:
                # A stall that began inside the window may end just after it.
                mine = [lat - base for lat in prober.between(w["start"], w["end"] + 0.2)]
                lags += mine
                worst.append(max(mine, default=0.0))
        rows.append(
            {
                "door": door,
                "bodies": len(worst),
                "codes": sorted({w["code"] for w in windows if w["door"] == door}),
                "probes": len(lags),
                "lag_p50_ms": percentile(lags, 50) * 1e3 if lags else None,
                "lag_p99_ms": percentile(lags, 99) * 1e3 if lags else None,
                "lag_max_ms": max(lags) * 1e3 if lags else None,
                # A stall a body causes recurs with every body; a busy machine's hiccup does
                # not: the median body's worst probe tells the two apart.
                "body_worst_median_ms": statistics.median(worst) * 1e3 if worst else None,
            }
        )
    t0 = prober.samples[0][0] if prober.samples else 0.0
    return {
        "body_mb": args.body_mb,
        "idle_probe_p50_ms": base * 1e3,
        "idle_probe_max_ms": max(idle, default=0.0) * 1e3,
        "target_ms": args.target_ms,
        "doors": rows,
        "windows": [{**w, "start": w["start"] - t0, "end": w["end"] - t0} for w in windows],
        "probes": [
            (round(t - t0, 4), kind, round(lat * 1e3, 3)) for t, kind, lat in prober.samples
        ],
    }


def table(result: dict[str, Any]) -> str:
    keys = ("lag_p50_ms", "lag_p99_ms", "lag_max_ms", "body_worst_median_ms")
    lines = [
        f"body {result['body_mb']} MB; idle probe p50 {result['idle_probe_p50_ms']:.2f} ms",
        "| door | bodies | codes | probes | lag p50 ms | lag p99 ms | lag max ms "
        "| median body's worst ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["doors"]:
        cells = " | ".join(f"{r[k]:.1f}" if r[k] is not None else "-" for k in keys)
        codes = ",".join(r["codes"])
        lines.append(f"| {r['door']} | {r['bodies']} | {codes} | {r['probes']} | {cells} |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(9, 4))
    for w in result["windows"]:
        ax.axvspan(w["start"], w["end"], color="C0" if w["door"] == "grpc" else "C1", alpha=0.15)
    for i, kind in enumerate(("http", "grpc")):
        ts = [t for t, k, _ in result["probes"] if k == kind]
        lats = [lat for _, k, lat in result["probes"] if k == kind]
        if ts:
            ax.plot(ts, lats, ".", ms=3, color=f"C{i + 2}", label=f"{kind} health probe")
    ax.axhline(result["target_ms"], color="red", lw=0.8, ls="--", label="target")
    ax.set_xlabel("s (shaded: a body in flight; blue gRPC, orange HTTP)")
    ax.set_ylabel("probe latency (ms)")
    ax.set_title(f"loop lag under {result['body_mb']} MB bodies")
    ax.legend(loc="upper right", fontsize=8)
    save(plt, fig, str(path))
    return True


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--spawn", action="store_true", help="start vlm serve (tiny model default)")
    where.add_argument("--target", help="host:port of a running server's gRPC door")
    where.add_argument("--replot", type=Path, help="only redraw the plot of a written JSON")
    ap.add_argument("--http-url", help="its HTTP door, e.g. http://host:8080/v1 (with --target)")
    ap.add_argument("--body-mb", type=float, default=30.0, help="size of each body (MiB)")
    ap.add_argument("--rounds", type=int, default=5, help="bodies per door")
    ap.add_argument("--interval", type=float, default=0.002, help="s between probes")
    ap.add_argument("--idle", type=float, default=2.0, help="s of idle probing first")
    ap.add_argument("--gap", type=float, default=0.5, help="s between bodies")
    ap.add_argument("--target-ms", type=float, default=50.0, help="the lag to stay within")
    ap.add_argument("--tag", default="loop_lag")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "cpu_tiny")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv, server_args = split_server_args(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.replot:
        result = json.loads(args.replot.read_text())
        print(table(result))
        return 0 if plot(result, args.replot.with_suffix(".png")) else 1
    if args.target and not args.http_url:
        raise SystemExit("--target needs --http-url")
    args.out.mkdir(parents=True, exist_ok=True)
    limit = str(int(args.body_mb * MIB) + 2 * MIB)
    with contextlib.ExitStack() as stack:
        if args.spawn:
            log_path = args.out / f"{args.tag}_server.log"
            flags = ["--max-message-bytes", limit, "--max-http-body-bytes", limit, *server_args]
            server = stack.enter_context(SpawnedServer(flags, log_path, quiet=True, http=True))
            target, http_url = server.target, server.http_url or ""
        else:
            target, http_url = args.target, args.http_url
        context = multiprocessing.get_context("spawn")
        pool = stack.enter_context(ProcessPoolExecutor(1, mp_context=context))
        pool.submit(time.monotonic).result(120)  # started before anything is timed
        result = asyncio.run(_measure(args, target, http_url, pool))
    result["server_args"] = portable(server_args)
    result["settings"] = portable_settings(args)
    path = args.out / f"{args.tag}.json"
    path.write_text(json.dumps(result))  # thousands of probes: one line
    png = path.with_suffix(".png")
    plotted = plot(result, png)
    print(table(result))
    print(f"wrote {path}" + (f", {png}" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
