"""``vlm serve`` in a subprocess on free loopback ports, waited on through gRPC health
readiness and drained with SIGTERM: the server the client-side benchmarks spawn."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
from tqdm import tqdm

from vlm_server.client import AsyncVisionLanguageClient
from vlm_server.client import types as t

SERVICE_NAME = "vlm.v1.VisionLanguage"
REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now on ``host`` (the server binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


async def _health_status(target: str, service: str) -> str:
    """The health status name of ``service`` ("" = liveness), or the failure's status code."""
    try:
        from grpc_health.v1 import health_pb2, health_pb2_grpc
    except ImportError:  # no health package: a served GetModelInfo means ready
        async with AsyncVisionLanguageClient(target, timeout=2) as client:
            try:
                await client.model_info()
                return "SERVING"
            except t.VlmError as err:
                return err.code.name
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        except grpc.RpcError as err:
            return err.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


class SpawnedServer:
    """``vlm serve`` in a subprocess on a free loopback port; a context manager that waits
    for readiness on entry and drains it with SIGTERM on exit."""

    def __init__(
        self,
        server_args: Sequence[str],
        log_path: Path,
        startup_timeout: float = 900.0,
        stop_timeout: float = 60.0,
        quiet: bool = False,
        http: bool = False,
    ) -> None:
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        # The HTTP door only when measured (its default port would clash between servers).
        self.http_port = free_port() if http else 0
        self.http_url = f"http://127.0.0.1:{self.http_port}/v1" if http else None
        self.metrics_port = free_port()  # known, so its loop lag can be scraped
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.log_path = log_path
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.quiet = quiet
        # Our own port flags come last, so they win over anything in server_args.
        self.cmd = [
            sys.executable,
            "-m",
            "vlm_server.cli",
            "serve",
            *server_args,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--metrics-port",
            str(self.metrics_port),
            "--http-port",
            str(self.http_port),
        ]
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_s = float("nan")

    def __enter__(self) -> SpawnedServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        # The server must import this checkout; keep whatever PYTHONPATH the caller set.
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p
        )
        start = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT
            )
        try:
            asyncio.run(self._wait_ready())
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - start
        return self

    async def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        with tqdm(
            desc="waiting for the server",
            leave=False,
            bar_format="{desc}: {elapsed}",
            mininterval=1.0,
            disable=self.quiet,
        ) as bar:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"the server exited with {self.proc.returncode} while "
                        f"starting:\n{self._log_tail()}"
                    )
                if await _health_status(self.target, SERVICE_NAME) == "SERVING":
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"the server was not ready after {self.startup_timeout}"
                        f" s:\n{self._log_tail()}"
                    )
                bar.update(0)
                await asyncio.sleep(0.2)

    def _log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self) -> int | None:
        """SIGTERM (the server drains), then SIGKILL after ``stop_timeout``; the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __exit__(self, *exc: object) -> None:
        self.stop()
