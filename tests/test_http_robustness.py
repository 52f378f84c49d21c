"""The HTTP door under bad input and bad luck: every malformed body, wrong type, bad picture and
remote URL is a 4xx naming the field (the same message gRPC gives for the same input); bodies
beyond the limit get 413 before they are read whole; a client that disconnects mid-stream
frees its KV pages; deadlines give 504; draining gives 503; the OpenAPI description covers
every route; and the server stays healthy throughout."""

from __future__ import annotations

import concurrent.futures
import gc
import io
import json
import socket
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from PIL import Image

from image_pipeline import sample_image_bytes
from tests.http_support import data_url, events, post, post_json
from tests.support.service_harness import (
    GatedBatchedEngine,
    ServerThread,
    engine_of,
    in_process,
    local_config,
    wait_for,
)
from vlm_server.client import VisionLanguageClient, VlmError
from vlm_server.engine.config import EngineConfig
from vlm_server.http.routes import ROUTES
from vlm_server.models.interface import LoadedModel

MIB = 1 << 20
BODY_LIMIT = 256 << 10
IMG = data_url(sample_image_bytes())
LONG = 900  # tokens of a text-only answer: seconds on the CPU, far beyond any wait here


@pytest.fixture(scope="module")
def server(tiny: LoadedModel) -> Iterator[ServerThread]:
    config = EngineConfig(max_batch_size=8, max_queue=100, kv_budget_bytes=16 * MIB)
    factory = in_process(lambda: GatedBatchedEngine(tiny, config))
    with ServerThread(local_config(http_port=-1, max_http_body_bytes=BODY_LIMIT), factory) as s:
        yield s


def _engine(server: ServerThread) -> GatedBatchedEngine:
    engine = engine_of(server)
    assert isinstance(engine, GatedBatchedEngine)
    return engine


def _settled(engine: GatedBatchedEngine) -> None:
    """Idle, and no KV page held but by cached image prefixes; dropping those frees all."""
    wait_for(engine.idle, what="an idle engine")
    pages = engine.scheduler.pages
    assert pages.used_pages == engine.cached_prefix_pages()
    engine.scheduler.prefix_cache.clear()  # idle: the scheduler thread is waiting
    assert pages.used_pages == 0


# ---- bad input ----------------------------------------------------------------------------

