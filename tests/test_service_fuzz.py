"""The gRPC door under generated requests: for every RPC, a request it answers with 0-3
fields changed (set to generated values or cleared), messages built from its descriptor alone
(each field set or not, strings, bytes that are a picture or not, floats with NaN and
infinities, integers across their range, enum numbers outside the enum, nested messages and
one-ofs), and raw bytes that are no message at all. The answer is OK or a clean status whose
details name the field (or say the bytes are no message), never UNKNOWN or INTERNAL; both
kinds occur; and the server stays healthy with no KV page held but cached prefixes'. Examples
are derandomized: the same requests every run."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from image_pipeline import sample_image_bytes
from tests.support.service_harness import (
    GatedBatchedEngine,
    ServerThread,
    engine_of,
    in_process,
    local_config,
    wait_for,
)
from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.engine.config import EngineConfig
from vlm_server.models.interface import LoadedModel

SERVICE = pb.DESCRIPTOR.services_by_name["VisionLanguage"]
METHODS = list(SERVICE.methods)
PICTURE = sample_image_bytes()
SHORT = 4  # tokens of an answer: the CPU model is slow
CLEAN = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
}
_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
}


def _repeated(field: FieldDescriptor) -> bool:
    # protobuf 6 has `is_repeated` (and drops `label` with upb); older releases only `label`.
    if hasattr(field, "is_repeated"):
        return bool(field.is_repeated)
    return field.label == FieldDescriptor.LABEL_REPEATED


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field.type
    if t == FieldDescriptor.TYPE_STRING:
        words = st.sampled_from(["car", "what is this?", "short", "", " "])
        return words | st.text(max_size=20)
    if t == FieldDescriptor.TYPE_BYTES:
        return st.sampled_from([PICTURE, PICTURE[:500], b""]) | st.binary(max_size=64)
    if t in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        width = 32 if t == FieldDescriptor.TYPE_FLOAT else 64
        return st.floats(min_value=-2, max_value=2) | st.floats(width=width)
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.sampled_from(known) | st.integers(min_value=-3, max_value=40)
    lo, hi = _INT_RANGES[t]
    if field.name in ("max_tokens", "max_objects"):
        return st.integers(min_value=-2, max_value=SHORT) | st.integers(min_value=lo, max_value=hi)
    return st.integers(min_value=-3, max_value=10) | st.integers(min_value=lo, max_value=hi)


@st.composite
def _message(draw: st.DrawFn, descriptor: Descriptor, depth: int = 0) -> dict[str, Any]:
    """Field values of a ``descriptor`` message: each field set or not, one member of each
    one-of at most."""
    values: dict[str, Any] = {}
    chosen = {o.name: draw(st.sampled_from([None, *[f.name for f in o.fields]])) for o in
              descriptor.oneofs if not o.name.startswith("_")}  # fmt: skip
    for field in descriptor.fields:
        oneof = field.containing_oneof
        real = oneof is not None and not oneof.name.startswith("_")  # not proto3's optional
        if real and chosen[oneof.name] != field.name:  # type: ignore[union-attr]
            continue
        if not real and not draw(st.booleans()):
            continue
        if field.type != FieldDescriptor.TYPE_MESSAGE or depth <= 2:
            values[field.name] = draw(_field_value(field, depth))
    return values


def _field_value(field: FieldDescriptor, depth: int = 0) -> st.SearchStrategy[Any]:
    """Values of one field: a scalar, a nested message's field values, or a list of either."""
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        one = _message(field.message_type, depth + 1)
    else:
        one = _scalar(field)
    return st.lists(one, max_size=3) if _repeated(field) else one


def _build(cls: type[Message], values: dict[str, Any]) -> Message:
    message = cls()
    _fill(message, values)
    return message


def _fill(message: Message, values: dict[str, Any]) -> None:
    for name, value in values.items():
        field = message.DESCRIPTOR.fields_by_name[name]
        target = getattr(message, name)
        if field.type != FieldDescriptor.TYPE_MESSAGE:
            if _repeated(field):
                target.extend(value)
            else:
                setattr(message, name, value)
        elif _repeated(field):
            for item in value:
                _fill(target.add(), item)
        else:
            target.SetInParent()
            _fill(target, value)


def _bounded(message: Message) -> Message:
    """Answers short where the request leaves their length open (a value given stays)."""
    if "settings" in message.DESCRIPTOR.fields_by_name:
        s = message.settings  # type: ignore[attr-defined]
        if not s.HasField("max_tokens"):
            s.max_tokens = SHORT
    return message


