"""Soak test: sustained mixed load with cancel storms and hostile requests; resident memory,
error counts and KV pages over time.

    python -m bench.soak --spawn --duration 150 -- --device cpu        # the built-in tiny model
    python -m bench.soak --target host:50051 --metrics-url http://host:9464/metrics

``--concurrency`` workers loop until ``--duration`` s have passed, each picking a request:

    normal    caption (streamed), query, point, detect, or EncodeImage then a query by id,
              each on a fresh picture (unique pixels: no image-cache or prefix hits)
    cancel    a streamed caption cancelled after its first delta or a random few ms
    deadline  a request whose deadline (20-300 ms) passes while it runs or queues
    hostile   corrupt protobuf, invalid UTF-8, garbage or truncated images, a 10 KB object
              name, NaN settings, unknown image ids

and every ``--storm-every`` s, ``--storm-size`` streams opened at once and all cancelled.
Resident memory (the spawned process's /proc status, else the server's
process_resident_memory_bytes metric), the image cache and KV pages are sampled every
``--sample-every`` s. At the end the load stops, the server idles for ``--settle`` s, and the
final RSS, KV pages in use (only cached image prefixes should hold any) and the count of each
status code per kind are printed. Clean codes: OK, INVALID_ARGUMENT, CANCELLED,
DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, OUT_OF_RANGE; UNKNOWN or INTERNAL fails the run.
Writes ``soak.json`` (and ``soak_rss.png`` when matplotlib is present) under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import random
import re
import sys
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from bench.load_gen import REPO_ROOT, SpawnedServer, portable, portable_settings, split_server_args
from bench.synth_images import base_image, parse_size
from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.api.v1 import vision_language_pb2_grpc as pb_grpc

SERVICE = "/vlm.v1.VisionLanguage/"
CLEAN = {
    "OK",
    "INVALID_ARGUMENT",
    "CANCELLED",
    "DEADLINE_EXCEEDED",
    "RESOURCE_EXHAUSTED",
    "OUT_OF_RANGE",
}
MIB = 1 << 20


# ---- pictures -------------------------------------------------------------------------------


def _jpeg(width: int, height: int, seed: int) -> bytes:
    out = io.BytesIO()
    base_image(width, height, seed).save(out, format="JPEG", quality=90)
    return out.getvalue()


class Pictures:
    """Fresh JPEGs without encoding each one: a few bases, each copy with its lowest-
    frequency quantization entries set from the request index. The decoder multiplies every
    block's DC and first AC coefficients by them, so each copy decodes to other pixels (at
    any reduced decode scale too) at the full decode cost of the base."""

    BASES = 8

    def __init__(self, width: int, height: int) -> None:
        self._bases = [_jpeg(width, height, seed) for seed in range(self.BASES)]
        self._tables = [b.index(b"\xff\xdb") + 5 for b in self._bases]  # first DQT's entries
        self._next = 0

    def take(self) -> bytes:
        i, self._next = self._next, self._next + 1
        base = self._bases[i % self.BASES]
        at = self._tables[i % self.BASES]
        n = i // self.BASES
        digits = bytes(8 + (n >> (4 * k)) % 16 for k in range(4))  # 16^4 copies per base
        return base[:at] + digits + base[at + len(digits) :]


# ---- requests -------------------------------------------------------------------------------


@dataclass
class Tally:
    """Status codes by request kind, and how many requests finished in each second."""

    codes: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))

    def add(self, kind: str, code: str) -> None:
        self.codes[kind][code] += 1

    def total(self) -> int:
        return sum(sum(c.values()) for c in self.codes.values())

    def unclean(self) -> int:
        return sum(n for c in self.codes.values() for code, n in c.items() if code not in CLEAN)


def _settings(**kw: Any) -> pb.GenerationSettings:
    return pb.GenerationSettings(temperature=0, **kw)


class Load:
    """The request mix against one channel."""

    def __init__(self, channel: grpc.aio.Channel, pictures: Pictures, tally: Tally) -> None:
        self.channel = channel
        self.stub = pb_grpc.VisionLanguageStub(channel)
        self.pictures = pictures
        self.tally = tally
        self.rng = random.Random(0)

    async def _run(self, kind: str, call: Awaitable[Any]) -> None:
        try:
            await call
            code = "OK"
        except grpc.RpcError as err:
            code = err.code().name
        except asyncio.CancelledError:
            raise
        self.tally.add(kind, code)

    async def _ended(self, kind: str, call: Any) -> None:
        """Tally a call this side cancelled (reading it would raise CancelledError here)."""
        self.tally.add(kind, (await call.code()).name)

    async def _stream(self, call: Any) -> None:
        async for _ in call:
            pass

    # normal
    async def caption(self) -> None:
        request = pb.CaptionRequest(
            image_bytes=self.pictures.take(), settings=_settings(max_tokens=16)
        )
        await self._run("caption", self._stream(self.stub.Caption(request, timeout=120)))

    async def query(self) -> None:
        request = pb.QueryRequest(
            image_bytes=self.pictures.take(),
            question="what is it?",
            settings=_settings(max_tokens=8),
        )
        await self._run("query", self._stream(self.stub.Query(request, timeout=120)))

    async def point(self) -> None:
        request = pb.PointRequest(
            image_bytes=self.pictures.take(), object="ball", settings=_settings(max_objects=3)
        )
        await self._run("point", self.stub.Point(request, timeout=120))

    async def detect(self) -> None:
        request = pb.DetectRequest(
            image_bytes=self.pictures.take(), object="house", settings=_settings(max_objects=3)
        )
        await self._run("detect", self.stub.Detect(request, timeout=120))

    async def upload_then_query(self) -> None:
        async def both() -> None:
            encoded = await self.stub.EncodeImage(
                pb.EncodeImageRequest(image_bytes=self.pictures.take()), timeout=120
            )
            request = pb.QueryRequest(
                image_id=encoded.image_id, question="and now?", settings=_settings(max_tokens=4)
            )
            await self._stream(self.stub.Query(request, timeout=120))

        await self._run("upload+query", both())

    # cancel and deadline
    async def cancel(self) -> None:
        request = pb.CaptionRequest(
            image_bytes=self.pictures.take(), settings=_settings(max_tokens=64)
        )
        call = self.stub.Caption(request, timeout=120)
        if self.rng.random() < 0.5:
            with contextlib.suppress(grpc.RpcError, StopAsyncIteration):
                await call.read()
        else:
            await asyncio.sleep(self.rng.uniform(0.0, 0.05))
        call.cancel()
        await self._ended("cancel", call)

    async def deadline(self) -> None:
        timeout = self.rng.uniform(0.02, 0.3)
        request = pb.CaptionRequest(
            image_bytes=self.pictures.take(), settings=_settings(max_tokens=64)
        )
        await self._run("deadline", self._stream(self.stub.Caption(request, timeout=timeout)))

    # hostile
    async def hostile(self) -> None:
        good = self.pictures.take()
        raw_point = self.channel.unary_unary(SERVICE + "Point")
        bad_utf8 = pb.PointRequest(image_bytes=good, object="zq").SerializeToString()
        cases: list[Callable[[], Awaitable[Any]]] = [
            lambda: raw_point(bytes(self.rng.getrandbits(8) for _ in range(64)), timeout=30),
            lambda: raw_point(bad_utf8.replace(b"zq", b"\xff\xfe"), timeout=30),
            lambda: self.stub.Detect(
                pb.DetectRequest(image_bytes=b"\x00junk" * 99, object="x"), timeout=30
            ),
            lambda: self.stub.Point(
                pb.PointRequest(image_bytes=good[: len(good) // 3], object="x"), timeout=30
            ),
            lambda: self.stub.Point(
                pb.PointRequest(image_bytes=good, object="x" * 10_000), timeout=30
            ),
            lambda: self._stream(
                self.stub.Caption(
                    pb.CaptionRequest(
                        image_bytes=good, settings=pb.GenerationSettings(temperature=float("nan"))
                    ),
                    timeout=30,
                )
            ),
            lambda: self._stream(
                self.stub.Query(pb.QueryRequest(image_id="f" * 64, question="q"), timeout=30)
            ),
        ]
        await self._run("hostile", self.rng.choice(cases)())

    async def storm(self, size: int) -> None:
        """``size`` streams opened at once, all cancelled as soon as they are open."""
        request = pb.CaptionRequest(
            image_bytes=self.pictures.take(), settings=_settings(max_tokens=64)
        )
        calls = [self.stub.Caption(request, timeout=120) for _ in range(size)]
        await asyncio.sleep(0.05)
        for call in calls:
            call.cancel()
        await asyncio.gather(*(self._ended("storm", c) for c in calls))

    def pick(self) -> Callable[[], Awaitable[None]]:
        r = self.rng.random()
        if r < 0.60:
            return self.rng.choice(
                [self.caption, self.query, self.point, self.detect, self.upload_then_query]
            )
        if r < 0.75:
            return self.cancel
        if r < 0.85:
            return self.deadline
        return self.hostile


# ---- sampling -------------------------------------------------------------------------------


def _rss_of_pid(pid: int) -> float | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / MIB
    return None


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        return unlabelled_values(response.read().decode())


def unlabelled_values(text: str) -> dict[str, float]:
    """The samples without labels in Prometheus ``text``, by name."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.labels:
                values[s.name] = s.value
    return values