BAD: list[tuple[str, str, Any, int, str]] = [
    ("not json", "/caption", b"{not json", 400, "body"),
    ("not an object", "/caption", b"[1, 2]", 400, "body"),
    ("NaN", "/query", b'{"question": "q", "settings": {"temperature": NaN}}', 400, "body"),
    ("no body", "/query", b"", 400, "body"),
    ("missing picture", "/caption", {}, 400, "image_url"),
    ("picture not a string", "/caption", {"image_url": 5}, 400, "image_url"),
    ("unknown length", "/caption", {"image_url": IMG, "length": "tiny"}, 400, "length"),
    ("stream not boolean", "/caption", {"image_url": IMG, "stream": "yes"}, 400, "stream"),
    (
        "temperature a string",
        "/caption",
        {"image_url": IMG, "settings": {"temperature": "hot"}},
        400,
        "settings.temperature",
    ),
    (
        "temperature a boolean",
        "/query",
        {"question": "q", "settings": {"temperature": True}},
        400,
        "settings.temperature",
    ),
    (
        "max_tokens a float",
        "/query",
        {"question": "q", "settings": {"max_tokens": 1.5}},
        400,
        "settings.max_tokens",
    ),
    (
        "max_tokens beyond int32",
        "/query",
        {"question": "q", "settings": {"max_tokens": 10**12}},
        422,
        "settings.max_tokens",
    ),
    (
        "max_tokens at the int32 ceiling",
        "/query",
        {"question": "q", "settings": {"max_tokens": 2**31 - 1}},
        422,
        "settings.max_tokens",
    ),
    (
        "a temperature beyond a double",
        "/query",
        b'{"question": "q", "settings": {"temperature": 1e999}}',
        400,
        "settings.temperature",
    ),
    (
        "an integer of 5000 digits",
        "/query",
        b'{"question": "q", "settings": {"seed": ' + b"7" * 5000 + b"}}",
        400,
        "body",
    ),
    ("1000 nested arrays", "/query", b"[" * 1000 + b"]" * 1000, 400, "body"),
    (
        "1000 nested objects",
        "/query",
        b'{"question": "q", "settings": ' + b'{"a":' * 1000 + b"1" + b"}" * 1001,
        400,
        "body",
    ),
    ("settings not an object", "/query", {"question": "q", "settings": [1]}, 400, "settings"),
    (
        "unknown setting",
        "/query",
        {"question": "q", "settings": {"warmth": 1}},
        400,
        "settings.warmth",
    ),
    ("unknown field", "/caption", {"image_url": IMG, "colour": "red"}, 400, "colour"),
    ("an empty member name", "/caption", {"image_url": IMG, "": 1}, 400, '""'),
    ("a member name with a space", "/query", {"question": "q", "a b": 1}, 400, '"a b"'),
    (
        "bad base64",
        "/caption",
        {"image_url": "data:image/jpeg;base64,!!not*base64"},
        400,
        "image_url",
    ),
    (
        "not an image",
        "/point",
        {"image_url": data_url(b"plain text " * 40), "object": "x"},
        400,
        "image_url",
    ),
    (
        "truncated jpeg",
        "/caption",
        {"image_url": data_url(sample_image_bytes()[:2000])},
        400,
        "image_url",
    ),
    ("remote https", "/caption", {"image_url": "https://example.com/cat.jpg"}, 400, "image_url"),
    (
        "remote http",
        "/detect",
        {"image_url": "http://10.0.0.1/a.png", "object": "a"},
        400,
        "image_url",
    ),
    ("not a data url", "/caption", {"image_url": "cat.jpg"}, 400, "image_url"),
    ("text media type", "/caption", {"image_url": "data:text/plain;base64,aGk="}, 400, "image_url"),
    ("not base64 data", "/caption", {"image_url": "data:image/png,raw"}, 400, "image_url"),
    ("empty question", "/query", {"question": "  "}, 400, "question"),
    ("question a number", "/query", {"question": 5}, 400, "question"),
    ("reasoning a string", "/query", {"question": "q", "reasoning": "yes"}, 400, "reasoning"),
    (
        "spatial refs outside the picture",
        "/point",
        {"image_url": IMG, "object": "a", "spatial_refs": [[0.1, 2.0]]},
        400,
        "spatial_refs",
    ),
    (
        "spatial refs without a picture",
        "/query",
        {"question": "q", "spatial_refs": [[0.1, 0.2]]},
        400,
        "spatial_refs",
    ),
    ("variant", "/caption", {"image_url": IMG, "variant": "ft-1"}, 400, "variant"),
    ("point streamed", "/point", {"image_url": IMG, "object": "a", "stream": True}, 400, "stream"),
    ("missing object", "/detect", {"image_url": IMG}, 400, "object"),
    ("blank object", "/segment", {"image_url": IMG, "object": " "}, 400, "object"),
    ("bad regex", "/query", {"question": "q", "regex": "(unclosed"}, 400, "regex"),
    (
        "negative temperature",
        "/query",
        {"question": "q", "settings": {"temperature": -1}},
        400,
        "settings.temperature",
    ),
    (
        "beyond the context",
        "/caption",
        {"image_url": IMG, "settings": {"max_tokens": 2000}},
        422,
        "settings.max_tokens",
    ),
]


