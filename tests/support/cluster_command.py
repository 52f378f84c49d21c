"""``vlm cluster`` as an operator runs it (started early: see `tests.support.early`).

Starting it (Ray, a replica loading the model, the gateway's workers) takes tens of seconds.
Every port is "any free one", read back from the command's log, so that nothing else can
take a port picked for it while it starts.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from tests.support import ray_patience

REPO = Path(__file__).resolve().parents[2]
KEY = "vlm cluster"
SERVING = re.compile(r'msg="cluster serving" .*grpc_port=(\d+) http_port=(\d+) metrics_port=(\d+)')


class LaunchedCluster:
    """A ``vlm cluster`` process (one CPU replica of ``model``), its output in ``log_path``."""

    def __init__(self, model: Path, folder: Path) -> None:
        self.log_path = folder / "cluster.log"
        self._log: IO[str] = self.log_path.open("w")
        cmd = [
            sys.executable, "-m", "vlm_server.cli", "cluster", "--replicas", "1",
            "--gpus-per-replica", "0", "--cpus-per-replica", "0.5", "--gateway-workers", "1",
            "--model", str(model), "--device", "cpu", "--dtype", "fp32", "--grace-period", "60",
            "--host", "127.0.0.1", "--port", "0", "--http-port", "-1", "--metrics-port", "0",
        ]  # fmt: skip
        env = {
            **os.environ,
            **ray_patience.ENV,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        }
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO
        )

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def ports(self, timeout: float) -> tuple[int, int, int]:
        """(gRPC, HTTP, metrics) ports, once the command says it serves them."""
        deadline = time.monotonic() + timeout
        while True:
            found = SERVING.search(self.log())
            if found:
                return int(found.group(1)), int(found.group(2)), int(found.group(3))
            assert self.proc.poll() is None, "vlm cluster exited while starting:\n" + self.log()
            assert time.monotonic() < deadline, "hang guard: vlm cluster never served"
            time.sleep(0.2)

    def stop(self) -> None:
        """Ends the command if it still runs: SIGTERM first, which stops Ray's processes with
        it (a killed command leaves some of them behind), then SIGKILL."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(60)
        self._log.close()
