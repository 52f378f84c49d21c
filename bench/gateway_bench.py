"""What the cluster's gateway itself can carry: requests a second through it, with no model
behind it (stand-in replicas, bench/stand_in_replica.py), against the same stand-ins called
directly.

Each request is a streamed Query with a ``--payload`` byte picture (an 800x600 JPEG is about
100 KB), answered with one delta and a result, like a short answer. Load comes from
``--clients`` processes with ``--concurrency`` calls each, so the load generator is not the
limit. Variants: ``direct`` (each client process calls one stand-in), then the gateway with
each ``--workers`` count.

    python -m bench.gateway_bench --workers 1 2 4

Writes gateway_bench.json and gateway_bench.png and prints a table under ``--out`` (default
bench/results/<machine>/gateway/).
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

REPO_ROOT = Path(__file__).resolve().parent.parent


def _client(target: str, requests: int, concurrency: int, payload: int, seed: int) -> float:
    """One load process: ``requests`` calls, ``concurrency`` at a time; returns its seconds."""
    import grpc

    from vlm_server.api.v1 import vision_language_pb2 as pb
    from vlm_server.api.v1 import vision_language_pb2_grpc as pb_grpc

    picture = os.urandom(payload)

    async def run() -> float:
        limit = [("grpc.max_send_message_length", 64 << 20)]
        async with grpc.aio.insecure_channel(target, options=limit) as channel:
            stub = pb_grpc.VisionLanguageStub(channel)
            todo = iter(range(requests))

            async def worker() -> None:
                for i in todo:  # a new picture each: every request has its own key
                    tail = (seed * requests + i).to_bytes(8, "big")
                    request = pb.QueryRequest(image_bytes=picture + tail, question="q")
                    async for _ in stub.Query(request):
                        pass

            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return time.perf_counter() - start

    return asyncio.run(run())


def _load(targets: list[str], args: argparse.Namespace) -> float:
    """Requests a second of ``--clients`` processes spread over ``targets``."""
    per = args.requests // args.clients
    with multiprocessing.get_context("spawn").Pool(args.clients) as pool:
        jobs = [
            (targets[i % len(targets)], per, args.concurrency, args.payload, i)
            for i in range(args.clients)
        ]
        pool.starmap(
            _client, [(t, 16, 4, args.payload, 10_000 + i) for i, (t, *_) in enumerate(jobs)]
        )
        start = time.perf_counter()
        pool.starmap(_client, jobs)
        return per * args.clients / (time.perf_counter() - start)


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


async def _through_gateway(entries: dict[str, Any], workers: int, args: argparse.Namespace):
    from vlm_server.cluster.gateway_workers import GatewayWorkers, WorkerSettings

    async def members() -> dict[str, Any]:
        return entries

    settings = WorkerSettings("127.0.0.1", 0, 0, 1.25, 64 << 20, 64 << 20, refresh_s=0.2)
    gateway = GatewayWorkers(members, settings, workers)
    await gateway.start()
    try:
        await asyncio.sleep(1.0)  # every worker has probed the stand-ins
        return await asyncio.to_thread(_load, [f"127.0.0.1:{gateway.port}"], args)
    finally:
        await gateway.stop(5)


def plot(results: dict[str, float], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar(list(results), list(results.values()))
    ax.set_ylabel("req/s (streamed Query)")
    ax.set_title("gateway capacity, no model")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gateway_bench", description=__doc__)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--clients", type=int, default=4, help="load processes")
    ap.add_argument("--concurrency", type=int, default=32, help="calls in flight per process")
    ap.add_argument("--requests", type=int, default=8000)
    ap.add_argument("--payload", type=int, default=100_000, help="picture bytes")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "bench/results/cpu_tiny/gateway")
    args = ap.parse_args(argv)
    stand_ins = [_stand_in(f"r{i}") for i in (1, 2)]
    try:
        entries = {f"r{i + 1}": e for i, (_, e) in enumerate(stand_ins)}
        results = {"direct": _load([e["grpc"] for e in entries.values()], args)}
        for n in args.workers:
            results[f"gateway x{n}"] = asyncio.run(_through_gateway(entries, n, args))
            print(f"gateway x{n}: {results[f'gateway x{n}']:.0f} req/s", file=sys.stderr)
    finally:
        for proc, _ in stand_ins:
            proc.kill()
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {k: getattr(args, k) for k in ("clients", "concurrency", "requests", "payload")}
    data = {"cpus": os.cpu_count(), **meta, "req_per_s": results}
    (args.out / "gateway_bench.json").write_text(json.dumps(data, indent=2) + "\n")
    plot(results, args.out / "gateway_bench.png")
    print(f"{'variant':<12} {'req/s':>8}")
    for name, value in results.items():
        print(f"{name:<12} {value:8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