@pytest.mark.parametrize(("case", "path", "body", "status", "field"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_4xx_naming_the_field(
    server: ServerThread, case: str, path: str, body: Any, status: int, field: str
) -> None:
    got, headers, raw = post(f"{server.http_url}{path}", body)
    assert got == status, raw
    error = json.loads(raw)["error"]
    assert error["field"] == field
    assert error["message"].startswith(f"{field}:") or field.split(".")[-1] in error["message"]
    assert json.loads(raw)["request_id"] == headers["X-Request-Id"]
    if case.startswith("remote"):
        assert "data URL" in error["message"] and "not fetched" in error["message"]
    if case == "variant":
        assert "this model" in error["message"] or "this server" in error["message"]


SAME_AS_GRPC = [
    ({"settings": {"temperature": -0.1}}, {"temperature": -0.1}, 400),
    ({"settings": {"top_p": 1.5}}, {"top_p": 1.5}, 400),
    ({"settings": {"max_tokens": 0}}, {"max_tokens": 0}, 400),
    ({"settings": {"max_tokens": 100_000}}, {"max_tokens": 100_000}, 422),
    ({"settings": {"max_tokens": 2**31 - 1}}, {"max_tokens": 2**31 - 1}, 422),
    ({"settings": {"max_objects": 0}}, {"max_objects": 0}, 400),
]
CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 422: grpc.StatusCode.OUT_OF_RANGE}


@pytest.mark.parametrize(("http", "grpc_settings", "status"), SAME_AS_GRPC)
def test_both_doors_share_one_validation(
    server: ServerThread, http: dict[str, Any], grpc_settings: dict[str, Any], status: int
) -> None:
    got, answer = post_json(f"{server.http_url}/point", {"image_url": IMG, "object": "a", **http})
    with VisionLanguageClient(server.target, timeout=60) as client, pytest.raises(VlmError) as e:
        client.point(sample_image_bytes(), "a", **grpc_settings)
    assert e.value.code == CODES[status] and got == status
    assert (answer["error"]["field"], answer["error"]["message"]) == (
        e.value.field,
        e.value.message,
    )
    # The picture's errors too, under the name each door's clients use.
    bad = b"\x00garbage" * 64
    status, answer = post_json(
        f"{server.http_url}/point", {"image_url": data_url(bad), "object": "a"}
    )
    with VisionLanguageClient(server.target, timeout=60) as client, pytest.raises(VlmError) as e:
        client.point(bad, "a")
    assert answer["error"]["message"] == e.value.message.replace("image_bytes", "image_url", 1)


def _raw(server: ServerThread, head: bytes, body: bytes = b"") -> bytes:
    """Send a raw request head and (part of) a body; the response read until the server
    closes the connection, without sending anything more."""
    assert server.server is not None
    with socket.create_connection(("127.0.0.1", server.server.http_port), timeout=30) as sock:
        sock.sendall(head + body)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
            if b"\r\n\r\n" in b"".join(chunks):
                break
        return b"".join(chunks)


def test_an_oversized_body_gets_413_before_it_is_read_whole(server: ServerThread) -> None:
    # A declared length beyond the limit: answered after the head, the body never sent.
    head = (
        b"POST /v1/caption HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % (BODY_LIMIT + 1)
    )
    answer = _raw(server, head, b'{"image_url": "data:')
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    # A chunked body: refused once it passes the limit, though it never ends.
    head = (
        b"POST /v1/caption HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    piece = b"x" * 65536
    chunk = b"%x\r\n%s\r\n" % (len(piece), piece)
    answer = _raw(server, head, chunk * (BODY_LIMIT // len(piece) + 1))
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    status, error = post_json(f"{server.http_url}/query", {"question": "q" * (BODY_LIMIT + 10)})
    assert status == 413 and error["error"]["field"] == "body"
    assert str(BODY_LIMIT) in error["error"]["message"]


def test_unknown_routes_and_methods_answer_json(server: ServerThread) -> None:
    status, error = post_json(f"{server.http_url}/ocr", {"image_url": IMG})
    assert status == 404 and error["error"]["code"] == "NOT_FOUND"
    request = urllib.request.Request(f"{server.http_url}/caption", method="GET")
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=10)
    assert caught.value.code == 405 and "POST" in caught.value.headers["Allow"]
    assert json.loads(caught.value.read())["error"]["code"]


# ---- disconnects, deadlines --------------------------------------------------------------------


def _stream_then_hang_up(server: ServerThread, body: dict[str, Any], rid: str, path: str) -> None:
    """Start a streamed request, read two events, close the connection."""
    assert server.server is not None
    data = json.dumps(body).encode()
    head = (
        f"POST /v1{path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"X-Request-Id: {rid}\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.server.http_port), timeout=30) as sock:
        sock.sendall(head + data)
        seen = b""
        while seen.count(b"data: ") < 2:
            chunk = sock.recv(4096)
            assert chunk, seen
            seen += chunk
        assert seen.startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/query", {"question": "tell me a long story", "stream": True}),
        ("/caption", {"image_url": IMG, "stream": True}),
        (
            "/chat/completions",
            {"messages": [{"role": "user", "content": "a long story"}], "stream": True},
        ),
    ],
    ids=["query", "caption", "chat"],
)
def test_a_client_that_hangs_up_mid_stream_frees_its_pages(
    server: ServerThread, path: str, body: dict[str, Any]
) -> None:
    engine = _engine(server)
    settings = {"temperature": 0, "max_tokens": LONG}
    body = {**body, **({"max_tokens": LONG} if "messages" in body else {"settings": settings})}
    rid = f"hang-up-{path.strip('/').replace('/', '-')}"
    gc.collect()
    gc.disable()  # nothing of the request may wait for the collector
    try:
        _stream_then_hang_up(server, body, rid, path)
        wait_for(lambda: rid in engine.outcomes, what="the engine to end the request")
        assert engine.outcomes[rid] == "CANCELLED"
        wait_for(lambda: engine.ended[rid]() is None, what="the request to be freed")
    finally:
        gc.enable()
    _settled(engine)
    assert server.server is not None
    wait_for(lambda: server.server.core.in_flight.count == 0, what="the handler to finish")


