"""Where each replica's own endpoints are: a small named Ray actor replicas report to.

Readers (the gateway, ``vlm cluster``'s aggregated metrics, the tests, the benchmark) find each
replica's doors and Prometheus endpoint through it. Replicas register again every
`HEARTBEAT_S`; an entry not renewed for `EXPIRY_S` (its replica died) is dropped, and until
then readers skip endpoints that do not answer.
"""

from __future__ import annotations

import time
from typing import Any

import ray

NAMESPACE = "vlm"
HEARTBEAT_S = 5.0
EXPIRY_S = 3 * HEARTBEAT_S


def directory_name(app_name: str) -> str:
    return f"vlm-replicas-{app_name}"


@ray.remote(num_cpus=0)
class ReplicaDirectory:
    """Replica name -> its endpoints (``metrics``: ``host:port``; ``node``)."""

    def __init__(self) -> None:
        self._replicas: dict[str, dict[str, Any]] = {}
        self._seen: dict[str, float] = {}

    def register(self, name: str, info: dict[str, Any]) -> None:
        self._replicas[name] = info
        self._seen[name] = time.monotonic()

    def unregister(self, name: str) -> None:
        self._replicas.pop(name, None)
        self._seen.pop(name, None)

    def replicas(self) -> dict[str, dict[str, Any]]:
        stale = time.monotonic() - EXPIRY_S
        for name in [n for n, seen in self._seen.items() if seen < stale]:
            self.unregister(name)
        return dict(self._replicas)


def directory(app_name: str) -> Any:
    """The application's directory actor, created by whoever asks first; it outlives
    replicas (detached) and ``vlm cluster`` removes it when it stops."""
    return ReplicaDirectory.options(  # type: ignore[attr-defined]
        name=directory_name(app_name),
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
    ).remote()


def metrics_endpoints(app_name: str) -> dict[str, str]:
    """Replica -> its metrics ``host:port`` (needs a connected Ray driver)."""
    entries = ray.get(directory(app_name).replicas.remote())
    return {name: info["metrics"] for name, info in entries.items()}
