"""What the cluster's gateway itself can carry: requests a second through it, with no model
behind it (stand-in replicas, bench/stand_in_replica.py), against the same stand-ins called
directly, and the CPU time its workers spend per request.

Each request is a streamed Query with a ``--payload`` byte picture (an 800x600 JPEG is about
100 KB), answered with one delta and a result, like a short answer. ``--traffic repeated``
(the default): each load process asks about its own ``--pictures`` pictures in turn, so
every picture comes back (the gateway's repeat path: the holders it remembers);
``unique``: a new picture every request. Load comes from ``--clients`` processes with
``--concurrency`` calls each. For each ``--stand-ins`` count: ``direct`` (the load processes
call the stand-ins themselves), then the gateway with each ``--workers`` count (default: the
count ``vlm cluster`` picks for that many replicas on this machine, options/cluster.py).

The CPU figure: the gateway workers' own CPU seconds over the measured requests
(``cpu_ms_per_request``, from /proc), and what one fully used core would carry at that
cost (``req_s_per_core``). On a machine where the load processes and the stand-ins share
the cores with the gateway, req/s is what the machine allows, not the gateway's capacity;
the CPU cost per request is the figure that carries over.

    python -m bench.gateway_bench --stand-ins 8 16
    python -m bench.gateway_bench --stand-ins 2 --workers 1 2 4 --traffic unique

Writes gateway_bench.json and gateway_bench.png and prints a table under ``--out`` (default
bench/results/cpu_<N>core/gateway/, N: this machine's usable CPUs), and merges the rows
``gateway.<traffic>.req_s_<N>stand_ins`` (default workers) into ``--targets`` (default
bench/results/cpu_<N>core/targets.json; bench/targets.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import targets as tg
from bench.plotting import pyplot, save
from vlm_server.options.cluster import ClusterConfig, gateway_workers

REPO_ROOT = Path(__file__).resolve().parent.parent


def _client(
    target: str, requests: int, concurrency: int, payload: int, seed: int, pictures: int
) -> float:
    """One load process: ``requests`` calls, ``concurrency`` at a time; returns its seconds.
    ``pictures`` 0: a new picture each request; else this process's pictures in turn."""
    import grpc

    from vlm_server.api.v1 import vision_language_pb2 as pb
    from vlm_server.api.v1 import vision_language_pb2_grpc as pb_grpc

    body = os.urandom(payload)

    def picture(i: int) -> bytes:
        n = seed * requests + (i if not pictures else i % pictures)
        return body + n.to_bytes(8, "big")

    async def run() -> float:
        limit = [("grpc.max_send_message_length", 64 << 20)]
        async with grpc.aio.insecure_channel(target, options=limit) as channel:
            stub = pb_grpc.VisionLanguageStub(channel)
            todo = iter(range(requests))

            async def worker() -> None:
                for i in todo:
                    request = pb.QueryRequest(image_bytes=picture(i), question="q")
                    async for _ in stub.Query(request):
                        pass

            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return time.perf_counter() - start

    return asyncio.run(run())


def _load(targets: list[str], args: argparse.Namespace) -> float:
    """Requests a second of ``--clients`` processes spread over ``targets``."""
    per = args.requests // args.clients
    pictures = args.pictures if args.traffic == "repeated" else 0
    with multiprocessing.get_context("spawn").Pool(args.clients) as pool:
        jobs = [
            (targets[i % len(targets)], per, args.concurrency, args.payload, i, pictures)
            for i in range(args.clients)
        ]
        warm = [(t, 16, 4, args.payload, 10_000 + i, 0) for i, (t, *_) in enumerate(jobs)]
        pool.starmap(_client, warm)
        start = time.perf_counter()
        pool.starmap(_client, jobs)
        return per * args.clients / (time.perf_counter() - start)


