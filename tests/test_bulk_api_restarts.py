"""The Batch API across restarts of ``vlm serve`` (spawned on the tiny model with a data dir):
a batch killed (SIGKILL) again and again at seeded points of its progress completes with
every line in its output or error file exactly once, and a drain (SIGTERM) mid-batch exits 0
with the batch still in progress, to resume at the next start. Kill points are read off the
batch's results file, never off a clock."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from image_pipeline import sample_image_bytes
from tests.http_support import data_url, post_json
from tests.support.service_harness import wait_for
from tests.support.spawned_server import REPO

openai = pytest.importorskip("openai")

N = 40
CONCURRENCY = 2
LAST_KILL = 25  # lines written at the last kill at most: the batch is far from done then
IMG = data_url(sample_image_bytes())
FLAGS = (
    "--device cpu --dtype fp32 --host 127.0.0.1 --port 0 --metrics-port 0 --http-port -1 "
    f"--engine-process off --batch-concurrency {CONCURRENCY}"
)
CAPTION = {"image_url": IMG, "settings": {"temperature": 0, "max_tokens": 32}}
BAD = {"image_url": IMG, "length": "epic"}  # refused by its route: an error line


def _lines() -> list[dict[str, Any]]:
    body = [BAD if i % 8 == 5 else CAPTION for i in range(N)]
    return [
        {"custom_id": f"r{i:02}", "method": "POST", "url": "/v1/caption", "body": body[i]}
        for i in range(N)
    ]


class Server:
    """``vlm serve`` on the tiny model with ``data_dir``, in a process group of its own."""

    def __init__(self, model: Path, data_dir: Path) -> None:
        cmd = [sys.executable, "-m", "vlm_server.server.main", *FLAGS.split()]
        cmd += ["--model", str(model), "--data-dir", str(data_dir)]
        self.proc = subprocess.Popen(
            cmd,
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            cwd=REPO,
            start_new_session=True,
        )
        self.log: list[str] = []
        self.port = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            found = re.search(r"msg=listening .*http_port=(\d+)", line)
            if found:
                self.port = int(found.group(1))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError("the server exited:\n" + "".join(self.log))
        if not self.port:
            return False
        try:
            with urllib.request.urlopen(self.url.removesuffix("/v1") + "/ready", timeout=5):
                return True
        except OSError:  # refused, 503 (an HTTPError), or slow to answer on a loaded machine
            return False

    def wait_ready(self) -> Server:
        wait_for(self._ready, timeout=120, interval=0.02, what="the server to be ready")
        return self

    def signal(self, sig: signal.Signals) -> int:
        os.killpg(self.proc.pid, sig)
        code = self.proc.wait(timeout=120)
        self._reader.join(10)
        return code

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGKILL)
        assert not any("Traceback" in line for line in self.log), "".join(self.log)


def _written(path: Path) -> int:
    """Whole lines of a results file now."""
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _create(server: Server) -> str:
    with openai.OpenAI(base_url=server.url, api_key="none", max_retries=0) as client:
        lines = "".join(json.dumps(x) + "\n" for x in _lines()).encode()
        source = client.files.create(file=("captions.jsonl", lines), purpose="batch")
        batch = client.batches.create(
            input_file_id=source.id, endpoint="/v1/caption", completion_window="24h"
        )
    return batch.id


def _check_completed(server: Server, batch_id: str, data_dir: Path) -> None:
    """The batch completes with every line exactly once, the answers the route gives."""
    with openai.OpenAI(base_url=server.url, api_key="none", max_retries=0) as client:
        done = wait_for(
            lambda: (
                (b := client.batches.retrieve(batch_id)).status in ("completed", "failed") and b
            ),
            timeout=120,
            what="the batch to complete",
        )
        assert done.status == "completed", done.errors
        output = [
            json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()
        ]
        errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
        input_file = done.input_file_id
    ids = [line["custom_id"] for line in output + errors]
    assert sorted(ids) == [f"r{i:02}" for i in range(N)]  # each exactly once
    assert {line["custom_id"] for line in errors} == {f"r{i:02}" for i in range(N) if i % 8 == 5}
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (N, len(output), len(errors))
    status, direct = post_json(f"{server.url}/caption", CAPTION)
    assert status == 200
    for line in output:
        assert line["response"]["body"]["caption"] == direct["caption"], line["custom_id"]
    for line in errors:
        assert line["response"]["status_code"] == 400
        assert line["response"]["body"]["error"]["field"] == "length"
    # Nothing is left behind: the results file goes right after the finalization's commit.
    wait_for(lambda: not any((data_dir / "results").iterdir()), what="the results file to go")
    kept = sorted(p.name for p in (data_dir / "files").iterdir())
    assert kept == sorted([input_file, done.output_file_id, done.error_file_id])


def _status(data_dir: Path, batch_id: str) -> tuple[str, int, int]:
    with sqlite3.connect(data_dir / "batches.sqlite3") as db:
        query = "SELECT status, completed, failed FROM batches WHERE id = ?"
        (row,) = db.execute(query, (batch_id,)).fetchall()
    return row


def _start(servers: list[Server], tiny_dir: Path, data_dir: Path) -> Server:
    """A new server, listed before it is ready: one that never gets ready is stopped too."""
    servers.append(Server(tiny_dir, data_dir))
    return servers[-1].wait_ready()


def test_a_batch_killed_three_times_then_drained_completes_with_every_line_once(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """SIGKILL at three seeded points, then SIGTERM mid-batch (exit 0, the lines in flight
    end whole, the counts written, the batch still in progress): the next start completes
    it with every line exactly once."""
    rng = random.Random(1729)
    data_dir = tmp_path / "data"
    servers: list[Server] = []
    try:
        _start(servers, tiny_dir, data_dir)
        batch_id = _create(servers[-1])
        results = data_dir / "results" / f"{batch_id}.jsonl"
        for kill in range(4):
            if kill:
                _start(servers, tiny_dir, data_dir)
            # Sometimes at once (the resumed lines just started), else a few lines on.
            target = min(_written(results) + rng.choice([0, 1, 2, 3, 5, 7]), LAST_KILL)
            what = f"{target} results"
            wait_for(lambda t=target: _written(results) >= t, 120, 0.002, what)
            if kill < 3:
                assert servers[-1].signal(signal.SIGKILL) == -signal.SIGKILL
                assert _written(results) < N  # killed mid-batch
                assert _status(data_dir, batch_id)[0] == "in_progress"
                continue
            assert servers[-1].signal(signal.SIGTERM) == 0
            assert any("batch jobs stopped" in line for line in servers[-1].log)
            written = _written(results)
            assert written < N
            assert results.read_bytes().endswith(b"\n")  # the lines in flight ended whole
            status, completed, failed = _status(data_dir, batch_id)
            assert status == "in_progress" and completed + failed == written  # counts written
        _start(servers, tiny_dir, data_dir)
        _check_completed(servers[-1], batch_id, data_dir)
    finally:
        for server in servers:
            server.stop()