@dataclass
class Sample:
    t: float
    rss_mib: float | None
    image_cache_mib: float | None
    kv_pages_in_use: float | None
    kv_pages_total: float | None
    done: int


class Sampler:
    def __init__(self, metrics_url: str | None, pid: int | None, tally: Tally) -> None:
        self.metrics_url = metrics_url
        self.pid = pid
        self.tally = tally
        self.samples: list[Sample] = []
        self.t0 = time.perf_counter()

    def take(self) -> Sample:
        metrics: dict[str, float] = {}
        if self.metrics_url:
            with contextlib.suppress(OSError, ValueError):
                metrics = _scrape(self.metrics_url)
        rss = _rss_of_pid(self.pid) if self.pid else None
        if rss is None and "process_resident_memory_bytes" in metrics:
            rss = metrics["process_resident_memory_bytes"] / MIB
        cache = metrics.get("vlm_image_cache_bytes")
        sample = Sample(
            round(time.perf_counter() - self.t0, 2),
            None if rss is None else round(rss, 1),
            None if cache is None else round(cache / MIB, 1),
            metrics.get("vlm_kv_pages_in_use"),
            metrics.get("vlm_kv_pages_total"),
            self.tally.total(),
        )
        self.samples.append(sample)
        return sample


# ---- the run --------------------------------------------------------------------------------


