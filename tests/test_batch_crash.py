"""``vlm batch`` killed and run again: a SIGKILL at three points of one batch (each chosen by the
results file's growth, from a seeded draw), then Ctrl-C and SIGTERM, each followed by a run on
the same output. Every custom_id ends up written exactly once, every line whole; an
interrupted run exits 130 with its file whole, and the last run completes with exit 0."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support.batch_files import engine_flags, write_pictures

REPO = Path(__file__).resolve().parents[1]
LINES = 40
KILLS = 3
POLL_S = 0.005
RUN_TIMEOUT_S = 120  # one run (a start and at most 40 tiny lines); a hang fails, never waits


def _whole(out: Path) -> tuple[list[str], bytes]:
    """The custom_ids of the whole lines (each must parse), and what follows the last one."""
    data = out.read_bytes() if out.exists() else b""
    keep = data.rfind(b"\n") + 1
    ids = [json.loads(raw)["custom_id"] for raw in data[:keep].splitlines()]
    return ids, data[keep:]


def _start(cmd: list[str]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # two cores: the test's poll gets one
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,  # a signal for it never reaches the test run
    )


def _stop_after(proc: subprocess.Popen[bytes], out: Path, lines: int, sig: int) -> None:
    """Send ``sig`` once ``out`` holds ``lines`` whole lines (the run must not end first)."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while len(_whole(out)[0]) < lines:
        code = proc.poll()
        assert code is None, f"the run ended ({code}) before line {lines}: {_stderr(proc)}"
        assert time.monotonic() < deadline, "no progress"
        time.sleep(POLL_S)
    proc.send_signal(sig)


def _stderr(proc: subprocess.Popen[bytes]) -> str:
    assert proc.stderr is not None
    return proc.stderr.read().decode(errors="replace")[-2000:]


def _finish(proc: subprocess.Popen[bytes]) -> tuple[int, str]:
    try:
        code = proc.wait(RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return code, _stderr(proc)


def test_killed_and_interrupted_runs_resume_without_a_line_twice(
    tiny_dir: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "photos"
    names = write_pictures(folder, LINES)
    out = tmp_path / "captions.jsonl"
    cmd = [
        sys.executable, "-m", "vlm_server.cli", "batch", "caption", str(folder), "-o", str(out),
        "--max-tokens", "2", "--temperature", "0", "--concurrency", "2",
        *engine_flags(tiny_dir, max_batch_size=2),
    ]  # fmt: skip
    draw = random.Random(20240607)
    for kill in range(KILLS):
        before, _ = _whole(out)
        proc = _start(cmd)
        _stop_after(proc, out, len(before) + draw.randint(1, 3), signal.SIGKILL)
        code, _ = _finish(proc)
        assert code == -signal.SIGKILL, f"kill {kill}: exit {code}"
        ids, _ = _whole(out)  # a torn last line (killed mid-write) is cut by the next run
        assert ids[: len(before)] == before, "a later run changed what was written"
        assert len(ids) == len(set(ids)), f"kill {kill}: a custom_id written twice"
        assert len(ids) < LINES, "the batch ended before the kill"

    for sig in (signal.SIGINT, signal.SIGTERM):
        before, _ = _whole(out)
        proc = _start(cmd)
        _stop_after(proc, out, len(before) + 1, sig)
        code, err = _finish(proc)
        assert code == 130, f"{sig.name}: exit {code}: {err}"
        assert "interrupted: run the same command again" in err
        ids, tail = _whole(out)
        assert tail == b"" and out.read_bytes().endswith(b"\n"), f"{sig.name}: a torn line"
        assert len(ids) == len(set(ids)) and len(before) < len(ids) < LINES

    before, _ = _whole(out)
    proc = _start(cmd)
    code, err = _finish(proc)
    assert code == 0, err
    assert f"{LINES - len(before)} completed, 0 failed, {len(before)} skipped" in err
    ids, tail = _whole(out)
    assert tail == b"" and sorted(ids) == names  # each exactly once, each line whole
    for raw in out.read_bytes().splitlines():
        line = json.loads(raw)
        assert line["error"] is None and line["response"]["status_code"] == 200
