"""``vlm cluster`` as an operator runs it: a process of its own (Ray, one CPU replica of the tiny
model, the gateway), then SIGTERM while a stream runs: the stream finishes, the process drains
and exits 0. Assertions follow order and outcome; timeouts only keep a broken run from
hanging."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray.serve", reason="the cluster extra (ray[serve]) is not installed")

from image_pipeline import sample_image_bytes
from vlm_server.client import TextResult, VisionLanguageClient
from vlm_server.client.types import VlmError

HANG_GUARD_S = 240.0
REPO = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ready(target: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        assert proc.poll() is None, "vlm cluster exited while starting"
        try:
            with VisionLanguageClient(target, timeout=5) as client:
                client.model_info()
                return
        except VlmError:
            assert time.monotonic() < deadline, "hang guard: the cluster never served"
            time.sleep(0.5)


def test_sigterm_drains_the_cluster(tiny_dir: Path, tmp_path: Path) -> None:
    port, http_port, metrics_port = _free_port(), _free_port(), _free_port()
    log = (tmp_path / "cluster.log").open("w")
    cmd = [
        sys.executable, "-m", "vlm_server.cli", "cluster", "--replicas", "1",
        "--gpus-per-replica", "0", "--cpus-per-replica", "0.5", "--gateway-workers", "1",
        "--model", str(tiny_dir), "--device", "cpu", "--dtype", "fp32", "--grace-period", "60",
        "--host", "127.0.0.1", "--port", str(port), "--http-port", str(http_port),
        "--metrics-port", str(metrics_port),
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    target = f"127.0.0.1:{port}"
    try:
        _ready(target, proc)
        first = threading.Event()
        outcome: list[Any] = []

        def stream() -> None:
            with VisionLanguageClient(target, timeout=HANG_GUARD_S) as client:
                events = client.caption_stream(sample_image_bytes(), "long", max_tokens=300)
                got = [next(events)]
                first.set()
                got.extend(events)
                outcome.append(got[-1])

        streaming = threading.Thread(target=stream)
        streaming.start()
        assert first.wait(HANG_GUARD_S)
        proc.send_signal(signal.SIGTERM)  # to the command alone, as a process manager does
        streaming.join(HANG_GUARD_S)
        assert outcome and isinstance(outcome[0], TextResult), outcome
        assert proc.wait(HANG_GUARD_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(HANG_GUARD_S)
        log.close()
    text = (tmp_path / "cluster.log").read_text()
    assert "draining" in text, text[-2000:]
    with VisionLanguageClient(target, timeout=5) as client, pytest.raises(VlmError):
        client.model_info()