def cpu_seconds(pids: list[int]) -> float | None:
    """User and system CPU seconds of these processes so far (None without /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        fields = stat.rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
    return total / ticks


def _stand_in(name: str) -> tuple[subprocess.Popen, dict[str, Any]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.stand_in_replica", name],
        stdout=subprocess.PIPE,
        cwd=REPO_ROOT,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
        },
    )
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())


async def _through_gateway(
    entries: dict[str, Any], workers: int, args: argparse.Namespace
) -> dict[str, Any]:
    from vlm_server.cluster.gateway_workers import GatewayWorkers, WorkerSettings

    async def members() -> dict[str, Any]:
        return entries

    settings = WorkerSettings("127.0.0.1", 0, 0, 2.0, 64 << 20, 64 << 20)
    gateway = GatewayWorkers(members, settings, workers)
    await gateway.start()
    try:
        await asyncio.sleep(2 * settings.refresh_s)  # every worker has probed the stand-ins
        before = cpu_seconds(gateway.pids())
        req_s = await asyncio.to_thread(_load, [f"127.0.0.1:{gateway.port}"], args)
        after = cpu_seconds(gateway.pids())
    finally:
        await gateway.stop(5)
    row: dict[str, Any] = {"workers": workers, "req_per_s": req_s}
    if before is not None and after is not None:
        # The warm-up's 16 requests per load process count too: a few percent at most.
        done = args.requests // args.clients * args.clients + 16 * args.clients
        row["cpu_ms_per_request"] = (after - before) * 1e3 / done
        row["req_s_per_core"] = 1e3 / row["cpu_ms_per_request"]
    return row


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(6, 3.4))
    labels = [f"{r['stand_ins']} stand-ins\n{r['variant']}" for r in rows]
    ax.bar(labels, [r["req_per_s"] for r in rows])
    ax.set_ylabel("req/s (streamed Query)")
    ax.set_title(f"gateway capacity, no model, {os.cpu_count()} CPUs")
    ax.tick_params(axis="x", labelsize=7)
    save(plt, fig, str(path))
    return True


def rows_of(data: dict[str, Any], commit: str | None) -> list[tg.Row]:
    """The target rows: the gateway at its default workers, per stand-in count, each with a
    note of the machine (whose cores the load processes and stand-ins share) and of the
    workers' CPU time a request, the figure that carries over to other machines."""
    out: list[tg.Row] = []
    for r in data.get("rows") or []:
        if r.get("default_workers") and r["variant"] != "direct":
            name = f"gateway.{data['traffic']}.req_s_{r['stand_ins']}stand_ins"
            row = tg.make_row("", name, r["req_per_s"], commit, f"--gateway-workers {r['workers']}")
            note = f"{data['cpus']} CPUs shared with the load and the stand-ins"
            if r.get("cpu_ms_per_request") is not None:
                note += (
                    f"; {r['cpu_ms_per_request']:.2f} ms of worker CPU a request "
                    f"(~{r['req_s_per_core']:.0f} req/s a core)"
                )
            out.append(row | {"note": note})
    return out


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def main(argv: list[str] | None = None) -> int:
    cpus = usable_cpus()
    folder = REPO_ROOT / "bench" / "results" / f"cpu_{cpus}core"
    ap = argparse.ArgumentParser(prog="python -m bench.gateway_bench", description=__doc__)
    ap.add_argument("--stand-ins", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--workers", type=int, nargs="+", default=None, help="default: the rule's")
    ap.add_argument("--traffic", choices=("repeated", "unique"), default="repeated")
    ap.add_argument("--pictures", type=int, default=64, help="per load process (repeated)")
    ap.add_argument("--clients", type=int, default=4, help="load processes")
    ap.add_argument("--concurrency", type=int, default=32, help="calls in flight per process")
    ap.add_argument("--requests", type=int, default=8000)
    ap.add_argument("--payload", type=int, default=100_000, help="picture bytes")
    ap.add_argument("--direct", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out", type=Path, default=folder / "gateway")
    ap.add_argument("--targets", type=Path, default=folder / "targets.json")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for count in args.stand_ins:
        rule = gateway_workers(ClusterConfig(replicas=count), cpus)
        stand_ins = [_stand_in(f"r{i}") for i in range(count)]
        try:
            entries = {f"r{i}": e for i, (_, e) in enumerate(stand_ins)}
            if args.direct:
                req_s = _load([e["grpc"] for e in entries.values()], args)
                rows.append({"stand_ins": count, "variant": "direct", "req_per_s": req_s})
            for n in args.workers or [rule]:
                row = asyncio.run(_through_gateway(entries, n, args))
                rows.append(
                    {"stand_ins": count, "variant": f"gateway x{n}", "default_workers": n == rule}
                    | row
                )
                print(f"{count} stand-ins, gateway x{n}: {row}", file=sys.stderr)
        finally:
            for proc, _ in stand_ins:
                proc.kill()
                proc.wait()
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        k: getattr(args, k)
        for k in ("traffic", "pictures", "clients", "concurrency", "requests", "payload")
    }
    data = {"cpus": cpus, **meta, "rows": rows}
    (args.out / "gateway_bench.json").write_text(json.dumps(data, indent=2) + "\n")
    plot(rows, args.out / "gateway_bench.png")
    print(f"{'stand-ins':>9} {'variant':<12} {'req/s':>8} {'cpu ms/req':>10} {'req/s/core':>10}")
    for r in rows:
        cpu = r.get("cpu_ms_per_request")
        per_core = r.get("req_s_per_core")
        print(
            f"{r['stand_ins']:>9} {r['variant']:<12} {r['req_per_s']:8.0f} "
            f"{cpu if cpu is not None else float('nan'):10.3f} "
            f"{per_core if per_core is not None else float('nan'):10.0f}"
        )
    new = rows_of(data, args.commit)
    if new:
        print(tg.table(new))
        tg.write(args.targets, tg.merge(tg.load(args.targets), new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
