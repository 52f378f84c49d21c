"""``vlm cluster``: the server on Ray Serve, one replica per GPU, until SIGTERM or SIGINT.

Starts Ray here (or joins ``--ray-address``), starts Ray Serve's proxies on the server's ports
(gRPC ``--port``, HTTP ``--http-port``, on ``--host``), deploys the application and waits for
every replica to load. On the signal it deletes the application: Ray stops routing to the
replicas, lets their requests finish, then each replica drains and stops its server.
``--print-config`` writes the same application as a Serve config file instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence

from vlm_server.frontend.logs import configure_logging
from vlm_server.options.cluster import CLUSTER_OPTIONS, ClusterConfig
from vlm_server.options.command_line import add_options, build_parser, config_from
from vlm_server.options.table import ServerConfig

log = logging.getLogger("vlm_server.cluster")
_LOOPBACK = ("127.0.0.1", "::1", "localhost")


def parse(argv: Sequence[str] | None, environ: dict[str, str] | None = None):
    """(cluster options, server options, print_config) of the command line and ``VLM_*``."""
    environ = dict(os.environ) if environ is None else environ
    parser = build_parser("vlm cluster")
    section = parser.add_argument_group("Cluster", "Replicas on Ray Serve.")
    add_options(section, CLUSTER_OPTIONS)
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the Serve config file (JSON, which is YAML: serve run and serve deploy "
        "take it) and exit",
    )
    args = parser.parse_args(argv)
    server = config_from(parser, args, environ)
    cluster = config_from_cluster(parser, args, environ)
    return cluster, server, args.print_config


def config_from_cluster(
    parser: argparse.ArgumentParser, args: argparse.Namespace, environ: dict[str, str]
) -> ClusterConfig:
    values = {}
    for opt in CLUSTER_OPTIONS:
        value = getattr(args, opt.name)
        if value is None and opt.env in environ:
            try:
                value = opt.parse(environ[opt.env])
            except ValueError as err:
                parser.error(f"{opt.env}: {err}")
        if value is not None:
            values[opt.name] = value
    try:
        return ClusterConfig(**values)
    except ValueError as err:
        parser.error(str(err))


def _start(cluster: ClusterConfig, server: ServerConfig) -> None:
    import ray
    from ray import serve

    from vlm_server.cluster.app import APP_NAME, SERVICER, application

    # Ray's gRPC proxy buffers whole messages (2 GiB by default): no more than a replica takes.
    # Read by the proxies this process starts; on a Ray cluster, set it on every node.
    os.environ.setdefault("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE", str(server.max_message_bytes))
    ray.init(address=cluster.ray_address, namespace="serve", log_to_driver=True)
    serve.start(
        proxy_location="EveryNode",
        http_options={"host": server.host, "port": server.http_port},
        grpc_options={"port": server.port, "grpc_servicer_functions": [SERVICER]},
    )
    serve.run(application(cluster, server), name=APP_NAME, route_prefix="/")


def _stop() -> None:
    import ray
    from ray import serve

    from vlm_server.cluster.app import APP_NAME
    from vlm_server.cluster.directory import NAMESPACE, directory_name

    serve.delete(APP_NAME)  # graceful: Ray drains, then each replica drains its server
    with contextlib.suppress(ValueError):
        ray.kill(ray.get_actor(directory_name(APP_NAME), namespace=NAMESPACE))
    serve.shutdown()
    ray.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    cluster, server, print_config = parse(argv)
    configure_logging(server.log_format, server.log_level)
    if server.http_port <= 0:
        log.error("vlm cluster needs an HTTP port (--http-port > 0) for Ray Serve's proxy")
        return 2
    if print_config:
        from vlm_server.cluster.app import serve_config

        json.dump(serve_config(cluster, server), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    if not (server.api_keys or server.api_keys_file) and server.host not in _LOOPBACK:
        log.warning(
            "no API keys: anyone who can reach %s:%d may call (see --api-keys-file)",
            server.host,
            server.port,
        )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    _start(cluster, server)
    from vlm_server.cluster.app import APP_NAME
    from vlm_server.cluster.directory import metrics_endpoints
    from vlm_server.cluster.metrics import serve_aggregate

    metrics = serve_aggregate(
        server.metrics_host, server.metrics_port, lambda: metrics_endpoints(APP_NAME)
    )
    log.info(
        "cluster serving",
        extra={
            "fields": {
                "replicas": cluster.replicas,
                "grpc_port": server.port,
                "http_port": server.http_port,
                "metrics_port": metrics.server_address[1],
            }
        },
    )
    stop.wait()
    log.info("signal received: draining")
    metrics.shutdown()
    _stop()
    return 0
