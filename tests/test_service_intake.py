"""Requests that are not valid protobuf (corrupt wire format, invalid UTF-8 in a string
field) answer INVALID_ARGUMENT naming the field, without an error-level traceback."""

from __future__ import annotations

import logging
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.service_harness import ServerThread, in_process, local_config
from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.client import VisionLanguageClient
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.engine import BatchedEngine
from vlm_server.models.interface import LoadedModel
from vlm_server.rpc.intake import bad_utf8_field

BAD = b"\xff\xfe"


def _with_bad_utf8(message: object, good: bytes) -> bytes:
    """``message`` serialized with the (same-length) string ``good`` replaced by bad bytes."""
    data = message.SerializeToString()  # type: ignore[attr-defined]
    assert data.count(good) == 1 and len(good) == len(BAD)
    return data.replace(good, BAD)


# (method, raw payload, the field the error must name or None when none can be named)
CASES: list[tuple[str, bytes, str | None]] = [
    ("Point", b"\xff\xff\xff", None),
    ("Caption", b"\x0a\x05ab", None),  # a length past the end
    ("Point", _with_bad_utf8(pb.PointRequest(object="zq"), b"zq"), "object"),
    ("Detect", _with_bad_utf8(pb.DetectRequest(image_id="zq", object="car"), b"zq"), "image_id"),
    ("Query", _with_bad_utf8(pb.QueryRequest(question="zq?"), b"zq"), "question"),
    ("Query", _with_bad_utf8(pb.QueryRequest(question="q", choices=["a", "zq"]), b"zq"), "choices"),
    ("Query", _with_bad_utf8(pb.QueryRequest(question="q", regex="zq"), b"zq"), "regex"),
    ("Segment", _with_bad_utf8(pb.SegmentRequest(object="zq"), b"zq"), "object"),
]
STREAMING = {"Caption", "Query"}


@pytest.fixture(scope="module")
def server(tiny: LoadedModel) -> Iterator[ServerThread]:
    with ServerThread(
        local_config(),
        in_process(
            lambda: BatchedEngine(tiny, EngineConfig(max_batch_size=1, kv_budget_bytes=16 << 20))
        ),
    ) as running:
        yield running


@pytest.fixture(scope="module")
def channel(server: ServerThread) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.target) as ch:
        yield ch


def _call(channel: grpc.Channel, method: str, payload: bytes) -> grpc.RpcError:
    path = f"/vlm.v1.VisionLanguage/{method}"
    with pytest.raises(grpc.RpcError) as caught:
        if method in STREAMING:
            list(channel.unary_stream(path)(payload, timeout=30))
        else:
            channel.unary_unary(path)(payload, timeout=30)
    return caught.value


@pytest.mark.parametrize(("method", "payload", "field"), CASES)
def test_unparsable_requests_are_invalid_argument_without_a_traceback(
    channel: grpc.Channel,
    caplog: pytest.LogCaptureFixture,
    method: str,
    payload: bytes,
    field: str | None,
) -> None:
    with caplog.at_level(logging.INFO):
        err = _call(channel, method, payload)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    details = err.details() or ""
    assert "class" not in details and "DecodeError" not in details
    assert f"vlm.v1.{method}Request" in details
    trailing = dict(err.trailing_metadata() or ())
    if field is None:
        assert "vlm-field" not in trailing
    else:
        assert details.startswith(f"{field}: ") and trailing["vlm-field"] == field
        assert "UTF-8" in details
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


def test_rejected_requests_are_counted_and_the_server_keeps_serving(
    server: ServerThread, channel: grpc.Channel
) -> None:
    _call(channel, "Detect", b"\xff")
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    counted = {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "vlm_requests_total"
    }
    assert counted[(("code", "INVALID_ARGUMENT"), ("door", "grpc"), ("task", "detect"))] >= 1
    with VisionLanguageClient(server.target, timeout=60) as client:
        assert client.query(None, "still there?", max_tokens=2, temperature=0).text is not None


def test_bad_utf8_field_names_nested_and_repeated_fields() -> None:
    request = pb.QueryRequest(
        question="fine", choices=["ok", "zq"], settings=pb.GenerationSettings(seed=3)
    )
    data = _with_bad_utf8(request, b"zq")
    assert bad_utf8_field(data, pb.QueryRequest.DESCRIPTOR) == "choices"
    assert bad_utf8_field(request.SerializeToString(), pb.QueryRequest.DESCRIPTOR) is None
    assert bad_utf8_field(b"\x0a\xff", pb.QueryRequest.DESCRIPTOR) is None  # truncated


def test_text_limits_are_the_server_flags(tiny: LoadedModel) -> None:
    """--max-question-chars and --max-object-chars set the limits, and the errors name the
    field and the limit."""
    from vlm_server.client.types import VlmError

    config = local_config(max_question_chars=20, max_object_chars=8)

    def engine() -> BatchedEngine:
        return BatchedEngine(tiny, EngineConfig(max_batch_size=1, kv_budget_bytes=16 << 20))

    with (
        ServerThread(config, in_process(engine)) as running,
        VisionLanguageClient(running.target) as client,
    ):
        assert client.query(None, "q" * 20, max_tokens=1, temperature=0).text is not None
        with pytest.raises(VlmError) as caught:
            client.query(None, "q" * 21, max_tokens=1)
        err = caught.value
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.field == "question"
        assert "at most 20" in err.message
        with pytest.raises(VlmError) as caught:
            client.detect(None, "o" * 9)
        assert caught.value.field == "object" and "at most 8" in caught.value.message


def test_step_intervals_are_exported_as_a_histogram(
    server: ServerThread, channel: grpc.Channel
) -> None:
    """The gaps running streams see, as the server makes them: one observation per committed
    step with decode rows, in cumulative buckets with their sum."""

    def histogram() -> dict[str, float]:
        with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
            text = response.read().decode()
        return {
            (s.name + s.labels.get("le", "")): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name.startswith("vlm_step_interval_seconds")
        }

    before = histogram()
    with VisionLanguageClient(server.target, timeout=60) as client:
        client.query(None, "count to ten", max_tokens=8, temperature=0)
    after = histogram()
    grew = after["vlm_step_interval_seconds_count"] - before["vlm_step_interval_seconds_count"]
    assert grew >= 1  # its decode steps (the first token comes from the prefill step)
    assert after["vlm_step_interval_seconds_sum"] > before["vlm_step_interval_seconds_sum"]
    buckets = [v for k, v in after.items() if k.startswith("vlm_step_interval_seconds_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == after["vlm_step_interval_seconds_count"]
