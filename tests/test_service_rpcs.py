"""Every RPC end to end on real loopback servers (tiny model): the batched engine (the
server's default) and the same engine one request at a time, blocking. Results are compared
with the reference generation; every input error is checked for its status code and field.
Segment and constrained queries are checked for well-formed answers equal to the reference
generation."""

from __future__ import annotations

import io
import re
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from PIL import Image

from image_pipeline import PreparedImage, sample_image_bytes
from tests.support.service_harness import ServerThread, in_process, local_config
from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.api.v1 import vision_language_pb2_grpc as pb_grpc
from vlm_server.client import EncodedImage, TextResult, VisionLanguageClient, VlmError
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.engine import BatchedEngine
from vlm_server.models.interface import LoadedModel
from vlm_server.reference import ReferenceGenerator, SamplingSettings

GREEDY = {"temperature": 0.0}
MIB = 1 << 20
BATCH = 8
# (pipeline depth, max batch size) each engine reports in GetModelInfo.
SHAPES = {"single": (1, 1), "batched": (2, BATCH)}


@pytest.fixture(scope="module")
def single_server(tiny: LoadedModel) -> Iterator[ServerThread]:
    """One request at a time, blocking: what ``--engine reference`` serves."""
    config = EngineConfig(
        max_batch_size=1, pipeline_depth=1, max_queue=100, kv_budget_bytes=16 * MIB
    )
    with ServerThread(local_config(), in_process(lambda: BatchedEngine(tiny, config))) as running:
        yield running


@pytest.fixture(scope="module")
def batched_server(tiny: LoadedModel) -> Iterator[ServerThread]:
    config = EngineConfig(max_batch_size=BATCH, max_queue=100, kv_budget_bytes=16 * MIB)
    with ServerThread(local_config(), in_process(lambda: BatchedEngine(tiny, config))) as running:
        yield running


