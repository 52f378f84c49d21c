"""What tools expect of a server: ``/health`` and ``/ready`` over HTTP (matching gRPC health
through loading, serving, draining and failure, and open without an API key), reflection under
``grpc.reflection.v1`` as well as v1alpha, the settings names the official npm client sends
(``maxTokens``), and 400s naming the body for bodies nested too deeply on every JSON route."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from tests.http_support import post_json
from tests.support.service_harness import (
    GatedBatchedEngine,
    ServerThread,
    in_process,
    local_config,
    wait_for,
)
from vlm_server.engine.config import EngineConfig
from vlm_server.models.interface import LoadedModel
from vlm_server.rpc.servicer import SERVICE_NAME

MIB = 1 << 20


def _get(server: ServerThread, path: str) -> tuple[int, dict[str, Any]]:
    assert server.server is not None
    url = f"http://127.0.0.1:{server.server.http_port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _grpc_health(server: ServerThread, service: str) -> int:
    with grpc.insecure_channel(server.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def server(tiny: LoadedModel) -> Iterator[ServerThread]:
    config = EngineConfig(max_batch_size=4, kv_budget_bytes=16 * MIB)
    with ServerThread(
        local_config(http_port=-1), in_process(lambda: GatedBatchedEngine(tiny, config))
    ) as running:
        yield running


def test_health_and_ready_follow_grpc_health_from_loading_to_failure(tiny: LoadedModel) -> None:
    config = EngineConfig(max_batch_size=2, kv_budget_bytes=16 * MIB)
    engine: list[GatedBatchedEngine] = []

    def factory() -> GatedBatchedEngine:
        made = GatedBatchedEngine(tiny, config)
        made.start_gate.clear()  # held while loading
        engine.append(made)
        return made

    server = ServerThread(local_config(http_port=-1), in_process(factory)).start(wait_ready=False)
    try:
        wait_for(lambda: engine, what="the engine factory")
        assert _get(server, "/health") == (200, {"status": "SERVING", "phase": "loading"})
        assert _get(server, "/ready") == (503, {"status": "NOT_SERVING", "phase": "loading"})
        assert _grpc_health(server, SERVICE_NAME) != SERVING
        engine[0].start_gate.set()
        assert server.server is not None
        server.run(server.server.wait_ready())
        assert _get(server, "/ready") == (200, {"status": "SERVING", "phase": "serving"})
        assert _grpc_health(server, SERVICE_NAME) == SERVING
        server.run(server.server.health.failed())  # as when the engine cannot serve
        assert _get(server, "/health")[0] == 503 and _get(server, "/ready")[0] == 503
        assert _grpc_health(server, "") != SERVING
    finally:
        server.stop()


def test_ready_is_503_while_draining_and_health_stays_200(tiny: LoadedModel) -> None:
    config = EngineConfig(max_batch_size=2, kv_budget_bytes=16 * MIB)
    server = ServerThread(
        local_config(http_port=-1), in_process(lambda: GatedBatchedEngine(tiny, config))
    )
    server.start()
    try:
        assert server.server is not None
        server.run(server.server.health.draining())
        assert _get(server, "/ready") == (503, {"status": "NOT_SERVING", "phase": "draining"})
        assert _get(server, "/health") == (200, {"status": "SERVING", "phase": "draining"})
    finally:
        server.stop()


def test_probes_need_no_api_key(tiny: LoadedModel) -> None:
    config = EngineConfig(max_batch_size=2, kv_budget_bytes=16 * MIB)
    with ServerThread(
        local_config(http_port=-1),
        in_process(lambda: GatedBatchedEngine(tiny, config)),
        http_auth=lambda key: key == "secret",
    ) as server:
        assert _get(server, "/health")[0] == 200 and _get(server, "/ready")[0] == 200
        status, _ = post_json(f"{server.http_url}/query", {"question": "q"})
        assert status == 401


def test_openapi_lists_the_probes(server: ServerThread) -> None:
    _, document = _get(server, "/openapi.json")
    assert {"/health", "/ready"} <= set(document["paths"])


@pytest.mark.parametrize("service", ["grpc.reflection.v1", "grpc.reflection.v1alpha"])
def test_reflection_answers_under_v1_and_v1alpha(server: ServerThread, service: str) -> None:
    with grpc.insecure_channel(server.target) as channel:
        call = channel.stream_stream(
            f"/{service}.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME),
            reflection_pb2.ServerReflectionRequest(
                file_containing_symbol="grpc.reflection.v1.ServerReflection"
            ),
        ]
        listing, described, v1 = list(call(iter(requests), timeout=10))
    names = {s.name for s in listing.list_services_response.service}
    assert {SERVICE_NAME, "grpc.reflection.v1.ServerReflection"} <= names
    assert "grpc.reflection.v1alpha.ServerReflection" in names
    assert (
        b"vlm/v1/vision_language.proto"
        in described.file_descriptor_response.file_descriptor_proto[0]
    )
    assert b"grpc.reflection.v1" in v1.file_descriptor_response.file_descriptor_proto[0]


def test_the_npm_clients_max_tokens_is_understood(server: ServerThread) -> None:
    status, answer = post_json(
        f"{server.http_url}/query",
        {"question": "hi", "settings": {"maxTokens": 3, "temperature": 0}},
    )
    assert status == 200 and answer["metrics"]["output_tokens"] <= 3
    assert answer["finish_reason"] in ("stop", "length")
    status, answer = post_json(
        f"{server.http_url}/query",
        {"question": "hi", "settings": {"maxTokens": 3, "max_tokens": 4}},
    )
    assert status == 400 and answer["error"]["field"] == "settings.maxTokens"


@pytest.mark.parametrize("path", ["/query", "/caption", "/chat/completions"])
def test_a_thousand_nested_brackets_are_a_400_naming_the_body(
    server: ServerThread, path: str
) -> None:
    for body in (b"[" * 1000 + b"]" * 1000, b'{"a":' * 1000 + b"1" + b"}" * 1000):
        status, answer = post_json(f"{server.http_url}{path}", body)
        assert status == 400 and answer["error"]["field"] == "body"
        assert "levels" in answer["error"]["message"]
