"""A request's priority at both doors (tiny model, batched engine in process): gRPC's
``settings.priority`` and the top-level ``priority`` of every HTTP engine route and of the chat
route reach the engine; unset, it is 0 (the official clients never send it); out of range or
not an integer, the request is refused naming the field the client sent; and OpenAPI lists it
on every such route."""

from __future__ import annotations

import itertools
import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from image_pipeline import sample_image_bytes
from tests.http_support import data_url, post_json
from tests.support.service_harness import ServerThread, engine_of, in_process, local_config
from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.api.v1 import vision_language_pb2_grpc as pb_grpc
from vlm_server.client import VisionLanguageClient
from vlm_server.engine.api import BATCH_PRIORITY, MAX_PRIORITY, MIN_PRIORITY, GenerationRequest
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.sequence import Sequence
from vlm_server.engine.engine import BatchedEngine
from vlm_server.engine.intake import Route, Ticket
from vlm_server.models.interface import LoadedModel

MIB = 1 << 20
IMG = data_url(sample_image_bytes())
FAST = {"temperature": 0, "max_tokens": 8, "max_objects": 1}  # a segment needs 7 tokens


class RecordingEngine(BatchedEngine):
    """Notes each admitted request's id and priority."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.priorities: dict[str, int] = {}

    def admit(self, request: GenerationRequest, route: Route) -> Ticket[Sequence]:
        self.priorities[request.request_id] = request.priority
        return super().admit(request, route)


@pytest.fixture(scope="module")
def server(tiny: LoadedModel) -> Iterator[ServerThread]:
    config = EngineConfig(max_batch_size=4, max_queue=100, kv_budget_bytes=16 * MIB)
    factory = in_process(lambda: RecordingEngine(tiny, config))
    with ServerThread(local_config(http_port=-1), factory) as running:
        yield running


def _engine(server: ServerThread) -> RecordingEngine:
    engine = engine_of(server)
    assert isinstance(engine, RecordingEngine)
    return engine


# ---- gRPC --------------------------------------------------------------------------------------

_RPCS = {
    "Caption": {},
    "Query": {"question": "what?"},
    "Point": {"object": "cup"},
    "Detect": {"object": "cup"},
    "Segment": {"object": "cup"},
}


_CALLS = itertools.count()


def _grpc(server: ServerThread, rpc: str, settings: pb.GenerationSettings) -> str:
    """Call ``rpc`` to its end; the request id it was given."""
    request = getattr(pb, f"{rpc}Request")(
        image_bytes=sample_image_bytes(), settings=settings, **_RPCS[rpc]
    )
    rid = f"{rpc}-{next(_CALLS)}"
    with grpc.insecure_channel(server.target) as channel:
        call = getattr(pb_grpc.VisionLanguageStub(channel), rpc)
        answer = call(request, metadata=(("x-request-id", rid),))
        if rpc in ("Caption", "Query"):
            list(answer)
    return rid


@pytest.mark.parametrize("rpc", sorted(_RPCS))
def test_grpc_priority_reaches_the_engine(server: ServerThread, rpc: str) -> None:
    seen = _engine(server).priorities
    base = {"temperature": 0, "max_tokens": 8, "max_objects": 1}
    for priority in (MIN_PRIORITY, 3, MAX_PRIORITY):
        rid = _grpc(server, rpc, pb.GenerationSettings(priority=priority, **base))
        assert seen[rid] == priority
    assert seen[_grpc(server, rpc, pb.GenerationSettings(**base))] == 0


@pytest.mark.parametrize("priority", [MIN_PRIORITY - 1, MAX_PRIORITY + 1, -(2**31), 2**31 - 1])
def test_grpc_priority_out_of_range_is_refused_naming_it(
    server: ServerThread, priority: int
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _grpc(server, "Query", pb.GenerationSettings(priority=priority))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert dict(info.value.trailing_metadata())["vlm-field"] == "settings.priority"
    assert f"-10..10, got {priority}" in (info.value.details() or "")


def test_the_project_client_sends_a_priority(server: ServerThread) -> None:
    seen = _engine(server).priorities
    before = len(seen)
    with VisionLanguageClient(server.target) as client:
        client.query(None, "what?", max_tokens=2, priority=BATCH_PRIORITY)
    assert list(seen.values())[before:] == [BATCH_PRIORITY]


# ---- HTTP --------------------------------------------------------------------------------------

_ROUTES = {
    "caption": {"image_url": IMG},
    "query": {"image_url": IMG, "question": "what?"},
    "point": {"image_url": IMG, "object": "cup"},
    "detect": {"image_url": IMG, "object": "cup"},
    "segment": {"image_url": IMG, "object": "cup"},
    "chat/completions": {"messages": [{"role": "user", "content": "what?"}], "max_tokens": 2},
}


def _body(route: str, **extra: Any) -> dict[str, Any]:
    body = dict(_ROUTES[route])
    if route != "chat/completions":
        body["settings"] = FAST
    return {**body, **extra}


def _request_id(route: str, answer: dict[str, Any]) -> str:
    return (
        answer["id"].removeprefix("chatcmpl-")
        if route == "chat/completions"
        else answer["request_id"]
    )


@pytest.mark.parametrize("route", sorted(_ROUTES))
def test_http_priority_reaches_the_engine(server: ServerThread, route: str) -> None:
    seen = _engine(server).priorities
    for priority in (MIN_PRIORITY, 0, 4, MAX_PRIORITY):
        status, answer = post_json(f"{server.http_url}/{route}", _body(route, priority=priority))
        assert status == 200, answer
        assert seen[_request_id(route, answer)] == priority
    status, answer = post_json(f"{server.http_url}/{route}", _body(route))  # as clients send
    assert status == 200 and seen[_request_id(route, answer)] == 0


@pytest.mark.parametrize("route", sorted(_ROUTES))
@pytest.mark.parametrize(
    ("priority", "words"),
    [
        (11, "must be in -10..10, got 11"),
        (-11, "must be in -10..10, got -11"),
        (2**40, "must be in -10..10"),
        ("high", "must be a JSON integer"),
        (1.5, "must be a JSON integer"),
        (True, "must be a JSON integer"),
    ],
)
def test_http_bad_priority_is_refused_naming_it(
    server: ServerThread, route: str, priority: object, words: str
) -> None:
    status, answer = post_json(f"{server.http_url}/{route}", _body(route, priority=priority))
    assert status == 400, answer
    error = answer["error"]
    assert error["field"] == "priority" and error["message"].startswith("priority: ")
    assert words in error["message"]


def test_openapi_lists_the_priority_of_every_engine_route(server: ServerThread) -> None:
    base = server.http_url.removesuffix("/v1")
    with urllib.request.urlopen(f"{base}/openapi.json", timeout=10) as response:
        doc = json.loads(response.read())
    for route in _ROUTES:
        op = doc["paths"][f"/v1/{route}"]["post"]
        schema = op["requestBody"]["content"]["application/json"]["schema"]
        field = schema["properties"]["priority"]
        assert field["type"] == "integer" and "-10 to 10" in field["description"]