def test_a_deadline_gives_504_or_a_deadline_event(server: ServerThread) -> None:
    engine = _engine(server)
    body = {"question": "tell me a long story", "settings": {"temperature": 0, "max_tokens": LONG}}
    headers = {"X-Request-Timeout": "0.5", "X-Request-Id": "late-1"}
    status, error = post_json(f"{server.http_url}/query", body, headers=headers)
    assert status == 504 and error["error"]["code"] == "DEADLINE_EXCEEDED"
    headers["X-Request-Id"] = "late-2"
    status, _, raw = post(f"{server.http_url}/query", {**body, "stream": True}, headers=headers)
    assert status == 200
    streamed = events(raw)
    assert streamed[-1]["error"]["code"] == "DEADLINE_EXCEEDED"
    assert all("chunk" in e for e in streamed[:-1])
    for rid in ("late-1", "late-2"):
        wait_for(lambda rid=rid: rid in engine.outcomes, what="the engine to end the request")
        assert engine.outcomes[rid] in ("CANCELLED", "DEADLINE_EXCEEDED")
    _settled(engine)
    status, error = post_json(
        f"{server.http_url}/query", body, headers={"X-Request-Timeout": "soon"}
    )
    assert status == 400 and error["error"]["field"] == "X-Request-Timeout"


# ---- description and health --------------------------------------------------------------------


def test_openapi_describes_every_route(server: ServerThread) -> None:
    assert server.server is not None and server.server.http is not None
    base = server.http_url.removesuffix("/v1")
    with urllib.request.urlopen(f"{base}/openapi.json", timeout=10) as response:
        doc = json.loads(response.read())
    described = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    routed = {
        (r.method, r.resource.canonical)
        for r in server.server.http.app.router.routes()
        if r.method != "HEAD" and r.resource is not None
    }
    served = server.server.http.routes  # the door's own and the Batch API's
    assert described == routed == {(r.method, r.path) for r in served}
    assert served[: len(ROUTES)] == ROUTES
    for route in served:
        op = doc["paths"][route.path][route.method.lower()]
        if route.request is not None:
            schema = op["requestBody"]["content"]["application/json"]["schema"]
            assert set(schema["properties"]) == {f.name for f in route.request}
        assert ("text/event-stream" in op["responses"]["200"]["content"]) == route.streams


def test_the_server_is_healthy_after_all_that(server: ServerThread) -> None:
    status, answer = post_json(
        f"{server.http_url}/caption",
        {"image_url": IMG, "settings": {"temperature": 0, "max_tokens": 3}},
    )
    assert status == 200 and answer["finish_reason"] == "length"
    _settled(_engine(server))


# ---- admission limits ----------------------------------------------------------------------------

# A KV page of the tiny fp32 model: 16 positions x 2 layers x K and V x 64 floats x 4 bytes.
PAGE_BYTES = 16 * 2 * 2 * 64 * 4