async def soak(target: str, args: argparse.Namespace, sampler: Sampler, tally: Tally) -> None:
    width, height = parse_size(args.image_size)
    pictures = Pictures(width, height)
    options = [("grpc.max_receive_message_length", 64 * MIB)]
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        load = Load(channel, pictures, tally)
        stop_at = time.perf_counter() + args.duration

        async def worker() -> None:
            while time.perf_counter() < stop_at:
                request = load.pick()
                try:
                    await request()
                except Exception as err:  # a client-side failure must not end the run
                    tally.add(request.__name__, f"client:{type(err).__name__}")

        async def storms() -> None:
            while args.storm_every > 0:
                await asyncio.sleep(args.storm_every)
                if time.perf_counter() >= stop_at:
                    return
                await load.storm(args.storm_size)

        async def sampling() -> None:
            last_print = 0.0
            while True:
                s = await asyncio.to_thread(sampler.take)
                if s.t - last_print >= args.print_every:
                    last_print = s.t
                    print(
                        f"t={s.t:6.1f}s rss={s.rss_mib} MiB image_cache={s.image_cache_mib} MiB "
                        f"kv_pages={s.kv_pages_in_use} done={s.done} unclean={tally.unclean()}",
                        flush=True,
                    )
                await asyncio.sleep(args.sample_every)

        sampler_task = asyncio.create_task(sampling())
        await asyncio.gather(*(worker() for _ in range(args.concurrency)), storms())
        print(f"load stopped; settling for {args.settle:g} s", flush=True)
        await asyncio.sleep(args.settle)
        sampler_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler_task
    sampler.take()


def _metrics_port(log_path: Path) -> int | None:
    match = re.search(r"msg=listening grpc_port=\d+ metrics_port=(\d+)", log_path.read_text())
    return int(match.group(1)) if match else None