@pytest.fixture(scope="module", params=["batched", "single"])
def engine_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def server(engine_kind: str, request: pytest.FixtureRequest) -> ServerThread:
    """The server of the engine this test runs on (each engine's server starts once)."""
    running = request.getfixturevalue(f"{engine_kind}_server")
    assert isinstance(running, ServerThread)
    return running


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[VisionLanguageClient]:
    with VisionLanguageClient(server.target, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def stub(server: ServerThread) -> Iterator[pb_grpc.VisionLanguageStub]:
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.VisionLanguageStub(channel)


@pytest.fixture(scope="module")
def uploaded(client: VisionLanguageClient) -> EncodedImage:
    return client.encode_image(sample_image_bytes())


@pytest.fixture(scope="module")
def batched_client(batched_server: ServerThread) -> Iterator[VisionLanguageClient]:
    with VisionLanguageClient(batched_server.target, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def single_client(single_server: ServerThread) -> Iterator[VisionLanguageClient]:
    with VisionLanguageClient(single_server.target, timeout=60) as c:
        yield c


def _greedy(max_tokens: int) -> SamplingSettings:
    return SamplingSettings(temperature=0.0, max_tokens=max_tokens)


# ---- results ------------------------------------------------------------------------------


def test_caption_streams_deltas_then_one_final_result(
    stub: pb_grpc.VisionLanguageStub, generator: ReferenceGenerator, sample_image: PreparedImage
) -> None:
    request = pb.CaptionRequest(
        image_bytes=sample_image_bytes(),
        length=pb.CAPTION_LENGTH_NORMAL,
        settings=pb.GenerationSettings(temperature=0, max_tokens=12),
    )
    messages = list(stub.Caption(request, timeout=60))
    kinds = [m.WhichOneof("event") for m in messages]
    assert kinds[-1] == "result" and kinds.count("result") == 1
    assert set(kinds[:-1]) == {"delta"}
    want = generator.caption(sample_image, "normal", _greedy(12))
    result = messages[-1].result
    assert "".join(m.delta.text for m in messages[:-1]) == result.text == want.text
    assert result.finish_reason == pb.FINISH_REASON_LENGTH
    m = result.metrics
    assert m.output_tokens == len(want.token_ids) == 12
    assert m.prefill_ms > 0 and 0 < m.time_to_first_token_ms <= m.total_ms
    assert m.queue_wait_ms >= 0 and m.decode_ms > 0


def test_metrics_split_the_servers_intake_and_the_image_prefix_wait(
    stub: pb_grpc.VisionLanguageStub,
) -> None:
    """A new picture: the server's intake (checks, decode) and the wait for its image prefix
    are reported; the same picture again reuses the prefix and waits for none."""
    rng = Image.effect_noise((96, 72), 64).convert("RGB")
    buf = io.BytesIO()
    rng.save(buf, format="PNG")
    request = pb.QueryRequest(
        image_bytes=buf.getvalue(),
        question="what is it?",
        settings=pb.GenerationSettings(temperature=0, max_tokens=2),
    )
    first, again = (list(stub.Query(request, timeout=60))[-1].result.metrics for _ in range(2))
    assert 0 < first.intake_ms < first.total_ms
    assert first.prefix_wait_ms > 0 and first.cached_tokens == 0
    assert again.prefix_wait_ms == 0 and again.cached_tokens > 0
    assert 0 < again.intake_ms < again.total_ms


@pytest.mark.parametrize("length", ["short", "long"])
def test_caption_lengths_equal_the_reference(
    client: VisionLanguageClient,
    generator: ReferenceGenerator,
    sample_image: PreparedImage,
    uploaded: EncodedImage,
    length: str,
) -> None:
    got = client.caption(uploaded, length, max_tokens=6, **GREEDY)
    want = generator.caption(sample_image, length, _greedy(6))
    assert (got.text, got.finish_reason) == (want.text, want.finish_reason)


def test_query_with_an_uploaded_image_equals_the_reference(
    client: VisionLanguageClient,
    generator: ReferenceGenerator,
    sample_image: PreparedImage,
    uploaded: EncodedImage,
) -> None:
    got = client.query(uploaded, "what is in the picture?", max_tokens=10, **GREEDY)
    want = generator.query(sample_image, "what is in the picture?", _greedy(10))
    assert (got.text, got.finish_reason) == (want.text, want.finish_reason)


def test_query_without_an_image_streams_the_reference_text(
    client: VisionLanguageClient, generator: ReferenceGenerator
) -> None:
    events = list(client.query_stream(None, "tell me a story", max_tokens=16, **GREEDY))
    want = generator.query(None, "tell me a story", _greedy(16))
    final = events[-1]
    assert "".join(e.text for e in events[:-1]) == final.text == want.text
    assert final.finish_reason == want.finish_reason


def test_sampled_query_is_reproducible_with_its_seed(
    client: VisionLanguageClient, generator: ReferenceGenerator
) -> None:
    settings = {"temperature": 1.0, "top_p": 0.9, "max_tokens": 10, "seed": 1234}
    got = client.query(None, "name a colour", **settings)
    want = generator.query(None, "name a colour", SamplingSettings(**settings))
    assert got.text == want.text


def test_point_and_detect_equal_the_reference(
    client: VisionLanguageClient,
    generator: ReferenceGenerator,
    sample_image: PreparedImage,
    uploaded: EncodedImage,
) -> None:
    points = client.point(sample_image_bytes(), "ball", max_objects=4)
    want_points = generator.point(sample_image, "ball", max_objects=4)
    assert [(p.x, p.y) for p in points.points] == [(p.x, p.y) for p in want_points.points]
    assert points.finish_reason == want_points.finish_reason
    boxes = client.detect(uploaded, "house", max_objects=4)
    want_boxes = generator.detect(sample_image, "house", max_objects=4)
    assert [(b.x_min, b.y_min, b.x_max, b.y_max) for b in boxes.boxes] == [
        (b.x_min, b.y_min, b.x_max, b.y_max) for b in want_boxes.boxes
    ]
    assert boxes.finish_reason == want_boxes.finish_reason


def _input_tokens_against_the_reference(
    client: VisionLanguageClient, generator: ReferenceGenerator, sample_image: PreparedImage
) -> None:
    """``metrics.input_tokens`` counts prompt tokens, image positions not (the proto's
    contract): the reference generation's ``prompt_tokens``, for every kind of request."""
    caption = client.caption(sample_image_bytes(), max_tokens=2, **GREEDY)
    assert (
        caption.metrics.input_tokens
        == generator.caption(sample_image, "normal", _greedy(2)).prompt_tokens
    )
    query = client.query(None, "how many?", max_tokens=2, **GREEDY)
    assert (
        query.metrics.input_tokens == generator.query(None, "how many?", _greedy(2)).prompt_tokens
    )
    boxes = client.detect(sample_image_bytes(), "house", max_objects=1)
    assert (
        boxes.metrics.input_tokens
        == generator.detect(sample_image, "house", max_objects=1).prompt_tokens
    )


def test_input_tokens_count_the_prompt_one_request_at_a_time(
    single_client: VisionLanguageClient,
    generator: ReferenceGenerator,
    sample_image: PreparedImage,
) -> None:
    _input_tokens_against_the_reference(single_client, generator, sample_image)


def test_input_tokens_count_the_prompt_on_the_batched_engine(
    batched_client: VisionLanguageClient, generator: ReferenceGenerator, sample_image: PreparedImage
) -> None:
    _input_tokens_against_the_reference(batched_client, generator, sample_image)


def test_encode_image_ids_name_the_content(
    client: VisionLanguageClient, sample_image: PreparedImage
) -> None:
    first = client.encode_image(sample_image_bytes())
    png = io.BytesIO()
    Image.open(io.BytesIO(sample_image_bytes())).save(png, format="PNG")
    again = client.encode_image(png.getvalue())  # same pixels, other container
    assert first.image_id == again.image_id == sample_image.content_hash
    assert again.already_cached
    assert (first.width, first.height, first.num_crops) == (800, 600, sample_image.num_crops)


def test_encode_image_reports_a_new_image_as_not_cached(
    client: VisionLanguageClient, engine_kind: str
) -> None:
    png = io.BytesIO()
    colour = (17, 201, 99) if engine_kind == "batched" else (201, 17, 99)
    Image.new("RGB", (40, 30), colour).save(png, format="PNG")
    first = client.encode_image(png.getvalue())
    again = client.encode_image(png.getvalue())
    assert first.image_id == again.image_id
    assert (first.already_cached, again.already_cached) == (False, True)


def test_model_info_reports_model_and_limits(
    client: VisionLanguageClient, engine_kind: str, tiny: LoadedModel
) -> None:
    info = client.model_info()
    assert (info.model_name, info.token_contract) == ("tiny", "tiny")
    assert info.device == "cpu"
    assert info.max_context == info.max_tokens == tiny.config.text.max_context
    assert info.max_message_bytes == 32 * MIB
    assert (info.pipeline_depth, info.max_batch_size) == SHAPES[engine_kind]
    assert info.max_queue == 100
    assert info.server_version
    # Every limit a request can hit is reported, at the server's defaults here.
    assert (info.max_object_chars, info.max_question_chars) == (256, 16_384)
    assert (info.max_choices, info.max_choice_chars, info.max_regex_chars) == (1024, 1024, 1024)
    assert info.max_step_tokens > info.max_batch_size


def test_model_info_names_the_dtype_as_the_dtype_flag_does(
    client: VisionLanguageClient, engine_kind: str, request: pytest.FixtureRequest
) -> None:
    assert client.model_info().dtype == "fp32"


def test_request_id_comes_back_in_trailing_metadata(stub: pb_grpc.VisionLanguageStub) -> None:
    _, call = stub.GetModelInfo.with_call(
        pb.GetModelInfoRequest(), timeout=10, metadata=(("x-request-id", "abc-123"),)
    )
    assert ("vlm-request-id", "abc-123") in tuple(call.trailing_metadata())


# ---- errors -------------------------------------------------------------------------------


SAMPLE = sample_image_bytes()
IMAGE_ID_ERRORS: list[tuple[str, Callable[..., Any], grpc.StatusCode, str]] = [
    (
        "garbage image",
        lambda c, i: c.point(b"\x00garbage" * 64, "car"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "image_bytes",
    ),
    (
        "empty image",
        lambda c, i: c.detect(b"", "car"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "image_bytes",
    ),
    (
        "truncated jpeg",
        lambda c, i: c.caption(SAMPLE[: len(SAMPLE) // 3]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "image_bytes",
    ),
    ("no image", lambda c, i: c.caption(None), grpc.StatusCode.INVALID_ARGUMENT, "image"),
    ("empty object", lambda c, i: c.detect(i, "   "), grpc.StatusCode.INVALID_ARGUMENT, "object"),
    (
        "10 KB object name",
        lambda c, i: c.detect(i, "x" * 10_000),
        grpc.StatusCode.INVALID_ARGUMENT,
        "object",
    ),
    ("empty question", lambda c, i: c.query(i, ""), grpc.StatusCode.INVALID_ARGUMENT, "question"),
    (
        "20 KB question",
        lambda c, i: c.query(i, "x" * 20_000),
        grpc.StatusCode.INVALID_ARGUMENT,
        "question",
    ),
    (
        "negative temperature",
        lambda c, i: c.caption(i, temperature=-0.1),
        grpc.StatusCode.INVALID_ARGUMENT,
        "settings.temperature",
    ),
    (
        "nan temperature",
        lambda c, i: c.caption(i, temperature=float("nan")),
        grpc.StatusCode.INVALID_ARGUMENT,
        "settings.temperature",
    ),
    (
        "top_p zero",
        lambda c, i: c.caption(i, top_p=0.0),
        grpc.StatusCode.INVALID_ARGUMENT,
        "settings.top_p",
    ),
    (
        "top_p above one",
        lambda c, i: c.query(i, "q", top_p=1.5),
        grpc.StatusCode.INVALID_ARGUMENT,
        "settings.top_p",
    ),
    (
        "max_tokens zero",
        lambda c, i: c.caption(i, max_tokens=0),
        grpc.StatusCode.INVALID_ARGUMENT,
        "settings.max_tokens",
    ),
    (
        "max_tokens beyond the model",
        lambda c, i: c.caption(i, max_tokens=100_000),
        grpc.StatusCode.OUT_OF_RANGE,
        "settings.max_tokens",
    ),
    (
        "max_tokens at the int32 ceiling",
        lambda c, i: c.caption(i, max_tokens=2**31 - 1),
        grpc.StatusCode.OUT_OF_RANGE,
        "settings.max_tokens",
    ),
    (
        "max_tokens at the context",
        lambda c, i: c.caption(i, max_tokens=2048),
        grpc.StatusCode.OUT_OF_RANGE,
        "settings.max_tokens",
    ),
    (
        "max_objects zero",
        lambda c, i: c.point(i, "car", max_objects=0),
        grpc.StatusCode.INVALID_ARGUMENT,
        "settings.max_objects",
    ),
    (
        "unknown image id",
        lambda c, i: c.caption(EncodedImage("f" * 64, 1, 1, 1)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "image_id",
    ),
    (
        "bad regex",
        lambda c, i: c.query(i, "q", regex="(unclosed"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "regex",
    ),
    (
        "choices and regex",
        lambda c, i: c.query(i, "q", choices=["a"], regex="a"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "choices",
    ),
    (
        "empty choice",
        lambda c, i: c.query(i, "q", choices=["yes", ""]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "choices",
    ),
    (
        "prompt + max_tokens beyond context",
        lambda c, i: c.caption(i, max_tokens=2000),
        grpc.StatusCode.OUT_OF_RANGE,
        "settings.max_tokens",
    ),
    (
        "objects beyond context",
        lambda c, i: c.detect(i, "car", max_objects=1000),
        grpc.StatusCode.OUT_OF_RANGE,
        "settings.max_objects",
    ),
]


@pytest.mark.parametrize(
    ("case", "fn", "code", "field"), IMAGE_ID_ERRORS, ids=[e[0] for e in IMAGE_ID_ERRORS]
)
def test_bad_requests_fail_with_a_code_and_name_the_field(
    client: VisionLanguageClient,
    uploaded: EncodedImage,
    case: str,
    fn: Callable[..., Any],
    code: grpc.StatusCode,
    field: str,
) -> None:
    with pytest.raises(VlmError) as caught:
        fn(client, uploaded)
    err = caught.value
    assert err.code == code, err
    assert err.field == field
    assert field.split(".")[-1] in err.message
    assert err.request_id


# ---- segment and constrained queries ---------------------------------------------------------


@pytest.mark.parametrize("choices", [["yes", "no"], ["red", "green", "blue", "a long one"]])
def test_query_with_choices_answers_one_of_them(
    batched_client: VisionLanguageClient,
    generator: ReferenceGenerator,
    sample_image: PreparedImage,
    choices: list[str],
) -> None:
    image = batched_client.encode_image(sample_image_bytes())
    events = list(batched_client.query_stream(image, "which one?", choices=choices, **GREEDY))
    final = events[-1]
    assert isinstance(final, TextResult) and final.finish_reason == "eos"
    assert final.text in choices
    assert "".join(e.text for e in events[:-1]) == final.text
    want = generator.query(sample_image, "which one?", _greedy(768), choices=tuple(choices))
    assert final.text == want.text
    sampled = batched_client.query(None, "pick one", choices=choices, temperature=1.0, seed=7)
    assert sampled.text in choices
    assert (
        sampled.text
        == generator.query(
            None, "pick one", SamplingSettings(temperature=1.0, seed=7), choices=tuple(choices)
        ).text
    )


@pytest.mark.parametrize(
    "pattern", [r"[0-9]{1,3}", r"(yes|no), because [a-z]{1,8}", r"[A-Z][a-z]{2,8}( [0-9])?"]
)
def test_query_with_a_regex_answers_a_full_match(
    batched_client: VisionLanguageClient,
    generator: ReferenceGenerator,
    sample_image: PreparedImage,
    pattern: str,
) -> None:
    image = batched_client.encode_image(sample_image_bytes())
    got = batched_client.query(
        image, "answer in the format", regex=pattern, max_tokens=24, **GREEDY
    )
    assert got.finish_reason == "eos", got
    assert re.fullmatch(pattern, got.text), got.text
    want = generator.query(sample_image, "answer in the format", _greedy(24), regex=pattern)
    assert (got.text, got.finish_reason) == (want.text, want.finish_reason)


def test_segment_answers_a_box_path_polygons_and_mask(
    batched_client: VisionLanguageClient, generator: ReferenceGenerator, sample_image: PreparedImage
) -> None:
    image = batched_client.encode_image(sample_image_bytes())
    by_id, by_bytes = (
        batched_client.segment(source, "house", max_tokens=32)
        for source in (image, sample_image_bytes())
    )
    for seg in (by_id, by_bytes):
        b = seg.box
        assert 0 <= b.x_min <= b.x_max <= 1 and 0 <= b.y_min <= b.y_max <= 1
        assert seg.svg_path.startswith("M") and seg.polygons
        assert all(0 <= p.x <= 1 and 0 <= p.y <= 1 for poly in seg.polygons for p in poly)
        assert (seg.mask.height, seg.mask.width) == (600, 800)
        assert sum(seg.mask.counts) == 600 * 800 and min(seg.mask.counts) >= 0
        assert seg.finish_reason in ("eos", "length")
        assert seg.metrics.input_tokens > 0
    assert (by_id.box, by_id.svg_path, by_id.mask) == (
        by_bytes.box,
        by_bytes.svg_path,
        by_bytes.mask,
    )
    want, reason = generator.segment(sample_image, "house", 32)
    assert (by_id.svg_path, by_id.mask.counts, by_id.finish_reason) == (
        want.path,
        list(want.mask_counts),
        reason,
    )
    box = by_id.box
    assert (box.x_min, box.y_min, box.x_max, box.y_max) == want.box


def test_oversized_message_is_refused_with_the_limit_stated(
    stub: pb_grpc.VisionLanguageStub,
) -> None:
    request = pb.PointRequest(image_bytes=b"\xff" * (32 * MIB + 1), object="car")
    with pytest.raises(grpc.RpcError) as caught:
        stub.Point(request, timeout=60)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(32 * MIB) in caught.value.details()


def test_server_still_answers_after_the_errors(
    client: VisionLanguageClient, uploaded: EncodedImage
) -> None:
    assert client.caption(uploaded, max_tokens=2, **GREEDY).finish_reason in ("eos", "length")
