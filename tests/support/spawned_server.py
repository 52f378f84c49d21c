"""The server's command (``python -m vlm_server.server.main``) on the tiny model, in a process
group of its own as a service manager runs it (started early: see `tests.support.early`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def key(engine_process: str) -> tuple[str, str]:
    return ("server command", engine_process)


class SpawnedServer:
    """Its log is ``proc.stderr`` (text), read from the start by the test."""

    def __init__(self, model: Path, engine_process: str) -> None:
        env = {**os.environ, "VLM_GRACE_PERIOD": "60"}  # also checks the environment is read
        cmd = [
            sys.executable, "-m", "vlm_server.server.main", "--model", str(model),
            "--device", "cpu", "--dtype", "fp32", "--host", "127.0.0.1", "--port", "0",
            "--metrics-port", "0", "--http-port", "-1", "--engine-process", engine_process,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd,
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=REPO,
            start_new_session=True,  # a group of its own, to signal as a service manager does
        )

    def stop(self) -> None:
        """Ends the whole group (the server and its engine process) if the server still
        runs."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()
