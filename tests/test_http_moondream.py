"""Moondream's HTTP API end to end (tiny model, batched engine): the official ``moondream``
Python client, unmodified, for every method and stream; answers equal the reference
generation; the same image cache, metrics and auth behind the HTTP door as behind gRPC."""

from __future__ import annotations

import base64
import io
import urllib.error
import urllib.request
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
from PIL import Image, ImageDraw

from image_pipeline import PreparedImage, prepare_image, sample_image_bytes
from tests.http_support import data_url, events, moondream_client, post, post_json
from tests.support.service_harness import ServerThread, in_process, local_config, wait_for
from vlm_server.client import VisionLanguageClient
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.engine import BatchedEngine
from vlm_server.models.interface import LoadedModel
from vlm_server.reference import ReferenceGenerator, SamplingSettings

MIB = 1 << 20
DOORS = ("http", "grpc")


@pytest.fixture(scope="module")
def server(tiny: LoadedModel) -> Iterator[ServerThread]:
    config = EngineConfig(max_batch_size=8, max_queue=100, kv_budget_bytes=16 * MIB)
    factory = in_process(lambda: BatchedEngine(tiny, config))
    with ServerThread(local_config(http_port=-1), factory) as running:
        yield running


@pytest.fixture(scope="module")
def md(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    cache = getattr(pytestconfig, "cache", None)  # None without the cache plugin
    where = cache.mkdir("clients") if cache is not None else tmp_path_factory.mktemp("clients")
    return moondream_client(where)


@pytest.fixture(scope="module")
def model(md: ModuleType, server: ServerThread) -> Any:
    return md.vl(endpoint=server.http_url)


@pytest.fixture(scope="module")
def sent(model: Any) -> tuple[Any, PreparedImage]:
    """The sample picture as the official client sends it (its own JPEG), and as prepared."""
    encoded = model.encode_image(Image.open(io.BytesIO(sample_image_bytes())))
    payload = encoded.image_url.split(",", 1)[1]
    return encoded, prepare_image(base64.b64decode(payload))


def _greedy(max_tokens: int) -> SamplingSettings:
    return SamplingSettings(temperature=0.0, max_tokens=max_tokens)


GREEDY6 = {"temperature": 0, "max_tokens": 6}


def _region(values: tuple[float, float, float, float]) -> dict[str, float]:
    return dict(zip(("x_min", "y_min", "x_max", "y_max"), values, strict=True))


def test_caption_with_the_official_client_equals_the_reference(
    model: Any, sent: tuple[Any, PreparedImage], generator: ReferenceGenerator
) -> None:
    image, prepared = sent
    for length in ("short", "normal", "long"):
        want = generator.caption(prepared, length, _greedy(6)).text
        assert model.caption(image, length, settings=GREEDY6)["caption"] == want
    # Long enough that a reader falling behind (its queued deltas arrive merged, by design)
    # still sees the answer in more than one piece on a busy machine.
    settings = {"temperature": 0, "max_tokens": 48}
    chunks = list(model.caption(image, "normal", stream=True, settings=settings)["caption"])
    assert "".join(chunks) == generator.caption(prepared, "normal", _greedy(48)).text
    assert len([c for c in chunks if c]) > 1  # really streamed, piece by piece


def test_query_with_and_without_a_picture_equals_the_reference(
    model: Any, sent: tuple[Any, PreparedImage], generator: ReferenceGenerator
) -> None:
    image, prepared = sent
    want = generator.query(prepared, "what is this?", _greedy(6)).text
    assert model.query(image, "what is this?", settings=GREEDY6)["answer"] == want
    streamed = model.query(image, "what is this?", stream=True, settings=GREEDY6)["answer"]
    assert "".join(streamed) == want
    no_image = generator.query(None, "tell me a story", _greedy(8)).text
    settings = {"temperature": 0, "max_tokens": 8}
    assert model.query(question="tell me a story", settings=settings)["answer"] == no_image


def test_point_and_detect_equal_the_reference(
    model: Any, sent: tuple[Any, PreparedImage], generator: ReferenceGenerator
) -> None:
    image, prepared = sent
    points = model.point(image, "ball", settings={"max_objects": 4})["points"]
    want = generator.point(prepared, "ball", max_objects=4).points
    assert points == [{"x": p.x, "y": p.y} for p in want]
    boxes = model.detect(image, "house", settings={"max_objects": 4})["objects"]
    want_boxes = generator.detect(prepared, "house", max_objects=4).boxes
    assert boxes == [_region((b.x_min, b.y_min, b.x_max, b.y_max)) for b in want_boxes]


def test_segment_answers_and_streams_the_reference_outline(
    model: Any, sent: tuple[Any, PreparedImage], generator: ReferenceGenerator
) -> None:
    image, prepared = sent
    want, _ = generator.segment(prepared, "house", 32)
    box = _region(want.box)
    got = model.segment(image, "house", settings={"max_tokens": 32})
    assert got == {"path": want.path, "bbox": box}
    updates = list(model.segment(image, "house", stream=True, settings={"max_tokens": 32}))
    assert updates[0] == {"bbox": box}
    assert "".join(u.get("chunk", "") for u in updates[1:-1]) == want.path
    assert updates[-1] == {"path": want.path, "bbox": box, "completed": True}


def test_answers_carry_the_request_id_finish_reason_and_metrics(
    server: ServerThread, sent: tuple[Any, PreparedImage]
) -> None:
    image, _ = sent
    body = {"image_url": image.image_url, "question": "why?", "settings": GREEDY6}
    status, headers, raw = post(
        f"{server.http_url}/query", body, headers={"X-Request-Id": "mine-1"}
    )
    assert status == 200 and headers["X-Request-Id"] == "mine-1"
    status, answer = post_json(f"{server.http_url}/query", body)
    assert answer["request_id"] and answer["finish_reason"] == "length"
    m = answer["metrics"]
    assert m["output_tokens"] == 6 and m["input_tokens"] > 0
    assert 0 < m["ttft_ms"] <= m["total_time_ms"] and m["prefill_time_ms"] > 0
    assert m["cached_tokens"] > 0  # the picture's prefix from the first request
    assert m["prefix_wait_ms"] == 0 and 0 < m["intake_time_ms"] < m["total_time_ms"]
    # Streamed: chunk events with the request id, then one completion event with the rest.
    _, _, raw = post(f"{server.http_url}/query", {**body, "stream": True})
    streamed = events(raw)
    assert all(e["completed"] is False and e["request_id"] for e in streamed[:-1])
    last = streamed[-1]
    assert last["completed"] is True and last["chunk"] == "" and last["finish_reason"] == "length"
    assert last["metrics"]["output_tokens"] == 6


def _unique_png() -> bytes:
    picture = Image.new("RGB", (90, 70), (10, 200, 60))
    ImageDraw.Draw(picture).rectangle([5, 5, 40, 30], fill=(250, 20, 20))
    out = io.BytesIO()
    picture.save(out, format="PNG")
    return out.getvalue()


def test_a_picture_sent_over_http_is_in_the_cache_grpc_uses(server: ServerThread) -> None:
    """The HTTP request decodes the picture into the shared cache; the gRPC upload of the same
    bytes then finds it there without decoding again (``already_cached`` stays false: that
    flag means an earlier EncodeImage upload)."""
    png = _unique_png()
    assert server.server is not None
    images = server.server.core.images
    body = {"image_url": data_url(png, "image/png"), "object": "box"}
    assert post_json(f"{server.http_url}/point", body)[0] == 200
    key = prepare_image(png).content_hash
    assert images.cache.get(key) is not None
    hits = images.encoding_hits
    with VisionLanguageClient(server.target, timeout=60) as client:
        encoded = client.encode_image(png)
    assert encoded.image_id == key and images.encoding_hits == hits + 1
    assert not encoded.already_cached


def test_metrics_are_labelled_by_door(server: ServerThread) -> None:
    assert post_json(f"{server.http_url}/query", {"question": "hi", "settings": GREEDY6})[0] == 200
    with VisionLanguageClient(server.target, timeout=60) as client:
        client.query(None, "hi", temperature=0, max_tokens=2)
    lines = [f'vlm_requests_total{{code="OK",door="{door}",task="query"}}' for door in DOORS]

    def counted() -> str:
        with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
            text = str(response.read().decode())
        return text if all(line in text for line in lines) else ""

    # A streamed gRPC call is counted when its handler ends, just after the client has read
    # the last message: poll.
    text = wait_for(counted, what="both doors' requests counted")
    assert 'vlm_requests_in_flight{door="http"} 0.0' in text


def test_an_api_key_is_checked_when_the_server_wants_one(md: ModuleType, tiny: LoadedModel) -> None:
    factory = in_process(
        lambda: BatchedEngine(tiny, EngineConfig(max_batch_size=1, kv_budget_bytes=4 * MIB))
    )
    config = local_config(http_port=-1)
    with ServerThread(config, factory, http_auth=lambda key: key == "s3cret") as running:
        settings = {"temperature": 0, "max_tokens": 2}
        ok = md.vl(endpoint=running.http_url, api_key="s3cret")
        assert ok.query(question="hi", settings=settings)["answer"]
        for key in (None, "wrong"):
            with pytest.raises(urllib.error.HTTPError) as caught:
                md.vl(endpoint=running.http_url, api_key=key).query(question="hi")
            assert caught.value.code == 401
        # OpenAI clients send the key as a bearer token.
        headers = {"Authorization": "Bearer s3cret"}
        status, _ = post_json(f"{running.http_url}/query", {"question": "hi"}, headers=headers)
        assert status == 200
