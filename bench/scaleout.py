"""Scale-out on Ray Serve: one replica per GPU, image-affinity routing (vlm cluster).

For each ``--replicas`` count it starts ``vlm cluster --replicas N`` (the flags after ``--``
go to every replica), waits until all N replicas serve, and measures through the cluster's
gateway (with ``--ray-ingress``, also the most replicas behind Ray Serve's proxies, run
``rayN``), Query streamed with max_tokens 3 (query3) on 800x600 JPEGs, with C clients: 128,
or ``--clients-per-replica`` (64) per replica past two (256 for 4 replicas, 512 for 8), and
``--requests`` per level grown by the same factor:

    unique.c1        one client, a new picture every request: p50 end to end
    unique.cC        C clients, a new picture every request: req/s
    affinity.cC      C clients, each picture asked 4 questions, interleaved (blocks of 32
                     pictures: their first questions, then their second ...): req/s, and the
                     hit rate: the share of the 2nd-4th questions answered from a cached image
                     prefix (the answer's cached_tokens), which only the same replica has

then, with ``--alone`` (default on), ``vlm serve`` by itself on the first GPU: unique.c1 p50.
Results merge into ``<out>/scaleout.json`` by replica count, so ``--replicas 1`` and
``--replicas 2`` may run apart; once both (and the alone run) are there it prints and, with
``--targets``, merges the target rows (bench/targets.py):

    scaleout.query3.unique.c128.speedup_2gpu   2-replica req/s over 1-replica    >= 1.9
    scaleout.query3.affinity.hit_rate          2 replicas                         >= 0.9
    scaleout.query3.affinity.speedup_2gpu      2-replica req/s over 1-replica    >= 1.9
    scaleout.query3.unique.c1.p50_ratio        cluster (most replicas) over alone <= 1.10
    scaleout.query3.unique.c256.speedup_4gpu   4 replicas at c256 over 1 at c128  >= 3.8
    scaleout.query3.unique.c512.speedup_8gpu   8 replicas at c512 over 1 at c128  >= 7.4
    scaleout.query3.affinity.hit_rate_8gpu     8 replicas                         >= 0.9

(one replica is saturated from 64 clients on: its c128 figure is its capacity).

    python -m bench.scaleout --replicas 1 2 --targets bench/results/NVIDIA_H100/targets.json \
        -- --model md2 --preset moondream2 --tokenizer starmie/tokenizer.json --dtype bf16
    python -m bench.scaleout --replicas 1 2 4 8 ...    # on 8 GPUs
    python -m bench.scaleout --replicas 1 2 4 8 --plan  # the runs it would make, and exit

Needs the cluster extra (ray[serve]) and N GPUs. Writes scaleout.json, scaleout.png and prints
a table under ``--out`` (default bench/results/<GPU>/scaleout/); each server's log goes to
``<out>/scaleout_<run>.log``. ``--targets`` defaults to bench/results/<GPU>/targets.json on a
GPU machine. Smaller runs: ``--requests``, ``--c1-requests``, ``--concurrency``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench import targets as tg
from bench.load_gen import Record, Workload, closed_loop, free_port, summarize
from bench.synth_images import unique_images
from vlm_server.client import AsyncVisionLanguageClient
from vlm_server.client import types as t

QUERY3 = Workload("query3", "query", True, max_tokens=3, question="What is in this image?")
SIZE = (800, 600)
QUESTIONS = 4  # per picture in the affinity scenario
BLOCK = 32  # pictures whose questions interleave
REPO_ROOT = Path(__file__).resolve().parent.parent
# Target rows past two GPUs: (replicas, their clients) of the unique speedups, and (run,
# clients, row) of the hit rates (bench/targets.py).
SPEEDUP_ROWS = ((4, 256), (8, 512))
HIT_ROWS = (
    ("r2", 128, "scaleout.query3.affinity.hit_rate"),
    ("r8", 512, "scaleout.query3.affinity.hit_rate_8gpu"),
)
START_TIMEOUT_S = 1800.0  # model loading and graph capture on every replica


def affinity_order(images: Sequence[bytes], questions: int, block: int) -> list[bytes]:
    """Each picture ``questions`` times: per block of pictures, every first question, then
    every second ..."""
    out: list[bytes] = []
    for start in range(0, len(images), block):
        chunk = list(images[start : start + block])
        for _ in range(questions):
            out.extend(chunk)
    return out


def hit_rate(records: Sequence[Record], pictures: int) -> float:
    """Repeat questions answered from a cached prefix, over repeat questions."""
    repeats = len(records) - pictures
    hits = sum(1 for r in records if r.ok and r.server is not None and r.server.cached_tokens)
    return min(1.0, hits / repeats) if repeats > 0 else float("nan")


class Spawned:
    """A ``vlm`` command in its own process group; SIGTERM (drain) on exit."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log.open("w")
        cmd = [sys.executable, "-m", "vlm_server.cli", *args]
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(180)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


