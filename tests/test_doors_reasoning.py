"""Grounded reasoning and spatial references through both doors (tiny model, batched engine):
the official ``moondream`` client's ``reasoning=True`` and ``spatial_refs``, gRPC's reasoning
deltas and result, the OpenAI door's ``reasoning_content``, and refusals naming the field."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import grpc
import pytest
from PIL import Image

from image_pipeline import PreparedImage, prepare_image, sample_image_bytes
from tests.http_support import data_url, events, moondream_client, post, post_json
from tests.support.reference_memo import shared_reference
from tests.support.service_harness import ServerThread, in_process, local_config
from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.api.v1 import vision_language_pb2_grpc as pb_grpc
from vlm_server.client import VisionLanguageClient
from vlm_server.engine.api import GenerationRequest, Task
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.engine import BatchedEngine
from vlm_server.models.interface import LoadedModel
from vlm_server.reference import ReferenceGenerator, SamplingSettings

MIB = 1 << 20
SAMPLED = {"temperature": 1.0, "top_p": 0.3, "seed": 4, "max_tokens": 40}


@pytest.fixture(scope="module")
def server(reasoning_model: LoadedModel) -> Iterator[ServerThread]:
    config = EngineConfig(max_batch_size=8, max_queue=100, kv_budget_bytes=16 * MIB)
    factory = in_process(lambda: BatchedEngine(reasoning_model, config))
    with ServerThread(local_config(http_port=-1), factory) as running:
        yield running


@pytest.fixture(scope="module")
def ref(reasoning_model: LoadedModel) -> ReferenceGenerator:
    return shared_reference(reasoning_model.model, reasoning_model.tokenizer)


@pytest.fixture(scope="module")
def md(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    cache = getattr(pytestconfig, "cache", None)
    where = cache.mkdir("clients") if cache is not None else tmp_path_factory.mktemp("clients")
    return moondream_client(where)


@pytest.fixture(scope="module")
def sent(md: ModuleType, server: ServerThread) -> tuple[Any, Any, PreparedImage]:
    """The official client, the sample picture as it sends it, and as the server prepares it."""
    model = md.vl(endpoint=server.http_url)
    encoded = model.encode_image(Image.open(io.BytesIO(sample_image_bytes())))
    payload = encoded.image_url.split(",", 1)[1]
    return model, encoded, prepare_image(base64.b64decode(payload))


def _settings(values: dict[str, Any]) -> SamplingSettings:
    return SamplingSettings(**values)


def _grounding(want: Any) -> list[dict[str, Any]]:
    return [
        {"start_idx": a, "end_idx": b, "points": [list(p) for p in points]}
        for a, b, points in want.grounding
    ]


def test_official_client_reasoning_equals_the_reference(
    sent: tuple[Any, Any, PreparedImage], ref: ReferenceGenerator
) -> None:
    model, image, prepared = sent
    want = ref.reasoning_query(prepared, "where", _settings(SAMPLED))
    got = model.query(image, "where", reasoning=True, settings=SAMPLED)
    assert got["answer"] == want.answer
    assert got["reasoning"] == {"text": want.reasoning, "grounding": _grounding(want)}
    # Streamed, the client reads only the answer's chunks; reasoning chunks come apart.
    streamed = model.query(image, "where", reasoning=True, stream=True, settings=SAMPLED)
    assert "".join(streamed["answer"]) == want.answer


def test_official_client_spatial_refs_equal_the_reference(
    sent: tuple[Any, Any, PreparedImage], ref: ReferenceGenerator
) -> None:
    model, image, prepared = sent
    refs = [[0.25, 0.75], [0.1, 0.2, 0.6, 0.9]]
    as_tuples = tuple(tuple(r) for r in refs)
    greedy = {"temperature": 0, "max_tokens": 8}
    got = model.query(image, "what is here", spatial_refs=refs, settings=greedy)["answer"]
    req = GenerationRequest(
        Task.QUERY,
        prepared,
        question="what is here",
        temperature=0,
        max_tokens=8,
        spatial_refs=as_tuples,
    )
    _, _, out = ref.run(req)
    assert got == ref.tokenizer.decode(out)
    points = model.point(image, "car", spatial_refs=refs, settings={"max_objects": 3})["points"]
    req = GenerationRequest(
        Task.POINT, prepared, object_name="car", max_objects=3, spatial_refs=as_tuples
    )
    built, _, _ = ref.run(req)
    assert points == [{"x": x, "y": y} for x, y in built.grammar.objects]


def test_http_stream_marks_reasoning_chunks(
    server: ServerThread, sent: tuple[Any, Any, PreparedImage], ref: ReferenceGenerator
) -> None:
    _, image, prepared = sent
    want = ref.reasoning_query(prepared, "where", _settings(SAMPLED))
    body = {
        "image_url": image.image_url,
        "question": "where",
        "reasoning": True,
        "stream": True,
        "settings": SAMPLED,
    }
    status, _, raw = post(f"{server.http_url}/query", body)
    assert status == 200
    got = events(raw)
    thought = "".join(e.get("reasoning_chunk", "") for e in got)
    answer = "".join(e.get("chunk", "") for e in got)
    assert thought == want.reasoning and answer == want.answer
    assert got[-1]["completed"] and got[-1]["reasoning"]["text"] == want.reasoning
    # Every reasoning chunk comes before the first answer chunk.
    kinds = [
        "r" if "reasoning_chunk" in e else "a"
        for e in got
        if e.get("chunk") or "reasoning_chunk" in e
    ]
    assert kinds == sorted(kinds, reverse=True)


@pytest.mark.parametrize(
    ("refs", "words"),
    [
        ([[1.5, 0.2]], "normalized"),
        ([[0.5, 0.5, 0.2]], "a point [x, y] or a box"),
        ([[0.6, 0.2, 0.1, 0.9]], "ordered"),
        ([[0.5, 0.5]] * 9, "at most 8"),
    ],
)
def test_bad_spatial_refs_are_refused_naming_the_field(
    server: ServerThread, refs: list[list[float]], words: str
) -> None:
    body = {"image_url": data_url(sample_image_bytes()), "question": "q", "spatial_refs": refs}
    status, answer = post_json(f"{server.http_url}/query", body)
    assert status == 400
    error = answer["error"]
    assert error["field"] == "spatial_refs" and words in error["message"]


def test_grpc_query_streams_reasoning_then_the_answer(
    server: ServerThread, ref: ReferenceGenerator
) -> None:
    prepared = prepare_image(sample_image_bytes())
    want = ref.reasoning_query(prepared, "where", _settings(SAMPLED))
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.VisionLanguageStub(channel)
        request = pb.QueryRequest(
            image_bytes=sample_image_bytes(),
            question="where",
            reasoning=True,
            settings=pb.GenerationSettings(**SAMPLED),
        )
        messages = list(stub.Query(request))
        deltas = [m.delta for m in messages if m.HasField("delta")]
        result = messages[-1].result
        assert "".join(d.text for d in deltas if d.reasoning) == want.reasoning
        assert "".join(d.text for d in deltas if not d.reasoning) == want.answer
        flags = [d.reasoning for d in deltas]
        assert flags == sorted(flags, reverse=True)
        assert result.text == want.answer and result.reasoning.text == want.reasoning
        got = [
            (g.start_idx, g.end_idx, [(p.x_norm, p.y_norm) for p in g.points])
            for g in result.reasoning.grounding
        ]
        assert got == want.grounding
        bad = pb.DetectRequest(
            image_bytes=sample_image_bytes(),
            object="car",
            spatial_refs=[pb.SpatialRef()],
        )
        with pytest.raises(grpc.RpcError) as info:
            stub.Detect(bad)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert dict(info.value.trailing_metadata())["vlm-field"] == "spatial_refs"
        info_response = stub.GetModelInfo(pb.GetModelInfoRequest())
        assert info_response.limits.max_spatial_refs == 8


def test_openai_door_returns_reasoning_content(
    server: ServerThread, ref: ReferenceGenerator
) -> None:
    prepared = prepare_image(sample_image_bytes())
    want = ref.reasoning_query(prepared, "where", _settings(SAMPLED))
    content = [
        {"type": "text", "text": "where"},
        {"type": "image_url", "image_url": {"url": data_url(sample_image_bytes())}},
    ]
    body = {
        "model": "any",
        "messages": [{"role": "user", "content": content}],
        "reasoning": True,
        "temperature": 1.0,
        "top_p": 0.3,
        "seed": 4,
        "max_tokens": 40,
    }
    status, answer = post_json(f"{server.http_url}/chat/completions", body)
    assert status == 200
    message = answer["choices"][0]["message"]
    assert message["reasoning_content"] == want.reasoning and message["content"] == want.answer
    body = {**body, "reasoning": None, "reasoning_effort": "high", "stream": True}
    status, _, raw = post(f"{server.http_url}/chat/completions", body)
    deltas = [e["choices"][0]["delta"] for e in events(raw)[:-1] if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == want.reasoning
    assert "".join(d.get("content", "") for d in deltas) == want.answer
    status, answer = post_json(
        f"{server.http_url}/chat/completions", {**body, "reasoning": False, "stream": False}
    )
    assert status == 400 and answer["error"]["param"] == "reasoning_effort"


def test_the_project_client_speaks_reasoning_and_spatial_refs(
    server: ServerThread, ref: ReferenceGenerator
) -> None:
    prepared = prepare_image(sample_image_bytes())
    want = ref.reasoning_query(prepared, "where", _settings(SAMPLED))
    with VisionLanguageClient(server.target) as client:
        events_seen = list(
            client.query_stream(sample_image_bytes(), "where", reasoning=True, **SAMPLED)
        )
        result = events_seen[-1]
        assert result.reasoning is not None and result.reasoning.text == want.reasoning
        assert result.text == want.answer
        thought = "".join(e.text for e in events_seen[:-1] if e.reasoning)
        assert thought == want.reasoning
        spans = [
            (g.start_idx, g.end_idx, [(p.x, p.y) for p in g.points])
            for g in result.reasoning.grounding
        ]
        assert spans == want.grounding
        refs = [[0.25, 0.75], [0.1, 0.2, 0.6, 0.9]]
        got = client.point(sample_image_bytes(), "car", spatial_refs=refs, max_objects=3)
        req = GenerationRequest(
            Task.POINT,
            prepared,
            object_name="car",
            max_objects=3,
            spatial_refs=tuple(tuple(r) for r in refs),
        )
        built, _, _ = ref.run(req)
        assert [(p.x, p.y) for p in got.points] == list(built.grammar.objects)
        with pytest.raises(ValueError):
            client.point(sample_image_bytes(), "car", spatial_refs=[[0.1, 0.2, 0.3]])


# Greedy with a budget the sample picture's reasoning spends whole: the reference then answers
# with a budget of its own, and so does every door.
SPENT = {"temperature": 0, "max_tokens": 5}


def _spent(ref: ReferenceGenerator, prepared: PreparedImage) -> Any:
    want = ref.reasoning_query(prepared, "where", _settings(SPENT))
    assert len(want.reasoning_ids) == SPENT["max_tokens"] and want.answer_ids
    return want


def test_each_phase_gets_max_tokens_over_http(
    server: ServerThread, sent: tuple[Any, Any, PreparedImage], ref: ReferenceGenerator
) -> None:
    """The official client (unary and streamed), the npm client's camelCase settings, and
    the metrics, which count both phases and the reasoning's apart."""
    model, image, prepared = sent
    want = _spent(ref, prepared)
    got = model.query(image, "where", reasoning=True, settings=SPENT)
    assert got["answer"] == want.answer != ""
    assert got["reasoning"]["text"] == want.reasoning
    streamed = model.query(image, "where", reasoning=True, stream=True, settings=SPENT)
    assert "".join(streamed["answer"]) == want.answer
    body = {
        "image_url": image.image_url,
        "question": "where",
        "reasoning": True,
        "settings": {"temperature": 0, "maxTokens": 5},
    }
    status, answer = post_json(f"{server.http_url}/query", body)
    assert status == 200 and answer["answer"] == want.answer
    m = answer["metrics"]
    assert m["reasoning_tokens"] == 5 and m["output_tokens"] == 5 + len(want.answer_ids)
    status, _, raw = post(f"{server.http_url}/query", {**body, "stream": True})
    got_events = events(raw)
    kinds = [
        "r" if "reasoning_chunk" in e else "a"
        for e in got_events
        if e.get("chunk") or e.get("reasoning_chunk")
    ]
    assert kinds == sorted(kinds, reverse=True) and "a" in kinds and "r" in kinds
    assert "".join(e.get("chunk", "") for e in got_events) == want.answer
    assert got_events[-1]["metrics"]["reasoning_tokens"] == 5


