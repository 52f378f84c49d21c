"""``vlm cluster``'s options and the Serve config file it prints, without starting Ray; and
the router's reading of the gRPC proxy's request envelope."""

from __future__ import annotations

import importlib
import json
import pickle

import pytest

pytest.importorskip("ray.serve", reason="the cluster extra (ray[serve]) is not installed")

from ray.serve._private.common import gRPCRequest  # the envelope the proxy pickles
from ray.serve.schema import ServeDeploySchema

from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.cluster import app, autoscaling
from vlm_server.cluster.affinity import bytes_key
from vlm_server.cluster.command import main, parse
from vlm_server.cluster.router import request_message
from vlm_server.options.cluster import ClusterConfig
from vlm_server.options.table import ServerConfig


def test_flags_and_variables_set_cluster_and_server_options() -> None:
    cluster, server, printing = parse(
        ["--replicas", "3", "--max-batch-size", "16", "--print-config"],
        {"VLM_AFFINITY_LOAD_FACTOR": "1.5", "VLM_MAX_QUEUE": "99"},
    )
    assert (cluster.replicas, cluster.affinity_load_factor, printing) == (3, 1.5, True)
    assert (server.max_batch_size, server.max_queue) == (16, 99)
    with pytest.raises(SystemExit):
        parse(["--replicas", "0"], {})
    with pytest.raises(ValueError, match="max_replicas"):
        ClusterConfig(replicas=4, max_replicas=2)
    with pytest.raises(ValueError, match="ingress"):
        ClusterConfig(ingress="nginx")
    assert app.door_host(ClusterConfig()) == "auto"
    assert app.door_host(ClusterConfig(ingress="ray")) == "127.0.0.1"
    assert app.door_host(ClusterConfig(replica_host="10.0.0.7")) == "10.0.0.7"


def test_the_printed_config_builds_the_same_application(capsys: pytest.CaptureFixture) -> None:
    assert main(["--replicas", "2", "--max-batch-size", "8", "--print-config"]) == 0
    config = json.loads(capsys.readouterr().out)
    assert config["proxy_location"] == "Disabled"  # the gateway (vlm gateway) is the door
    args = config["applications"][0]["args"]
    assert args["cluster"].get("ingress", "gateway") == "gateway"
    assert main(["--ingress", "ray", "--print-config"]) == 0
    proxied = json.loads(capsys.readouterr().out)
    assert proxied["grpc_options"]["grpc_servicer_functions"] == [app.SERVICER]
    assert proxied["applications"][0]["args"]["cluster"]["ingress"] == "ray"
    # Both are files serve deploy takes.
    for file in (config, proxied):
        ServeDeploySchema.model_validate(file)
    assert args["cluster"]["replicas"] == 2 and args["server"] == {"max_batch_size": 8}
    assert "port" not in args["server"]  # the proxies' ports are not a replica's
    bound = app.build(args)
    assert bound is not None
    with pytest.raises(ValueError, match="unknown option"):
        app.build({"server": {"no_such_option": 1}})


def test_replicas_serve_plaintext_inside_the_cluster() -> None:
    server = ServerConfig(tls_cert="/c.pem", tls_key="/k.pem", max_batch_size=8)
    assert app.server_values(server) == {"max_batch_size": 8}  # TLS ends at the gateway
    assert main(["--ingress", "ray", "--tls-cert", "/c.pem", "--tls-key", "/k.pem"]) == 2


def test_deployment_options_fixed_or_autoscaled() -> None:
    server = ServerConfig(grace_period=10)
    fixed = app.deployment_options(ClusterConfig(replicas=2, gpus_per_replica=1), server)
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"]["num_gpus"] == 1
    assert fixed["graceful_shutdown_timeout_s"] > server.grace_period
    scaled = app.deployment_options(ClusterConfig(replicas=1, max_replicas=4), server)
    assert scaled["autoscaling_config"]["max_replicas"] == 4 and "num_replicas" not in scaled
    assert scaled["autoscaling_config"]["policy"]["policy_function"] == autoscaling.POLICY


def test_autoscaling_follows_the_replicas_own_in_flight_counts() -> None:
    from types import SimpleNamespace

    def ctx(running: int, held: list[float], target: float = 4.0) -> SimpleNamespace:
        config = SimpleNamespace(get_target_ongoing_requests=lambda: target)
        metrics = {autoscaling.METRIC: {f"r{i}": v for i, v in enumerate(held)}}
        return SimpleNamespace(
            current_num_replicas=running,
            target_num_replicas=running,
            aggregated_metrics=metrics,
            config=config,
        )

    assert autoscaling.in_flight_policy(ctx(2, [8.0, 8.0]))[0] == 4.0  # 16 held, 4 each
    assert autoscaling.in_flight_policy(ctx(2, [0.0, 1.0]))[0] == 0.25  # Ray bounds it
    assert autoscaling.in_flight_policy(ctx(0, []))[0] == 0
    module, name = autoscaling.POLICY.split(":")
    assert getattr(importlib.import_module(module), name) is autoscaling.in_flight_policy


def test_the_router_reads_the_grpc_proxys_envelope() -> None:
    request = pb.QueryRequest(image_bytes=b"\xff\xd8picture", question="q")
    envelope = pickle.dumps(gRPCRequest(user_request_proto=request))
    message = request_message([envelope])
    assert message == request and bytes_key(message.image_bytes) == bytes_key(b"\xff\xd8picture")
    assert request_message([request]) == request  # a handle's call with the message itself
    assert request_message([b"not a pickle"]) is None
    assert request_message([]) is None