def _small_png() -> bytes:
    # Small pictures tile to two crops: an image prefix of 730 positions (46 pages).
    picture = Image.new("RGB", (96, 64), (40, 120, 200))
    out = io.BytesIO()
    picture.save(out, format="PNG")
    return out.getvalue()


def test_a_full_queue_is_429_and_a_request_beyond_the_cache_413(tiny: LoadedModel) -> None:
    config = EngineConfig(max_batch_size=1, max_queue=1, kv_budget_bytes=60 * PAGE_BYTES)
    factory = in_process(lambda: GatedBatchedEngine(tiny, config))
    with ServerThread(local_config(http_port=-1), factory) as single:
        engine, url = _engine(single), single.http_url
        engine.token_gate.clear()
        try:
            pool = concurrent.futures.ThreadPoolExecutor(2)
            story = {"question": "a story", "settings": {"temperature": 0, "max_tokens": 40}}
            occupant = pool.submit(post_json, f"{url}/query", story)
            wait_for(engine.holding.is_set, what="the occupant's first token")
            queued = pool.submit(post_json, f"{url}/query", story)
            wait_for(lambda: engine.stats().queue_depth == 1, what="a queued request")
            status, headers, raw = post(f"{url}/query", story)
            error = json.loads(raw)
            assert status == 429 and error["error"]["code"] == "RESOURCE_EXHAUSTED"
            assert headers["Retry-After"] == "1"
            assert "queue is full" in error["error"]["message"]
        finally:
            engine.token_gate.set()
        assert occupant.result(60)[0] == queued.result(60)[0] == 200
        pool.shutdown()
        # The image prefix (46 pages) plus 300 tokens (19 pages) can never fit 59 pages.
        body = {"image_url": data_url(_small_png(), "image/png"), "settings": {"max_tokens": 300}}
        status, error = post_json(f"{url}/caption", body)
        assert status == 413 and error["error"]["field"] == "settings.max_tokens"
        assert "KV pages" in error["error"]["message"]
        _settled(engine)


# ---- loading and draining -----------------------------------------------------------------------


def test_loading_and_draining_answer_503_and_accepted_requests_finish(tiny: LoadedModel) -> None:
    engines: list[GatedBatchedEngine] = []

    def factory() -> GatedBatchedEngine:
        engine = GatedBatchedEngine(tiny, EngineConfig(kv_budget_bytes=16 * MIB))
        engine.start_gate.clear()
        engines.append(engine)
        return engine

    running = ServerThread(local_config(http_port=-1), in_process(factory)).start(wait_ready=False)
    try:
        url = running.http_url
        wait_for(lambda: engines, what="the engine to be created")
        engine = engines[0]
        status, error = post_json(f"{url}/query", {"question": "there?"})
        assert status == 503 and "loading" in error["error"]["message"]
        engine.start_gate.set()
        running.run(running.server.wait_ready())  # type: ignore[union-attr]

        engine.token_gate.clear()
        body = {"question": "a story", "stream": True, "settings": {"max_tokens": 12}}
        reader = concurrent.futures.ThreadPoolExecutor(1)
        first = reader.submit(post, f"{url}/query", body)
        reader.shutdown(wait=False)
        wait_for(engine.holding.is_set, what="the request to run")
        drained = running.submit(running.server.shutdown(30))  # type: ignore[union-attr]
        wait_for(lambda: running.server.core.draining, what="the drain")  # type: ignore[union-attr]
        status, error = post_json(f"{url}/query", {"question": "one more?"})
        assert status == 503 and error["error"]["code"] == "UNAVAILABLE"
        assert "draining" in error["error"]["message"]
        engine.token_gate.set()
        status, _, raw = first.result(60)
        drained.result(60)
    finally:
        for e in engines:
            e.start_gate.set()
            e.token_gate.set()
        running.stop()
    assert status == 200
    streamed = events(raw)
    assert streamed[-1]["completed"] is True and streamed[-1]["metrics"]["output_tokens"] == 12
    text = "".join(e["chunk"] for e in streamed)
    assert len(streamed) > 2 and text