def test_each_phase_gets_max_tokens_over_grpc(
    server: ServerThread, ref: ReferenceGenerator
) -> None:
    want = _spent(ref, prepare_image(sample_image_bytes()))
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.VisionLanguageStub(channel)
        request = pb.QueryRequest(
            image_bytes=sample_image_bytes(),
            question="where",
            reasoning=True,
            settings=pb.GenerationSettings(**SPENT),
        )
        messages = list(stub.Query(request))
    deltas = [m.delta for m in messages if m.HasField("delta")]
    flags = [d.reasoning for d in deltas]
    assert flags == sorted(flags, reverse=True) and True in flags and False in flags
    result = messages[-1].result
    assert result.text == want.answer and result.reasoning.text == want.reasoning
    assert result.metrics.reasoning_tokens == 5
    assert result.metrics.output_tokens == 5 + len(want.answer_ids)
    with VisionLanguageClient(server.target) as client:
        unary = client.query(sample_image_bytes(), "where", reasoning=True, **SPENT)
    assert unary.text == want.answer and unary.metrics.reasoning_tokens == 5


def test_each_phase_gets_max_tokens_over_the_openai_client(
    server: ServerThread, ref: ReferenceGenerator
) -> None:
    """``reasoning_content`` and the answer follow the reference's budgets, unary and
    streamed; usage counts both phases, the reasoning's in completion_tokens_details."""
    openai = pytest.importorskip("openai")
    want = _spent(ref, prepare_image(sample_image_bytes()))
    content = [
        {"type": "text", "text": "where"},
        {"type": "image_url", "image_url": {"url": data_url(sample_image_bytes())}},
    ]
    ask: dict[str, Any] = {
        "model": "moondream",
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 5,
        "extra_body": {"reasoning": True},
    }
    with openai.OpenAI(base_url=server.http_url, api_key="unused", max_retries=0) as client:
        got = client.chat.completions.create(**ask)
        message = got.choices[0].message
        assert message.content == want.answer != ""
        assert (message.model_extra or {})["reasoning_content"] == want.reasoning
        assert got.usage is not None and got.usage.completion_tokens == 5 + len(want.answer_ids)
        details = got.usage.completion_tokens_details
        assert details is not None and details.reasoning_tokens == 5
        chunks = list(
            client.chat.completions.create(
                **ask, stream=True, stream_options={"include_usage": True}
            )
        )
    kinds, thought, answer = [], [], []
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        extra = (delta.model_extra or {}).get("reasoning_content")
        if extra:
            kinds.append("r")
            thought.append(extra)
        if delta.content:
            kinds.append("a")
            answer.append(delta.content)
    assert kinds == sorted(kinds, reverse=True)
    assert "".join(thought) == want.reasoning and "".join(answer) == want.answer
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens_details.reasoning_tokens == 5
