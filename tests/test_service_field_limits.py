"""String fields far beyond their limits are refused from the length the wire format declares,
before the message is parsed (no copy, no UTF-8 check of megabytes on the event loop)."""

from __future__ import annotations

import pytest

from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.rpc import intake
from vlm_server.rpc.field_limits import oversized_field
from vlm_server.rpc.intake import Malformed, guarded_parser

LIMITS = {"question": 100, "object": 10, "choices": 20, "regex": 30}


@pytest.mark.parametrize(
    ("message", "field"),
    [
        (pb.QueryRequest(question="q" * 401), "question"),
        (pb.QueryRequest(question="ok", choices=["a", "b" * 81]), "choices"),
        (pb.QueryRequest(question="ok", regex="r" * 121), "regex"),
        (pb.DetectRequest(object="o" * 41, image_bytes=b"\xff" * 5000), "object"),
    ],
)
def test_a_string_declared_beyond_4_bytes_a_character_is_named(
    message: pb.QueryRequest, field: str
) -> None:
    found = oversized_field(message.SerializeToString(), message.DESCRIPTOR, LIMITS)
    assert found is not None and found.field == field
    assert found.message.startswith(f"{field}: is ")


@pytest.mark.parametrize(
    "message",
    [
        pb.QueryRequest(question="é" * 100),  # 200 bytes, 100 characters: the validator's
        pb.QueryRequest(question="q" * 400, choices=["c" * 80]),
        pb.CaptionRequest(image_bytes=b"\x00" * 100_000),  # no limit on bytes fields here
    ],
)
def test_strings_within_4_bytes_a_character_are_left_to_the_parser(
    message: pb.QueryRequest,
) -> None:
    assert oversized_field(message.SerializeToString(), message.DESCRIPTOR, LIMITS) is None


@pytest.mark.parametrize(
    "data", [b"\xff\xff\xff", b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", b"\x0b"]
)
def test_a_broken_wire_format_is_left_to_the_parser(data: bytes) -> None:
    assert oversized_field(data, pb.QueryRequest.DESCRIPTOR, LIMITS) is None


def test_the_parser_never_sees_an_oversized_question(monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[bytes] = []

    def parse(data: bytes) -> pb.QueryRequest:
        parsed.append(data)
        return pb.QueryRequest.FromString(data)

    monkeypatch.setattr(intake, "_message_class", lambda _: pb.QueryRequest)
    guarded = guarded_parser(parse, LIMITS)
    bad = guarded(pb.QueryRequest(question="why? " * 200_000).SerializeToString())
    assert isinstance(bad, Malformed) and bad.field == "question" and not parsed
    assert bad.message == "question: is 1000000 bytes long; at most 100 characters"
    assert isinstance(guarded(pb.QueryRequest(question="ok").SerializeToString()), pb.QueryRequest)
