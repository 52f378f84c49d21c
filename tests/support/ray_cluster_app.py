"""The cluster of the Ray tests (`tests.test_cluster_ray`): a local Ray instance, Ray Serve's
gRPC and HTTP proxies, and the application with two CPU replicas of the tiny model, deployed
by a process of its own (run as ``python -m tests.support.ray_cluster_app MODEL READY_FILE``)
that the tests' process joins as a second driver.

Starting it is most of those tests' time, spent waiting on Ray's processes and the replicas
loading: the run starts it early (see `tests.support.early`), and the tests' module takes it
over. The process writes the cluster's address and the proxies' ports to ``READY_FILE`` (JSON)
once the application is ready, then holds the cluster until its standard input closes (the
tests are done, or the test run ended): then it stops Ray.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[2]
KEY = "ray cluster app"
BODY_LIMIT = 2 << 20
API_KEY = "cluster-test-key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RayClusterApp:
    """The process holding the cluster; its output goes to ``folder / "ray_cluster.log"``."""

    def __init__(self, model: Path, folder: Path) -> None:
        self.ready_file = folder / "ray_cluster.json"
        self.log_path = folder / "ray_cluster.log"
        self._log: IO[str] = self.log_path.open("w")
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            # Ray's token authentication (on by default for a local instance) guards its
            # drivers; the tests' process joins by address, which never reads the local
            # token, so this instance runs without it (the doors under test never use it).
            "RAY_AUTH_MODE": "disabled",
        }
        cmd = [sys.executable, "-m", "tests.support.ray_cluster_app", str(model)]
        self.proc = subprocess.Popen(
            [*cmd, str(self.ready_file)],
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
        )

    def ready(self, timeout: float) -> dict[str, Any]:
        """``{"address", "grpc_port", "http_port"}`` once the application is ready."""
        deadline = time.monotonic() + timeout
        while not self.ready_file.exists():
            assert self.proc.poll() is None, (
                "the cluster's process exited while starting:\n" + self.log_path.read_text()
            )
            assert time.monotonic() < deadline, "hang guard: the cluster never became ready"
            time.sleep(0.2)
        return json.loads(self.ready_file.read_text())

    def stop(self) -> None:
        """Closes its standard input (it stops Ray, then exits); kills it if it hangs."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(60)
        self._log.close()


def main(model: str, ready_file: str) -> int:
    import ray
    from ray import serve

    from vlm_server.cluster.app import APP_NAME, SERVICER, application
    from vlm_server.options.cluster import ClusterConfig
    from vlm_server.options.table import ServerConfig

    ray.init(num_cpus=4, include_dashboard=False, namespace="serve", log_to_driver=False)
    try:
        grpc_port, http_port = _free_port(), _free_port()
        serve.start(
            http_options={"host": "127.0.0.1", "port": http_port},
            grpc_options={"port": grpc_port, "grpc_servicer_functions": [SERVICER]},
        )
        server = ServerConfig(
            model=model,
            device="cpu",
            dtype="fp32",
            grace_period=60,
            max_http_body_bytes=BODY_LIMIT,
            api_keys=(API_KEY,),  # checked by each replica's server, as by one server alone
        )
        replicas = ClusterConfig(
            replicas=2, gpus_per_replica=0, cpus_per_replica=0.5, replica_host="127.0.0.1"
        )
        serve.run(application(replicas, server), name=APP_NAME, route_prefix="/")
        ready = {
            "address": ray.get_runtime_context().gcs_address,
            "grpc_port": grpc_port,
            "http_port": http_port,
        }
        partial = Path(ready_file + ".partial")
        partial.write_text(json.dumps(ready))
        partial.rename(ready_file)  # whole, or not there
        sys.stdin.read()  # until the tests' process closes it (or is gone)
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
