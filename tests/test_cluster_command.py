"""``vlm cluster`` as an operator runs it: a process of its own (Ray, one CPU replica of the tiny
model, the gateway), then SIGTERM while a stream runs: the stream finishes, the process drains
and exits 0. Assertions follow order and outcome; timeouts only keep a broken run from
hanging."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray.serve", reason="the cluster extra (ray[serve]) is not installed")

from image_pipeline import sample_image_bytes
from tests.support import early
from tests.support.cluster_command import KEY, LaunchedCluster
from vlm_server.client import TextResult, VisionLanguageClient
from vlm_server.client.types import VlmError

HANG_GUARD_S = 240.0


def _ready(target: str, cluster: LaunchedCluster) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        assert cluster.proc.poll() is None, "vlm cluster exited while starting"
        try:
            with VisionLanguageClient(target, timeout=5) as client:
                client.model_info()
                return
        except VlmError:
            assert time.monotonic() < deadline, "hang guard: the cluster never served"
            time.sleep(0.5)


def test_sigterm_drains_the_cluster(tiny_dir: Path, tmp_path: Path) -> None:
    # Most often started with the test run: starting takes long (see tests.support.early).
    cluster = early.take(KEY, lambda: LaunchedCluster(tiny_dir, tmp_path))
    proc = cluster.proc
    try:
        port, _, _ = cluster.ports(HANG_GUARD_S)
        target = f"127.0.0.1:{port}"
        _ready(target, cluster)
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
        cluster.stop()
    text = cluster.log_path.read_text()
    assert "draining" in text, text[-2000:]
    with VisionLanguageClient(target, timeout=5) as client, pytest.raises(VlmError):
        client.model_info()
