"""Fuzzing the request surface: every field of every request message, raw protobuf payloads
and image bytes. The server must answer each input with a clean status (never UNKNOWN or
INTERNAL), stay healthy and keep serving a normal request afterwards.

Quick in CI (a few dozen examples per RPC); ``VLM_FUZZ_EXAMPLES=2000`` runs longer, with
fresh random inputs each run (CI's run is derandomized, so it is repeatable).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from image_pipeline import prepare_image
from tests.support.service_harness import (
    ServerThread,
    engine_of,
    in_process,
    local_config,
    wait_for,
)
from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.client import VisionLanguageClient
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.engine import BatchedEngine
from vlm_server.models.interface import LoadedModel
from vlm_server.rpc.servicer import SERVICE_NAME

_ON_DEMAND = os.environ.get("VLM_FUZZ_EXAMPLES")
FUZZ = settings(
    max_examples=int(_ON_DEMAND or 12),
    deadline=None,
    derandomize=_ON_DEMAND is None,
    suppress_health_check=list(HealthCheck),
)
CALL_TIMEOUT_S = 60.0
# What a well-behaved server may answer to anything; UNKNOWN and INTERNAL are bugs.
CLEAN = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
STREAMING = {"Caption", "Query"}
METHODS = ("Caption", "Query", "Point", "Detect", "Segment", "EncodeImage", "GetModelInfo")


def _encoded(size: tuple[int, int], colour: tuple[int, int, int], fmt: str) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format=fmt)
    return out.getvalue()


VALID_IMAGES = (
    _encoded((32, 24), (200, 30, 30), "PNG"),
    _encoded((1, 1), (0, 0, 0), "PNG"),
    _encoded((48, 64), (20, 160, 90), "JPEG"),
)
KNOWN_ID = prepare_image(VALID_IMAGES[0]).content_hash


def _overwrite(data: bytes, at: int, junk: bytes) -> bytes:
    at %= len(data)
    return data[:at] + junk + data[at + len(junk) :]


image_bytes = st.one_of(
    st.sampled_from(VALID_IMAGES),
    st.binary(max_size=64),
    st.builds(lambda b, n: b[: n % len(b)], st.sampled_from(VALID_IMAGES), st.integers(0, 9999)),
    st.builds(
        _overwrite,
        st.sampled_from(VALID_IMAGES),
        st.integers(0, 10_000),
        st.binary(min_size=1, max_size=8),
    ),
)
image_ids = st.one_of(st.just(KNOWN_ID), st.text(max_size=80))
image = st.one_of(
    st.just({}),
    image_bytes.map(lambda b: {"image_bytes": b}),
    image_ids.map(lambda i: {"image_id": i}),
)
float32 = st.floats(width=32)  # NaN and infinities included
# Small values generate a few tokens; the edges must be refused, not run.
counts = st.one_of(st.integers(-3, 6), st.sampled_from([0, -(2**31), 2**31 - 1, 100_000, 2000]))
seeds = st.integers(-(2**63), 2**63 - 1)


def generation_settings(length_required: bool) -> st.SearchStrategy[pb.GenerationSettings]:
    """Any settings; text tasks always bound their length (the default runs for seconds)."""
    optional: dict[str, st.SearchStrategy[Any]] = {
        "temperature": float32,
        "top_p": float32,
        "max_objects": counts,
        "seed": seeds,
    }
    required = {"max_tokens": counts} if length_required else {}
    if not length_required:
        optional["max_tokens"] = counts
    return st.fixed_dictionaries(required, optional=optional).map(
        lambda d: pb.GenerationSettings(**d)
    )


names = st.text(max_size=24)
requests: dict[str, st.SearchStrategy[Any]] = {
    "Caption": st.builds(
        lambda img, length, s: pb.CaptionRequest(**img, length=length, settings=s),
        image,
        st.integers(-3, 8),  # unknown enum values included
        generation_settings(True),
    ),
    "Query": st.builds(
        lambda img, q, ch, rx, s: pb.QueryRequest(
            **img, question=q, choices=ch, settings=s, **({} if rx is None else {"regex": rx})
        ),
        image,
        st.text(max_size=40),
        st.lists(st.text(max_size=12), max_size=4),
        st.one_of(st.none(), st.text(max_size=16), st.sampled_from(["[0-9]{1,3}", "(yes|no)"])),
        generation_settings(True),
    ),
    "Point": st.builds(
        lambda img, o, s: pb.PointRequest(**img, object=o, settings=s),
        image,
        names,
        generation_settings(False),
    ),
    "Detect": st.builds(
        lambda img, o, s: pb.DetectRequest(**img, object=o, settings=s),
        image,
        names,
        generation_settings(False),
    ),
    "Segment": st.builds(
        lambda img, o, s: pb.SegmentRequest(**img, object=o, settings=s),
        image,
        names,
        generation_settings(True),
    ),
    "EncodeImage": image_bytes.map(lambda b: pb.EncodeImageRequest(image_bytes=b)),
    "GetModelInfo": st.just(pb.GetModelInfoRequest()),
}


def _mutate(data: bytes, at: int, junk: bytes) -> bytes:
    return _overwrite(data, at, junk) if data else junk


payloads = st.one_of(
    st.binary(max_size=200),
    st.sampled_from(METHODS).flatmap(
        lambda m: st.builds(
            _mutate,
            requests[m].map(lambda r: r.SerializeToString()),
            st.integers(0, 1000),
            st.binary(min_size=1, max_size=6),
        )
    ),
)


@pytest.fixture(scope="module")
def server(tiny: LoadedModel) -> Iterator[ServerThread]:
    config = EngineConfig(max_batch_size=8, max_queue=64, kv_budget_bytes=16 << 20)
    with ServerThread(local_config(), in_process(lambda: BatchedEngine(tiny, config))) as running:
        with VisionLanguageClient(running.target, timeout=60) as client:
            assert client.encode_image(VALID_IMAGES[0]).image_id == KNOWN_ID
        yield running


@pytest.fixture(scope="module")
def channel(server: ServerThread) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.target) as ch:
        yield ch


def _send(channel: grpc.Channel, method: str, payload: bytes) -> grpc.StatusCode:
    """Send raw bytes as ``method``'s request; the status it ends with."""
    path = f"/{SERVICE_NAME}/{method}"
    try:
        if method in STREAMING:
            for _ in channel.unary_stream(path)(payload, timeout=CALL_TIMEOUT_S):
                pass
        else:
            channel.unary_unary(path)(payload, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def _check(code: grpc.StatusCode, what: Callable[[], str]) -> None:
    assert code in CLEAN, f"{code.name} for {what()}"


@pytest.mark.parametrize("method", METHODS)
def test_every_request_field_gets_a_clean_status(channel: grpc.Channel, method: str) -> None:
    @FUZZ
    @given(request=requests[method])
    def run(request: Any) -> None:
        _check(_send(channel, method, request.SerializeToString()), lambda: repr(request)[:500])

    run()


@FUZZ
@given(method=st.sampled_from(METHODS), payload=payloads)
def test_raw_protobuf_payloads_get_a_clean_status(
    channel: grpc.Channel, method: str, payload: bytes
) -> None:
    _check(_send(channel, method, payload), lambda: f"{method} {payload!r:.300}")


def test_the_server_is_healthy_and_serves_after_the_fuzzing(server: ServerThread) -> None:
    with grpc.insecure_channel(server.target) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        reply = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with VisionLanguageClient(server.target, timeout=60) as client:
        got = client.caption(VALID_IMAGES[2], max_tokens=3, temperature=0)
    assert got.finish_reason == "length" and got.metrics.output_tokens == 3
    engine = engine_of(server)
    wait_for(engine.idle, what="an idle engine")
    assert engine.stats().queue_depth == 0 and engine.stats().active_sequences == 0