def _valid(name: str) -> Message:
    """A request each RPC answers, which the examples then change."""
    settings = pb.GenerationSettings(max_tokens=SHORT)
    objects = pb.GenerationSettings(max_objects=2)
    return {
        "Caption": lambda: pb.CaptionRequest(
            image_bytes=PICTURE, length=pb.CAPTION_LENGTH_SHORT, settings=settings
        ),
        "Query": lambda: pb.QueryRequest(image_bytes=PICTURE, question="what?", settings=settings),
        "Point": lambda: pb.PointRequest(image_bytes=PICTURE, object="cat", settings=objects),
        "Detect": lambda: pb.DetectRequest(image_bytes=PICTURE, object="cat", settings=objects),
        "Segment": lambda: pb.SegmentRequest(
            image_bytes=PICTURE, object="cat", settings=pb.GenerationSettings(max_tokens=8)
        ),
        "EncodeImage": lambda: pb.EncodeImageRequest(image_bytes=PICTURE),
        "GetModelInfo": lambda: pb.GetModelInfoRequest(),
    }[name]()


@st.composite
def _changed(draw: st.DrawFn, method: Any) -> Message:
    """`_valid`'s request with 0-3 fields (settings' too) set to generated values or cleared."""
    message = _valid(method.name)
    for _ in range(draw(st.integers(min_value=0, max_value=3))):
        target = message
        if "settings" in message.DESCRIPTOR.fields_by_name and draw(st.booleans()):
            target = message.settings  # type: ignore[attr-defined]
        fields = list(target.DESCRIPTOR.fields)
        if not fields:
            break
        field = draw(st.sampled_from(fields))
        target.ClearField(field.name)
        if draw(st.integers(min_value=0, max_value=3)):  # set, else left cleared
            _fill(target, {field.name: draw(_field_value(field))})
    return message


@pytest.fixture(scope="module")
def server(tiny: LoadedModel) -> Iterator[ServerThread]:
    config = EngineConfig(max_batch_size=8, max_queue=100, kv_budget_bytes=16 << 20)
    factory = in_process(lambda: GatedBatchedEngine(tiny, config))
    with ServerThread(local_config(), factory) as s:
        yield s


def _call(channel: grpc.Channel, method: Any, request: bytes) -> tuple[grpc.StatusCode, str]:
    path = f"/{SERVICE.full_name}/{method.name}"
    try:
        if method.server_streaming:
            for _ in channel.unary_stream(path)(request, timeout=60):
                pass
        else:
            channel.unary_unary(path)(request, timeout=60)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as err:
        return err.code(), err.details() or ""


@pytest.mark.parametrize("method", METHODS, ids=[m.name for m in METHODS])
def test_generated_requests_get_ok_or_a_clean_status_naming_the_field(
    server: ServerThread, method: Any
) -> None:
    cls = getattr(pb, method.input_type.name)
    seen: dict[grpc.StatusCode, int] = {}
    with grpc.insecure_channel(server.target) as channel:

        @settings(
            max_examples=30,
            deadline=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(
            request=st.one_of(
                _changed(method),
                _changed(method),
                _message(method.input_type).map(lambda v: _bounded(_build(cls, v))),
                st.binary(max_size=40),
            )
        )
        def check(request: Message | bytes) -> None:
            data = request if isinstance(request, bytes) else request.SerializeToString()
            code, details = _call(channel, method, data)
            seen[code] = seen.get(code, 0) + 1
            assert code in CLEAN, (request, code, details)
            if code != grpc.StatusCode.OK:  # a field named, or no message to name one in
                named = ":" in details or details.startswith("not a valid")
                assert named, (request, code, details)

        check()
    assert grpc.StatusCode.OK in seen and len(seen) > 1, seen  # answers and refusals


def test_the_server_is_healthy_and_holds_no_page_after_the_fuzz(server: ServerThread) -> None:
    engine = engine_of(server)
    assert isinstance(engine, GatedBatchedEngine)
    wait_for(engine.idle, what="an idle engine")
    assert engine.scheduler.pages.used_pages == engine.cached_prefix_pages()
    with grpc.insecure_channel(server.target) as channel:
        code, _ = _call(channel, SERVICE.methods_by_name["GetModelInfo"], b"")
    assert code == grpc.StatusCode.OK
