"""Where a large body's work runs: never on the event loop's thread.

Each step that touches a whole body (parsing a gRPC message, cutting its picture out, joining
and parsing an HTTP body, decoding base64, copying, hashing, decoding the picture) is wrapped to
record the thread that ran it; a large body through either door must have run every one of
them, and none on the loop's thread. No clock is read: this is about where, not how long.
"""

from __future__ import annotations

import asyncio
import io
import json
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from PIL import Image

from tests.http_support import data_url, post
from tests.support.service_harness import ServerThread, in_process, local_config
from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.api.v1 import vision_language_pb2_grpc as pb_grpc
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.engine import BatchedEngine
from vlm_server.frontend import gil_free, images, received
from vlm_server.http import data_url as data_urls
from vlm_server.http import json_body
from vlm_server.models.interface import LoadedModel
from vlm_server.rpc import intake
from vlm_server.rpc.big_fields import cut_bytes_field
from vlm_server.rpc.status import FIELD_METADATA_KEY

MIB = 1 << 20
FAKE_JPEG = b"\xff\xd8\xff" + bytes(3 * MIB)  # over every off-loop threshold; not a picture


@pytest.fixture(scope="module")
def big_jpeg() -> bytes:
    """A real JPEG of over a megabyte (noise does not compress)."""
    pixels = np.random.default_rng(0).integers(0, 256, (1200, 1200, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=95)
    assert len(out.getvalue()) > 1.2 * MIB
    return out.getvalue()


@pytest.fixture(scope="module")
def server(tiny: LoadedModel) -> Iterator[ServerThread]:
    config = EngineConfig(max_batch_size=2, kv_budget_bytes=16 * MIB)
    factory = in_process(lambda: BatchedEngine(tiny, config))
    with ServerThread(local_config(http_port=-1), factory) as running:
        yield running


class Where:
    """The threads each wrapped step ran on."""

    def __init__(self) -> None:
        self.threads: dict[str, set[int]] = defaultdict(set)

    def wrap(self, monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, label: str) -> None:
        inner: Callable[..., Any] = getattr(owner, name)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.threads[label].add(threading.get_ident())
            return inner(*args, **kwargs)

        monkeypatch.setattr(owner, name, recorded)

    def on(self, thread: int) -> list[str]:
        return sorted(step for step, threads in self.threads.items() if thread in threads)


def _loop_thread(server: ServerThread) -> int:
    async def ident() -> int:
        return threading.get_ident()

    return server.run(ident())


@pytest.fixture
def where(monkeypatch: pytest.MonkeyPatch, server: ServerThread) -> Where:
    w = Where()
    for owner, name, label in [
        (intake, "parse_large", "intake.parse_large"),
        (gil_free, "bytes_of", "gil_free.bytes_of"),
        (gil_free, "is_ascii", "gil_free.is_ascii"),
        (gil_free, "ascii_text", "gil_free.ascii_text"),
        (json_body, "parse", "json_body.parse"),
        (data_urls, "_b64decode", "data_url._b64decode"),
        (images, "_digest", "images._digest"),
    ]:
        w.wrap(monkeypatch, owner, name, label)
    assert server.server is not None
    w.wrap(monkeypatch, server.server.core.images.preparer, "prepare", "preparer.prepare")
    return w


def _grpc_caption(server: ServerThread, picture: bytes) -> grpc.RpcError | list[Any]:
    options = [("grpc.max_send_message_length", 64 * MIB)]
    with grpc.insecure_channel(server.target, options=options) as channel:
        stub = pb_grpc.VisionLanguageStub(channel)
        settings = pb.GenerationSettings(max_tokens=2)
        try:
            return list(stub.Caption(pb.CaptionRequest(image_bytes=picture, settings=settings)))
        except grpc.RpcError as err:
            return err


def _http_caption(server: ServerThread, picture: bytes) -> tuple[int, dict[str, Any]]:
    body = {"image_url": data_url(picture), "settings": {"max_tokens": 2}}
    status, _, raw = post(f"{server.http_url}/caption", body)
    return status, json.loads(raw)


def test_a_large_body_over_grpc_is_parsed_copied_and_hashed_off_the_loop(
    server: ServerThread, where: Where
) -> None:
    err = _grpc_caption(server, FAKE_JPEG)
    assert isinstance(err, grpc.RpcError)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(err.trailing_metadata())[FIELD_METADATA_KEY] == "image_bytes"
    ran = {"intake.parse_large", "gil_free.bytes_of", "images._digest", "preparer.prepare"}
    assert ran <= set(where.threads), where.threads
    assert where.on(_loop_thread(server)) == []


def test_a_large_body_over_http_is_joined_parsed_decoded_and_hashed_off_the_loop(
    server: ServerThread, where: Where
) -> None:
    status, body = _http_caption(server, FAKE_JPEG)
    assert status == 400 and body["error"]["field"] == "image_url", body
    ran = {"json_body.parse", "gil_free.ascii_text", "data_url._b64decode", "images._digest"}
    assert ran <= set(where.threads), where.threads
    assert where.on(_loop_thread(server)) == []


def test_a_large_picture_answers_and_is_cached_the_same_through_both_doors(
    server: ServerThread, where: Where, big_jpeg: bytes
) -> None:
    assert server.server is not None
    resolver = server.server.core.images
    hits = resolver.encoding_hits
    answer = _grpc_caption(server, big_jpeg)
    assert isinstance(answer, list) and answer, answer
    status, body = _http_caption(server, big_jpeg)
    assert status == 200, body
    assert resolver.encoding_hits == hits + 1  # the same bytes: one decode, then the cache
    assert len(where.threads["preparer.prepare"]) >= 1
    assert where.on(_loop_thread(server)) == []


def test_encode_image_takes_the_attached_picture(server: ServerThread, big_jpeg: bytes) -> None:
    options = [("grpc.max_send_message_length", 64 * MIB)]
    with grpc.insecure_channel(server.target, options=options) as channel:
        stub = pb_grpc.VisionLanguageStub(channel)
        reply = stub.EncodeImage(pb.EncodeImageRequest(image_bytes=big_jpeg))
    assert (reply.width, reply.height) == (1200, 1200)


def test_a_field_beside_a_large_picture_is_still_refused_by_name(server: ServerThread) -> None:
    request = pb.QueryRequest(image_bytes=FAKE_JPEG, question="q" * 100_000)
    with grpc.insecure_channel(server.target) as channel:
        call = channel.unary_stream("/vlm.v1.VisionLanguage/Query")
        with pytest.raises(grpc.RpcError) as caught:
            list(call(request.SerializeToString(), timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(caught.value.trailing_metadata())[FIELD_METADATA_KEY] == "question"


# ---- the pieces ---------------------------------------------------------------------------


def test_the_picture_is_cut_only_where_the_parser_would_keep_it() -> None:
    picture = bytes(range(256)) * 8192  # 2 MiB
    request = pb.QueryRequest(question="why?", image_bytes=picture)
    data = request.SerializeToString()
    cut = cut_bytes_field(data, request.DESCRIPTOR, MIB)
    assert cut is not None and data[cut.start : cut.end] == picture
    rest = pb.QueryRequest.FromString(cut.rest)
    assert rest.question == "why?" and rest.WhichOneof("image") is None
    assert cut_bytes_field(data, request.DESCRIPTOR, 4 * MIB) is None  # small: parsed whole
    # Another member of the oneof after it wins in protobuf: not cut.
    later = data + pb.QueryRequest(image_id="abc").SerializeToString()
    assert cut_bytes_field(later, request.DESCRIPTOR, MIB) is None
    assert cut_bytes_field(data + data, request.DESCRIPTOR, MIB) is None  # twice
    assert cut_bytes_field(data[:-5], request.DESCRIPTOR, MIB) is None  # truncated
    encode = pb.EncodeImageRequest(image_bytes=picture).SerializeToString()
    assert cut_bytes_field(encode, pb.EncodeImageRequest.DESCRIPTOR, MIB) is not None


def test_parse_large_gives_the_parsers_message_and_the_picture() -> None:
    picture = b"\x01" * (2 * MIB)
    parser = intake.guarded_parser(pb.QueryRequest.FromString)
    data = pb.QueryRequest(question="q", image_bytes=picture).SerializeToString()
    request, image = intake.parse_large(parser, pb.QueryRequest, data)
    assert request.question == "q" and image == picture
    twice = data + data  # left whole: the message holds it, and it comes out too
    request, image = intake.parse_large(parser, pb.QueryRequest, twice)
    assert request.image_bytes == picture and image == picture
    by_id = data + pb.QueryRequest(image_id="abc").SerializeToString()
    request, image = intake.parse_large(parser, pb.QueryRequest, by_id)
    assert request.image_id == "abc" and image is None
    bad, image = intake.parse_large(parser, pb.QueryRequest, data + b"\xff")
    assert isinstance(bad, intake.Malformed) and image is None


def test_gil_free_copies_equal_slices() -> None:
    data = bytes(range(256)) * 20_000 + b"QUJD" * 1_000_000
    assert gil_free.bytes_of(data, 7, len(data) - 3) == data[7:-3]
    start = 256 * 20_000
    text = gil_free.ascii_text(data, start, len(data))
    assert gil_free.is_ascii(data, start, len(data)) and not gil_free.is_ascii(data, 0, start)
    assert text == data[start:].decode() and hash(text) == hash(data[start:].decode())
    with pytest.raises(ValueError):
        gil_free.bytes_of(data, 0, len(data) + 1)
    with pytest.raises(ValueError):
        gil_free.bytes_of(bytearray(data), 0)  # type: ignore[arg-type]


def test_an_attachment_belongs_to_its_task() -> None:
    message = pb.CaptionRequest()

    async def run() -> None:
        received.attach(message, "image_bytes", b"abc")
        assert received.image_bytes(message) == b"abc"

    asyncio.run(run())
    assert received.attached(message) is None and received.image_field(message) is None