def summarize(sampler: Sampler, tally: Tally, args: argparse.Namespace) -> dict[str, Any]:
    rss = [s.rss_mib for s in sampler.samples if s.rss_mib is not None]
    loaded = [s.rss_mib for s in sampler.samples if s.rss_mib is not None and s.t <= args.duration]
    tail = [
        s.rss_mib
        for s in sampler.samples
        if s.rss_mib is not None and s.t >= 0.8 * args.duration and s.t <= args.duration
    ]
    last = sampler.samples[-1]
    return {
        "requests": tally.total(),
        "unclean": tally.unclean(),
        "codes": {kind: dict(c) for kind, c in sorted(tally.codes.items())},
        "rss_mib": {
            "start": rss[0] if rss else None,
            "peak": max(rss) if rss else None,
            "last_fifth_of_load_median": sorted(tail)[len(tail) // 2] if tail else None,
            "end_of_load": loaded[-1] if loaded else None,
            "after_settle": last.rss_mib,
        },
        "image_cache_mib_at_end": last.image_cache_mib,
        "kv_pages_in_use_at_end": last.kv_pages_in_use,
        "kv_pages_total": last.kv_pages_total,
    }


def plot(sampler: Sampler, path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    pts = [(s.t, s.rss_mib, s.image_cache_mib) for s in sampler.samples if s.rss_mib is not None]
    if not pts:
        return False
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot([p[0] for p in pts], [p[1] for p in pts], label="resident memory")
    if all(p[2] is not None for p in pts):
        ax.plot([p[0] for p in pts], [p[2] for p in pts], label="image cache")
    ax.set_xlabel("seconds")
    ax.set_ylabel("MiB")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench.soak",
        description=__doc__.split("\n\n")[0],
        epilog="Flags after -- go to the spawned server (vlm serve).",
    )
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--spawn", action="store_true", help="start vlm serve (tiny model default)")
    where.add_argument("--target", help="host:port of a running server")
    ap.add_argument("--metrics-url", help="its /metrics URL (RSS, image cache, KV pages)")
    ap.add_argument("--duration", type=float, default=150.0, help="seconds of load")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--image-size", default="800x600")
    ap.add_argument("--storm-every", type=float, default=15.0, help="0: no cancel storms")
    ap.add_argument("--storm-size", type=int, default=64)
    ap.add_argument("--sample-every", type=float, default=1.0)
    ap.add_argument("--print-every", type=float, default=10.0)
    ap.add_argument("--settle", type=float, default=10.0, help="idle seconds before the end")
    ap.add_argument("--tag", default="soak", help="file name stem of the outputs")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "cpu_tiny")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv, server_args = split_server_args(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    tally = Tally()
    with contextlib.ExitStack() as stack:
        pid = None
        metrics_url = args.metrics_url
        if args.spawn:
            log_path = args.out / f"{args.tag}_server.log"
            server = stack.enter_context(SpawnedServer(server_args, log_path, quiet=True))
            target, pid = server.target, server.proc.pid if server.proc else None
            port = _metrics_port(log_path)
            metrics_url = metrics_url or (port and f"http://127.0.0.1:{port}/metrics") or None
            print(f"server ready on {target} after {server.startup_s:.1f} s", flush=True)
        else:
            target = args.target
        sampler = Sampler(metrics_url, pid, tally)
        sampler.take()
        asyncio.run(soak(target, args, sampler, tally))
    summary = summarize(sampler, tally, args)
    result = {
        "target": target,
        "spawned": args.spawn,
        "server_args": portable(server_args),
        "settings": portable_settings(args),
        "summary": summary,
        "samples": [s.__dict__ for s in sampler.samples],
    }
    path = args.out / f"{args.tag}.json"
    path.write_text(json.dumps(result, indent=2))
    png = args.out / f"{args.tag}_rss.png"
    plotted = plot(sampler, png, f"soak: {' '.join(server_args) or 'defaults'}")
    print(json.dumps(summary, indent=2))
    print(f"wrote {path}" + (f", {png}" if plotted else ""))
    return 1 if summary["unclean"] else 0


if __name__ == "__main__":
    sys.exit(main())