def _replicas_serving(metrics_url: str) -> int:
    """Replicas the doors route to: the gateway's count, or (Ray's proxies) those reporting."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("vlm_gateway_replicas_serving "):
            return int(float(line.split()[1]))
    names = {
        line.split('replica="', 1)[1].split('"', 1)[0]
        for line in text.splitlines()
        if line.startswith("vlm_requests_in_flight{") and 'replica="' in line
    }
    return len(names - {"all"})


async def _wait_ready(target: str, spawned: Spawned, replicas: int, metrics_url: str | None):
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if not spawned.alive():
            raise RuntimeError(f"the server exited; see {spawned.log.name}")
        try:
            async with AsyncVisionLanguageClient(target, timeout=5) as client:
                await client.model_info()
            if metrics_url is None or _replicas_serving(metrics_url) >= replicas:
                return
        except (t.VlmError, OSError):
            pass
        await asyncio.sleep(2)
    raise RuntimeError(f"not ready after {START_TIMEOUT_S:.0f}s; see {spawned.log.name}")


async def _level(
    target: str, images: list[bytes], concurrency: int, warmup: list[bytes]
) -> tuple[list[Record], float]:
    async with AsyncVisionLanguageClient(target, timeout=600) as client:
        if warmup:  # graph capture, allocator growth: not part of the figure
            with tqdm(total=len(warmup), desc="warm-up", leave=False) as bar:
                await closed_loop(client, QUERY3, warmup, concurrency, len(warmup), 1e9, 600, bar)
        with tqdm(total=len(images), desc=f"c={concurrency}", leave=False) as bar:
            return await closed_loop(
                client, QUERY3, images, concurrency, len(images), 1e9, 600, bar
            )


def gateway_counts(metrics_url: str | None) -> tuple[float, float] | None:
    """(requests routed, requests that went to their picture's replica) so far, from the
    gateway's metrics (None: no gateway)."""
    if metrics_url is None:
        return None
    try:
        with urllib.request.urlopen(metrics_url, timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return None
    routed = homes = None
    for line in text.splitlines():
        if line.startswith("vlm_gateway_routed_total{"):
            routed = (routed or 0.0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith("vlm_gateway_home_hits_total "):
            homes = float(line.rsplit(" ", 1)[1])
    return (routed, homes) if routed is not None and homes is not None else None


@dataclass(frozen=True)
class Run:
    """One server to start and measure."""

    name: str
    command: list[str]
    replicas: int
    clients: int  # the C of its unique.cC and affinity.cC levels
    requests: int  # per level


def clients_for(replicas: int, args: argparse.Namespace) -> int:
    """C: ``--concurrency``, or ``--clients-per-replica`` per replica where that is more."""
    return max(args.concurrency, args.clients_per_replica * replicas)


def plan(args: argparse.Namespace) -> list[Run]:
    """The runs ``args`` ask for, in order: each replica count, Ray's proxies, alone."""
    runs = []
    for n in args.replicas:
        command = ["cluster", "--replicas", str(n), *args.cluster_flags]
        runs.append(_run(f"r{n}{args.tag}", command, n, args))
    if args.ray_ingress:  # the same replicas behind Ray Serve's proxies, for comparison
        n = max(args.replicas)
        command = ["cluster", "--replicas", str(n), "--ingress", "ray", *args.cluster_flags]
        runs.append(_run(f"ray{n}{args.tag}", command, n, args))
    if args.alone:
        runs.append(_run("alone", ["serve"], 1, args))
    return runs


def _run(name: str, command: list[str], replicas: int, args: argparse.Namespace) -> Run:
    clients = clients_for(replicas, args)
    requests = args.requests * clients // args.concurrency
    return Run(name, command, replicas, clients, requests)


async def measure(
    target: str, args: argparse.Namespace, index: int, run: Run, metrics_url: str | None
) -> dict:
    """The scenarios of one running server; ``index`` keeps pictures unique across runs."""
    w, h = SIZE
    n, c = run.requests, run.clients
    pictures = unique_images(w, h, range(index, index + 3 * n + 64), desc="images")
    warm, c1, rest = pictures[:64], pictures[64 : 64 + args.c1_requests], pictures[64 + n :]
    out: dict[str, Any] = {}
    records, wall = await _level(target, c1, 1, warm[:8])
    out["unique.c1"] = summarize(records, wall, 1e9)
    if run.name == "alone":
        return out
    records, wall = await _level(target, rest[:n], c, warm)
    out[f"unique.c{c}"] = summarize(records, wall, 1e9)
    images = rest[n : n + n // QUESTIONS]
    before = gateway_counts(metrics_url)
    records, wall = await _level(target, affinity_order(images, QUESTIONS, BLOCK), c, [])
    after = gateway_counts(metrics_url)
    affinity = out[f"affinity.c{c}"] = summarize(records, wall, 1e9)
    affinity["hit_rate"] = hit_rate(records, len(images))
    if before and after and after[0] > before[0]:  # the gateway's own view: guard spills
        affinity["home_share"] = (after[1] - before[1]) / (after[0] - before[0])
    return out


async def run(args: argparse.Namespace, server_args: list[str]) -> dict[str, Any]:
    out_dir: Path = args.out
    results: dict[str, Any] = {}
    for i, run_ in enumerate(plan(args)):
        name, command, replicas = run_.name, run_.command, run_.replicas
        port, http_port, metrics_port = free_port(), free_port(), free_port()
        cmd = [*command, "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--http-port", str(http_port), "--metrics-port", str(metrics_port), *server_args]
        env = dict(os.environ)
        if name == "alone":  # the first GPU, as replica 0 of a cluster would have it
            env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        spawned = Spawned(cmd, out_dir / f"scaleout_{name}.log", env)
        target = f"127.0.0.1:{port}"
        try:
            metrics = f"http://127.0.0.1:{metrics_port}/metrics" if name != "alone" else None
            await _wait_ready(target, spawned, replicas, metrics)
            print(f"{name}: measuring", file=sys.stderr)
            results[name] = {
                "replicas": replicas,
                "ingress": "ray" if "ray" in command else "gateway",
                "command": cmd,
                "clients": run_.clients,
                "scenarios": await measure(target, args, 1 + i * 100_000, run_, metrics),
            }
        finally:
            spawned.stop()
    return results


def rows(data: dict[str, Any], prefix: str, commit: str | None) -> list[tg.Row]:
    """The target rows the runs in ``data`` allow (bench/targets.py, SOURCES)."""
    runs = data.get("runs") or {}

    def get(run: str, scenario: str, key: str) -> float | None:
        return (((runs.get(run) or {}).get("scenarios") or {}).get(scenario) or {}).get(key)

    flags = tg.server_flags(data.get("server_args") or [])
    out: list[tg.Row] = []
    for scenario, name in (
        ("unique.c128", "scaleout.query3.unique.c128.speedup_2gpu"),
        ("affinity.c128", "scaleout.query3.affinity.speedup_2gpu"),
    ):
        one, two = get("r1", scenario, "req_per_s"), get("r2", scenario, "req_per_s")
        if one and two:
            out.append(tg.make_row(prefix, name, two / one, commit, flags))
    one = get("r1", "unique.c128", "req_per_s")
    for n, clients in SPEEDUP_ROWS:
        many = get(f"r{n}", f"unique.c{clients}", "req_per_s")
        if one and many:
            name = f"scaleout.query3.unique.c{clients}.speedup_{n}gpu"
            out.append(tg.make_row(prefix, name, many / one, commit, flags))
    for run, clients, name in HIT_ROWS:
        hits = get(run, f"affinity.c{clients}", "hit_rate")
        if hits is not None:
            out.append(tg.make_row(prefix, name, hits, commit, flags))
    most = max(
        (k for k in runs if k[:1] == "r" and k[1:].isdigit()),
        key=lambda k: int(k[1:]),
        default=None,
    )
    alone = get("alone", "unique.c1", "e2e_p50_ms")
    cluster = get(most, "unique.c1", "e2e_p50_ms") if most else None
    if alone and cluster:
        name = "scaleout.query3.unique.c1.p50_ratio"
        out.append(tg.make_row(prefix, name, cluster / alone, commit, flags))
    return out


def plot(data: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    runs = {k: v for k, v in (data.get("runs") or {}).items() if k != "alone"}
    scenarios = ("unique", "affinity")
    fig, ax = plt.subplots(figsize=(6, 3.6))
    width = 0.8 / max(1, len(runs))
    for i, (_, run) in enumerate(sorted(runs.items())):
        c = run.get("clients", 128)
        got = run["scenarios"]
        values = [(got.get(f"{s}.c{c}") or {}).get("req_per_s") or 0 for s in scenarios]
        xs = [j + i * width for j in range(len(scenarios))]
        ax.bar(xs, values, width, label=f"{run['replicas']} replica(s), {run.get('ingress')}")
    ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(scenarios))], scenarios)
    ax.set_ylabel("req/s (query3, 800x600, 64 clients a replica, 128 at least)")
    ax.set_title("vlm cluster: scale-out")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _results_folder() -> Path:
    """bench/results/<GPU> of this machine's first GPU (``cpu`` without one)."""
    import torch

    name = tg.gpu_folder(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else "cpu"
    return REPO_ROOT / "bench" / "results" / name


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """(this script's arguments, the server flags after ``--``)."""
    argv = list(argv)
    server_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="python -m bench.scaleout", description=__doc__)
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2], metavar="N")
    ap.add_argument("--alone", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument(
        "--ray-ingress",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="also the most replicas behind Ray Serve's proxies (--ingress ray)",
    )
    ap.add_argument(
        "--tag", default="", help="appended to the run names (variants beside the runs of record)"
    )
    ap.add_argument(
        "--cluster-flags",
        nargs="*",
        default=[],
        help="vlm cluster flags of these runs (e.g. --affinity-load-factor=1.5)",
    )
    ap.add_argument("--concurrency", type=int, default=128, help="clients, at least")
    ap.add_argument(
        "--clients-per-replica", type=int, default=64, help="clients per replica, past two"
    )
    ap.add_argument("--requests", type=int, default=2048, help="per level of 128 clients")
    ap.add_argument("--c1-requests", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None, help="default: bench/results/<GPU>/scaleout")
    ap.add_argument(
        "--targets",
        type=Path,
        default=None,
        help="targets.json to merge into (default on a GPU: bench/results/<GPU>/targets.json)",
    )
    ap.add_argument("--commit", default=None)
    ap.add_argument("--prefix", default="md2")
    ap.add_argument(
        "--plan", action="store_true", help="print the runs and their clients, start nothing"
    )
    args = ap.parse_args(argv)
    if min(args.replicas) < 1 or args.concurrency < 1 or args.clients_per_replica < 1:
        ap.error("--replicas, --concurrency and --clients-per-replica are at least 1")
    return args, server_args


def main(argv: Sequence[str] | None = None) -> int:
    args, server_args = parse(sys.argv[1:] if argv is None else argv)
    if args.plan:
        for r in plan(args):
            print(f"{r.name:<8} {' '.join(r.command):<40} clients {r.clients:>4}  "
                  f"requests {r.requests:>5}")  # fmt: skip
        return 0
    folder = _results_folder()
    if args.out is None:
        args.out = folder / "scaleout"
    if args.targets is None and folder.name != "cpu":
        args.targets = folder / "targets.json"
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "scaleout.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data.setdefault("runs", {}).update(asyncio.run(run(args, server_args)))
    data["server_args"] = server_args
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    plot(data, args.out / "scaleout.png")
    for name, run_ in sorted(data["runs"].items()):
        for scenario, s in run_["scenarios"].items():
            print(
                f"{name:<6} {scenario:<14} req/s {s.get('req_per_s', 0):9.1f}  "
                f"p50 {s.get('e2e_p50_ms', float('nan')):8.1f} ms  "
                f"hit {s.get('hit_rate', float('nan')):.3f}  "
                f"home {s.get('home_share', float('nan')):.3f}  errors {s.get('errors') or {}}"
            )
    new = rows(data, args.prefix, args.commit)
    print(tg.table(new))
    if args.targets is not None and new:
        tg.write(args.targets, tg.merge(tg.load(args.targets), new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
