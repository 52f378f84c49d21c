"""Gateway workers: N processes serve the gateway's ports together (SO_REUSEPORT: the kernel
spreads connections over them), so the doors are not bound to one Python process's core.

What each worker keeps: its own `Gateway` over its own `ReplicaSet` (the members and each
one's health from its own probes, its own requests in flight, the holders of each key it
knows), its own channels to the replicas, and its routing counts. The parent reads the
replica directory and passes every worker the members each refresh, each with a slot of the
shared loads. Three things keep the workers in agreement:

- the ring: keys hash to the same replica in every worker (one ring over the same names);
- the loads (`shared_loads`): each worker writes its work in flight per replica into memory
  they all map, and routes by the sum, so it sees what every worker has sent;
- the holders: each worker sends the parent, every `SHARE_S`, the keys it sent to a replica
  that did not hold them yet (new pictures and moved ones); the parent hands each worker the
  others' at its next round, so a picture one worker placed or moved is found by all.

Workers report their routing counts back; the parent sums them into the metrics. On stop each
worker drains (accepted calls finish within the grace period) and exits; a worker whose
parent is gone drains and exits too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import signal
import socket
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from vlm_server.cluster.gateway import REFRESH_S, Entries, Gateway, routing_metrics
from vlm_server.cluster.replica_set import DEFAULT_MISS_COST, Placement
from vlm_server.cluster.shared_loads import SharedLoads, SlotTable
from vlm_server.frontend.logs import configure_logging
from vlm_server.rpc.tls import server_credentials

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
# How often workers pass on their placements (and the parent hands them round): a picture
# placed by one worker is known to all within two rounds. Short against a new picture's
# ~20 ms on a GPU; each round is one small message per worker, and none when nothing moved.
SHARE_S = 0.02


@dataclass(frozen=True)
class WorkerSettings:
    """What a worker needs (picklable: workers are spawned)."""

    host: str
    port: int
    http_port: int
    load_factor: float
    max_message_bytes: int
    max_http_body_bytes: int
    refresh_s: float = REFRESH_S
    share_s: float = SHARE_S
    miss_cost: float = DEFAULT_MISS_COST
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    log_format: str = "kv"
    log_level: str = "info"


def free_port(host: str) -> int:
    """A port no one listens on now, for ``0`` ("any port") shared by every worker."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def worker_main(settings: WorkerSettings, conn: Connection, index: int, loads: SharedLoads) -> None:
    """Worker ``index``: serve until the parent says stop (or is gone), then drain."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C for everyone
    configure_logging(settings.log_format, settings.log_level)
    asyncio.run(_serve(settings, conn, index, loads))


async def _serve(
    settings: WorkerSettings, conn: Connection, index: int, loads: SharedLoads
) -> None:
    loop = asyncio.get_running_loop()
    members: dict[str, Any] = {}
    stop = asyncio.Event()
    grace = [30.0]

    async def entries() -> dict[str, Any]:
        return members

    gateway = Gateway(
        entries,
        settings.load_factor,
        settings.max_message_bytes,
        settings.max_http_body_bytes,
        refresh_s=settings.refresh_s,
        miss_cost=settings.miss_cost,
        publish=True,
        shared=loads.row(index),
    )
    credentials = server_credentials(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
    await gateway.start(
        settings.host, settings.port, settings.http_port, reuse_port=True, credentials=credentials
    )
    conn.send(("ready", gateway.port, gateway.http_port))

    def on_message() -> None:
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):  # the parent is gone: drain and exit
            loop.remove_reader(conn.fileno())
            stop.set()
            return
        if kind == "entries":
            members.clear()
            members.update(payload)
        elif kind == "learn":
            gateway.replicas.learn(payload)
        elif kind == "stop":
            grace[0] = float(payload)
            stop.set()

    loop.add_reader(conn.fileno(), on_message)
    loop.add_signal_handler(signal.SIGTERM, stop.set)

    async def report() -> None:
        while True:
            with contextlib.suppress(OSError):
                conn.send(("counts", gateway.counts()))
            await asyncio.sleep(settings.refresh_s)

    async def share() -> None:
        while True:
            await asyncio.sleep(settings.share_s)
            placed = gateway.replicas.placements()
            if placed:
                with contextlib.suppress(OSError):
                    conn.send(("placed", placed))

    reporting = asyncio.create_task(report())
    sharing = asyncio.create_task(share())
    await stop.wait()
    reporting.cancel()
    sharing.cancel()
    await gateway.stop(grace[0])
    with contextlib.suppress(OSError):
        conn.send(("stopped", gateway.counts()))


class GatewayWorkers:
    """The parent's side: spawn, feed and drain the workers."""

    def __init__(self, entries: Entries, settings: WorkerSettings, workers: int) -> None:
        if workers < 1:
            raise ValueError("gateway_workers must be >= 1")
        if settings.port == 0:
            settings = _with(settings, port=free_port(settings.host))
        if settings.http_port == -1:
            settings = _with(settings, http_port=free_port(settings.host))
        self.settings = settings
        self._entries = entries
        self._count = workers
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._counts: list[dict[str, Any]] = []
        self._loads = SharedLoads(workers)
        self._slots = SlotTable(self._loads.slots)
        self._relay = PlacementRelay(workers)
        self._feeding: asyncio.Task[None] | None = None
        self._sharing: asyncio.Task[None] | None = None
        self.port = settings.port
        self.http_port = settings.http_port if settings.http_port > 0 else 0

    async def start(self) -> None:
        """Spawn the workers and wait until each listens; then feed them the directory."""
        context = multiprocessing.get_context("spawn")  # no inherited threads, Ray or grpc
        for index in range(self._count):
            mine, theirs = context.Pipe()
            proc = context.Process(
                target=worker_main,
                args=(self.settings, theirs, index, self._loads),
                name="vlm-gateway",
                daemon=True,
            )
            proc.start()
            theirs.close()
            self._procs.append(proc)
            self._conns.append(mine)
            self._counts.append({"routed": {}, "home_hits": 0, "serving": 0})
        for i, conn in enumerate(self._conns):
            ready = await asyncio.to_thread(conn.poll, START_TIMEOUT_S)
            if not ready:
                await self.stop(0)
                raise RuntimeError(f"gateway worker {i} did not start (its log says why)")
            try:
                conn.recv()
            except EOFError:
                await self.stop(0)
                raise RuntimeError(
                    f"gateway worker {i} exited while starting: is --port {self.port} or "
                    f"--http-port {self.http_port} in use? (its log says why)"
                ) from None
        loop = asyncio.get_running_loop()
        for i, conn in enumerate(self._conns):
            loop.add_reader(conn.fileno(), self._on_counts, i)
        self._feeding = asyncio.create_task(self._feed(), name="gateway-directory")
        self._sharing = asyncio.create_task(self._share(), name="gateway-placements")

    def _on_counts(self, i: int) -> None:
        conn = self._conns[i]
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):  # the worker is gone: its requests are no one's work now
            asyncio.get_running_loop().remove_reader(conn.fileno())
            self._loads.clear(i)
            return
        if kind in ("counts", "stopped"):
            self._counts[i] = payload
        elif kind == "placed":
            self._relay.add(i, payload)

    async def _share(self) -> None:
        while True:
            await asyncio.sleep(self.settings.share_s)
            for conn, batch in zip(self._conns, self._relay.take(), strict=True):
                if batch:
                    with contextlib.suppress(OSError):
                        conn.send(("learn", batch))

    async def _feed(self) -> None:
        while True:
            try:
                entries = dict(await self._entries())
                slots = self._slots.assign(list(entries))
                members = {n: {**e, "slot": slots[n]} for n, e in entries.items()}
                for conn in self._conns:
                    with contextlib.suppress(OSError):
                        conn.send(("entries", members))
            except asyncio.CancelledError:
                raise
            except Exception:  # the directory is briefly away: workers keep what they have
                log.exception("reading the replica directory failed")
            await asyncio.sleep(self.settings.refresh_s)

    def pids(self) -> list[int]:
        """The workers' process ids (a benchmark reads their CPU time)."""
        return [proc.pid for proc in self._procs]

    def metrics_text(self) -> str:
        return routing_metrics(list(self._counts))

    async def stop(self, grace: float) -> None:
        """Drain every worker (``grace`` seconds for accepted calls), then reap them."""
        for task in (self._feeding, self._sharing):
            if task is not None:
                task.cancel()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(("stop", grace))
        for proc in self._procs:
            await asyncio.to_thread(proc.join, grace + 10.0)
            if proc.is_alive():
                log.warning("gateway worker %d did not stop; killing it", proc.pid)
                proc.kill()
                await asyncio.to_thread(proc.join, 10.0)


class PlacementRelay:
    """The parent's round of placements: what each worker sent since the last round, handed
    to every other worker (a worker's own placements it knows already)."""

    def __init__(self, workers: int) -> None:
        self._pending: list[list[Placement]] = [[] for _ in range(workers)]

    def add(self, worker: int, placements: list[Placement]) -> None:
        self._pending[worker].extend(placements)

    def take(self) -> list[list[Placement]]:
        """Per worker, the other workers' placements since the last call."""
        pending, self._pending = self._pending, [[] for _ in self._pending]
        if not any(pending):
            return [[] for _ in pending]
        return [
            [p for j, batch in enumerate(pending) if j != i for p in batch]
            for i in range(len(pending))
        ]


def _with(settings: WorkerSettings, **changes: Any) -> WorkerSettings:
    from dataclasses import replace

    return replace(settings, **changes)
