"""The Ray Serve application: its deployment options, and the config file ``serve`` takes.

`build` is the import path a Serve config file names (``vlm_server.cluster.app:build``), with
``args`` ``{"cluster": {...}, "server": {...}}``: `ClusterConfig` and `ServerConfig` fields by
name. ``vlm cluster`` builds the same application from its flags, and ``vlm cluster
--print-config`` writes that file, so one configuration runs locally and on a Ray cluster.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from vlm_server.cluster.autoscaling import POLICY as AUTOSCALING_POLICY
from vlm_server.cluster.replica import VisionLanguageReplica
from vlm_server.options.cluster import CLUSTER_OPTIONS, ClusterConfig
from vlm_server.options.spec import Option
from vlm_server.options.table import OPTIONS, ServerConfig

APP_NAME = "vlm"
DEPLOYMENT = "VisionLanguage"
ROUTER = "vlm_server.cluster.router:ImageAffinityRouter"
SERVICER = "vlm_server.cluster.proto_names.add_servicer"
# The cluster's doors, not a replica's: its own listen on any port, in plaintext inside the
# cluster (TLS ends at the gateway).
_PROXY_FIELDS = ("host", "port", "http_port", "tls_cert", "tls_key", "tls_client_ca")


def _typed(options: tuple[Option, ...], values: dict[str, Any]) -> dict[str, Any]:
    """Values from a config file: text through the option's parser, lists as tuples."""
    known = {opt.name: opt for opt in options}
    out: dict[str, Any] = {}
    for name, value in values.items():
        if name not in known:
            raise ValueError(f"unknown option {name!r}")
        if isinstance(value, str):
            value = known[name].parse(value)
        elif isinstance(value, list):
            value = tuple(value)
        out[name] = value
    return out


def server_values(config: ServerConfig) -> dict[str, Any]:
    """The replicas' options: every field that differs from its default."""
    defaults = ServerConfig()
    return {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if getattr(config, f.name) != getattr(defaults, f.name) and f.name not in _PROXY_FIELDS
    }


def gpus_per_replica(cluster: ClusterConfig) -> float:
    if cluster.gpus_per_replica >= 0:
        return cluster.gpus_per_replica
    import torch

    return 1.0 if torch.cuda.is_available() else 0.0


def deployment_options(cluster: ClusterConfig, server: ServerConfig) -> dict[str, Any]:
    """Ray Serve's options of the one deployment."""
    options: dict[str, Any] = {
        "max_ongoing_requests": cluster.max_ongoing_requests,
        "ray_actor_options": {
            "num_gpus": gpus_per_replica(cluster),
            "num_cpus": cluster.cpus_per_replica,
        },
        # Ray drains a stopping replica for this long before its __del__ drains the server.
        "graceful_shutdown_timeout_s": server.grace_period + 5.0,
        "graceful_shutdown_wait_loop_s": 0.5,
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 30.0,
        "request_router_config": RequestRouterConfig(
            request_router_class=ROUTER,
            request_router_kwargs={"load_factor": cluster.affinity_load_factor},
        ),
    }
    if cluster.max_replicas:
        options["autoscaling_config"] = {
            "min_replicas": cluster.replicas,
            "max_replicas": cluster.max_replicas,
            "target_ongoing_requests": max(1, cluster.max_ongoing_requests // 4),
            "policy": {"policy_function": AUTOSCALING_POLICY},
        }
    else:
        options["num_replicas"] = cluster.replicas
    return options


def door_host(cluster: ClusterConfig) -> str:
    """Where replicas' own doors listen: reachable from the gateway's node, or loopback when
    only Ray's proxies (on the replica's own actor) call them."""
    if cluster.replica_host != "auto":
        return cluster.replica_host
    return "auto" if cluster.ingress == "gateway" else "127.0.0.1"


def application(cluster: ClusterConfig, server: ServerConfig, app_name: str = APP_NAME) -> Any:
    """The bound application."""
    deployment = serve.deployment(VisionLanguageReplica, name=DEPLOYMENT)
    deployment = deployment.options(**deployment_options(cluster, server))
    return deployment.bind(server_values(server), app_name, door_host(cluster))


def build(args: dict[str, Any]) -> Any:
    """The application of a Serve config file's ``args`` (see the module's doc)."""
    cluster = ClusterConfig(**_typed(CLUSTER_OPTIONS, dict(args.get("cluster") or {})))
    server = ServerConfig(**_typed(OPTIONS, dict(args.get("server") or {})))
    return application(cluster, server, str(args.get("app_name", APP_NAME)))


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, str):
        return str(value)  # a StrEnum as its text
    return value


def serve_config(cluster: ClusterConfig, server: ServerConfig) -> dict[str, Any]:
    """The Serve config file (``serve run`` / ``serve deploy``) of these options."""
    cluster_values = {
        f.name: _plain(getattr(cluster, f.name))
        for f in dataclasses.fields(cluster)
        if f.name != "ray_address" and getattr(cluster, f.name) != f.default
    }
    # Resolved here: the application is built on the head node, which may have no GPU.
    cluster_values["gpus_per_replica"] = gpus_per_replica(cluster)
    doors: dict[str, Any] = {"proxy_location": "Disabled"}  # the gateway: vlm gateway
    if cluster.ingress == "ray":
        doors = {
            "proxy_location": "EveryNode",
            "http_options": {"host": server.host, "port": server.http_port},
            "grpc_options": {"port": server.port, "grpc_servicer_functions": [SERVICER]},
        }
    return {
        **doors,
        "applications": [
            {
                "name": APP_NAME,
                "route_prefix": "/",
                "import_path": "vlm_server.cluster.app:build",
                "args": {
                    "cluster": cluster_values,
                    "server": {k: _plain(v) for k, v in server_values(server).items()},
                },
            }
        ],
    }
