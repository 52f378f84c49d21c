"""The options of ``vlm cluster`` beyond the server's own: how many replicas, where Ray is,
what each replica holds, and how requests are routed to them. Same conventions as the server's
table (``--replicas 2`` or ``VLM_REPLICAS=2``); docs/configuration.md lists them too."""

from __future__ import annotations

import math
from dataclasses import dataclass

from vlm_server.options.spec import Group, option, options_of

G = Group

# Sizing the gateway (docs/deployment.md): one GPU answers about 1,000 repeated-picture
# requests a second (moondream2, query3, H100 or H200), and the gateway is sized to carry
# 1.5 times what its replicas answer. One worker carries about 800 of them a second: a
# worker spends 0.7-1.1 ms of CPU on each (python -m bench.gateway_bench), and
# the one-worker gateway measured 1,488 req/s, four workers 3,266. So ~1.9 workers a GPU.
REPLICA_REQ_S = 1000.0
GATEWAY_HEADROOM = 1.5
WORKER_REQ_S = 800.0
# The workers take at most this share of the CPUs: the replicas' servers (JPEG decodes,
# their doors, the engine's scheduler) need the rest where they share the machine.
GATEWAY_CPU_SHARE = 0.5


@dataclass(frozen=True)
class ClusterConfig:
    """Settings of the Ray Serve application (``vlm cluster``); each field is an option."""

    replicas: int = option(1, G.SERVING, "replicas (one engine each; one per GPU)")
    max_replicas: int = option(
        0,
        G.SERVING,
        "autoscale between --replicas and this many on queued requests (0 = a fixed number)",
    )
    ingress: str = option(
        "gateway",
        G.SERVING,
        "the doors clients call: gateway (this process routes each request straight to a "
        "replica's own doors) or ray (Ray Serve's gRPC and HTTP proxies on every node)",
        choices=("gateway", "ray"),
    )
    gateway_workers: int = option(
        0,
        G.PERFORMANCE,
        "processes serving the gateway's ports together (0 = from the replicas and the CPUs: "
        "about 2 per replica (--max-replicas when set), at most half the CPUs); the workers "
        "share their loads and where pictures went, so a picture's replica does not depend "
        "on the worker",
    )
    replica_host: str = option(
        "auto",
        G.SERVING,
        "address each replica's own doors listen on (auto: the node's address with the "
        "gateway, which must reach them from its node; 127.0.0.1 with Ray's proxies)",
    )
    ray_address: str | None = option(
        None,
        G.SERVING,
        "Ray cluster to join (auto: the one this machine is part of; default: start one here)",
    )
    gpus_per_replica: float = option(
        -1.0, G.PERFORMANCE, "GPUs each replica reserves (-1: 1 where CUDA is present, else 0)"
    )
    cpus_per_replica: float = option(1.0, G.PERFORMANCE, "CPUs each replica reserves")
    max_ongoing_requests: int = option(
        512,
        G.PERFORMANCE,
        "requests a replica takes at once through Ray Serve's proxies; more wait there (the "
        "engine's own queue applies behind it)",
    )
    affinity_load_factor: float = option(
        2.0,
        G.PERFORMANCE,
        "a repeated picture leaves the replica holding its prefix only when that replica's "
        "load is above the least loaded one's by more than (this - 1) x the mean load and "
        "more than --affinity-miss-cost (>= 1)",
    )
    affinity_miss_cost: float = option(
        24.0,
        G.PERFORMANCE,
        "the gateway's estimate of a new picture's work (vision tower and prefill) in units of "
        "a request whose prefix is cached (>= 1); new pictures balance this work",
    )

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("replicas must be >= 1")
        if self.max_replicas and self.max_replicas < self.replicas:
            raise ValueError("max_replicas must be 0 or >= replicas")
        if self.max_ongoing_requests < 1:
            raise ValueError("max_ongoing_requests must be >= 1")
        if self.affinity_load_factor < 1.0:
            raise ValueError("affinity_load_factor must be >= 1")
        if self.affinity_miss_cost < 1.0:
            raise ValueError("affinity_miss_cost must be >= 1")
        if self.gateway_workers < 0:
            raise ValueError("gateway_workers must be >= 0")
        if self.ingress not in ("gateway", "ray"):
            raise ValueError("ingress must be gateway or ray")
        if self.cpus_per_replica < 0:
            raise ValueError("cpus_per_replica must be >= 0")


def gateway_workers(cluster: ClusterConfig, cpus: int | None) -> int:
    """The worker count ``--gateway-workers`` asks for; 0: enough workers to carry
    `GATEWAY_HEADROOM` times what the most replicas answer, within `GATEWAY_CPU_SHARE` of
    ``cpus`` (and at least one)."""
    if cluster.gateway_workers:
        return cluster.gateway_workers
    replicas = max(cluster.replicas, cluster.max_replicas)
    wanted = math.ceil(replicas * REPLICA_REQ_S * GATEWAY_HEADROOM / WORKER_REQ_S)
    return max(1, min(wanted, int((cpus or 1) * GATEWAY_CPU_SHARE)))


CLUSTER_OPTIONS = options_of(ClusterConfig)
