"""``vlm cluster``: the server on Ray Serve, one replica per GPU, until SIGTERM or SIGINT;
``vlm gateway``: the doors alone, for an application deployed from a Serve config file.

``vlm cluster`` starts Ray here (or joins ``--ray-address``), deploys the application and waits
for every replica to load, then serves the doors on the server's ports (gRPC ``--port``, HTTP
``--http-port``, on ``--host``): the gateway (``--ingress gateway``, in this process) or Ray
Serve's proxies (``--ingress ray``). On the signal the doors drain (accepted requests finish),
then it deletes the application: each replica drains and stops its server.
``--print-config`` writes the same application as a Serve config file instead.
"""

from __future__ import annotations

import argparse
import asyncio
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


def parse(
    argv: Sequence[str] | None, environ: dict[str, str] | None = None, prog: str = "vlm cluster"
):
    """(cluster options, server options, print_config) of the command line and ``VLM_*``."""
    environ = dict(os.environ) if environ is None else environ
    parser = build_parser(prog)
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
    if cluster.ingress == "ray":
        serve.start(
            proxy_location="EveryNode",
            http_options={"host": server.host, "port": server.http_port},
            grpc_options={"port": server.port, "grpc_servicer_functions": [SERVICER]},
        )
    else:
        serve.start(proxy_location="Disabled")
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
    if server.tls_cert is not None and cluster.ingress == "ray":
        log.error("--ingress ray: Ray Serve's proxies serve plaintext; TLS needs the gateway")
        return 2
    if server.http_port <= 0 and cluster.ingress == "ray":
        log.error("--ingress ray needs an HTTP port (--http-port > 0) for Ray Serve's proxy")
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
    _start(cluster, server)
    # After ray.init, which installs a SIGTERM handler of its own that ends the process at
    # once: the drain must run instead.
    stop = _stop_on_signals()
    if cluster.ingress == "gateway":
        asyncio.run(_gateway(cluster, server, stop))
    else:
        _proxies(cluster, server, stop)
    _stop()
    return 0


def _usable_cpus() -> int | None:
    """The CPUs this process may run on (a container's share, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count()


def _stop_on_signals() -> threading.Event:
    """An event SIGTERM and SIGINT set (the drain starts when it is set)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def _proxies(cluster: ClusterConfig, server: ServerConfig, stop: threading.Event) -> None:
    """Ray Serve's proxies serve the doors; this process serves the aggregated metrics."""
    from vlm_server.cluster.app import APP_NAME
    from vlm_server.cluster.directory import metrics_endpoints
    from vlm_server.cluster.metrics import serve_aggregate

    metrics = serve_aggregate(
        server.metrics_host, server.metrics_port, lambda: metrics_endpoints(APP_NAME)
    )
    _serving(cluster, server, server.port, server.http_port, metrics.server_address[1])
    stop.wait()
    log.info("signal received: draining")
    metrics.shutdown()


async def _gateway(cluster: ClusterConfig, server: ServerConfig, stop: threading.Event) -> None:
    """The gateway's workers and the aggregated metrics until ``stop``; then drain them."""
    from vlm_server.cluster.app import APP_NAME
    from vlm_server.cluster.directory import directory, metrics_endpoints
    from vlm_server.cluster.gateway_workers import GatewayWorkers, WorkerSettings
    from vlm_server.cluster.metrics import serve_aggregate
    from vlm_server.options.cluster import gateway_workers
    from vlm_server.server.ports import port_in_use

    for flag, port in (("--port", server.port), ("--http-port", server.http_port)):
        if port > 0 and port_in_use(server.host, port):
            raise SystemExit(f"cannot listen on {server.host}:{port}: in use ({flag})")
    entry = directory(APP_NAME)

    async def entries() -> dict:
        return await entry.replicas.remote()

    settings = WorkerSettings(
        server.host,
        server.port,
        server.http_port,
        cluster.affinity_load_factor,
        server.max_message_bytes,
        server.max_http_body_bytes,
        miss_cost=cluster.affinity_miss_cost,
        tls_cert=server.tls_cert,
        tls_key=server.tls_key,
        tls_client_ca=server.tls_client_ca,
        log_format=server.log_format,
        log_level=server.log_level,
    )
    workers = GatewayWorkers(entries, settings, gateway_workers(cluster, _usable_cpus()))
    await workers.start()
    metrics = serve_aggregate(
        server.metrics_host,
        server.metrics_port,
        lambda: metrics_endpoints(APP_NAME),
        workers.metrics_text,
    )
    _serving(cluster, server, workers.port, workers.http_port, metrics.server_address[1])
    if server.tls_cert is not None and workers.http_port:
        log.warning(
            "the HTTP door on port %d is plaintext: put it behind a TLS proxy, or turn it off "
            "with --http-port 0",
            workers.http_port,
        )
    await asyncio.to_thread(stop.wait)
    log.info("signal received: draining")
    await workers.stop(server.grace_period)
    metrics.shutdown()


def _serving(
    cluster: ClusterConfig, server: ServerConfig, port: int, http_port: int, metrics_port: int
) -> None:
    log.info(
        "cluster serving",
        extra={
            "fields": {
                "replicas": cluster.replicas,
                "ingress": cluster.ingress,
                "grpc_port": port,
                "http_port": http_port,
                "metrics_port": metrics_port,
            }
        },
    )


def gateway_main(argv: Sequence[str] | None = None) -> int:
    """``vlm gateway``: the doors of an application already deployed on the Ray cluster
    (``serve run`` / ``serve deploy`` of ``vlm cluster --print-config``)."""
    cluster, server, _ = parse(argv, prog="vlm gateway")
    configure_logging(server.log_format, server.log_level)
    import ray

    ray.init(address=cluster.ray_address or "auto", namespace="serve", log_to_driver=False)
    stop = _stop_on_signals()  # after ray.init (see main)
    asyncio.run(_gateway(cluster, server, stop))
    ray.shutdown()
    return 0
