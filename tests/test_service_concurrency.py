"""Many clients at once, cancellation, deadlines and admission limits, over real gRPC.

On the batched engine: 64 concurrent clients get the reference
answers; a cancelled or expired request gives back every KV page; a request whose deadline
passes while queued never runs; a full queue and a request beyond the KV cache are refused.

No sleeps: `GatedBatchedEngine` holds the engine at a known point while
the test arranges the queue, and `wait_for` polls. The tiny model practically never emits eos,
so a long request really runs long.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import io
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from PIL import Image, ImageDraw

from image_pipeline import prepare_image
from tests.support.service_harness import (
    GatedBatchedEngine,
    ServerThread,
    engine_of,
    in_process,
    local_config,
    wait_for,
)
from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.api.v1 import vision_language_pb2_grpc as pb_grpc
from vlm_server.client import AsyncVisionLanguageClient, VisionLanguageClient, VlmError
from vlm_server.client.types import Box, DetectResult, Point, PointResult, TextResult
from vlm_server.engine.config import EngineConfig
from vlm_server.models.interface import LoadedModel
from vlm_server.reference import ReferenceGenerator, SamplingSettings

CLIENTS = 64
MIB = 1 << 20
# A KV page of the tiny fp32 model: 16 positions x 2 layers x K and V x 64 floats x 4 bytes.
PAGE_BYTES = 16 * 2 * 2 * 64 * 4
# The single-slot server's cache: 60 pages (one is the sink), 944 positions: a long text-only
# query fits, an image prefix (730 positions, 46 pages) plus 300 tokens does not.
SINGLE_PAGES = 60
LONG_QUERY_TOKENS = 900  # 57 pages; runs for seconds on the CPU, far beyond any wait here
LONG_CAPTION_TOKENS = 1300  # with the image prefix: nearly the whole 2048-position context


def _small_image() -> bytes:
    # Small pictures tile to two crops: the concurrency test stays fast on two cores.
    image = Image.new("RGB", (96, 64), (40, 120, 200))
    ImageDraw.Draw(image).ellipse([20, 10, 60, 50], fill=(240, 200, 30))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


SMALL = _small_image()


def _expected_text(
    ids: list[int], max_tokens: int, generator: ReferenceGenerator
) -> tuple[str, str]:
    """Greedy output for ``max_tokens`` from a longer greedy run: a prefix of it ("length"),
    or all of it when the run ended with eos sooner."""
    if max_tokens <= len(ids):
        return generator.tokenizer.decode(ids[:max_tokens]), "length"
    return generator.tokenizer.decode(ids), "eos"


def _specs() -> list[dict[str, Any]]:
    objects = ["cat", "dog", "car", "tree"]
    specs = []
    for i in range(CLIENTS):
        kind = i % 4
        if kind == 0:
            specs.append(
                {
                    "task": "caption",
                    "length": ["short", "normal", "long"][i // 4 % 3],
                    "max_tokens": 1 + i // 4 % 4,
                }
            )
        elif kind == 1:
            specs.append(
                {
                    "task": "query",
                    "question": f"question number {i}?",
                    "max_tokens": 3,
                    "image": i % 8 == 1,
                }
            )
        else:
            specs.append(
                {
                    "task": "point" if kind == 2 else "detect",
                    "object": objects[i // 4 % 4],
                    "max_objects": 3,
                }
            )
    return specs


def _expected(spec: dict[str, Any], generator: ReferenceGenerator, cache: dict[Any, Any]) -> Any:
    image = cache.setdefault("image", prepare_image(SMALL))
    if spec["task"] == "caption":
        key = ("caption", spec["length"])
        if key not in cache:
            cache[key] = generator.caption(
                image, spec["length"], SamplingSettings(temperature=0, max_tokens=4)
            )
        run = cache[key]
        return _expected_text(run.token_ids, spec["max_tokens"], generator)
    if spec["task"] == "query":
        run = generator.query(
            image if spec["image"] else None,
            spec["question"],
            SamplingSettings(temperature=0, max_tokens=spec["max_tokens"]),
        )
        return run.text, run.finish_reason
    key = (spec["task"], spec["object"])
    if key not in cache:
        fn = generator.point if spec["task"] == "point" else generator.detect
        cache[key] = fn(image, spec["object"], spec["max_objects"])
    run = cache[key]
    if spec["task"] == "point":
        return [Point(p.x, p.y) for p in run.points], run.finish_reason
    return [Box(b.x_min, b.y_min, b.x_max, b.y_max) for b in run.boxes], run.finish_reason


async def _one(target: str, spec: dict[str, Any], uploaded: Any) -> Any:
    async with AsyncVisionLanguageClient(target, timeout=120) as client:
        if spec["task"] == "caption":
            r: Any = await client.caption(
                uploaded, spec["length"], temperature=0, max_tokens=spec["max_tokens"]
            )
        elif spec["task"] == "query":
            r = await client.query(
                SMALL if spec["image"] else None,
                spec["question"],
                temperature=0,
                max_tokens=spec["max_tokens"],
            )
        elif spec["task"] == "point":
            r = await client.point(SMALL, spec["object"], max_objects=spec["max_objects"])
        else:
            r = await client.detect(uploaded, spec["object"], max_objects=spec["max_objects"])
    return r


async def _all(target: str, specs: list[dict[str, Any]]) -> list[Any]:
    async with AsyncVisionLanguageClient(target, timeout=60) as client:
        uploaded = await client.encode_image(SMALL)
    return await asyncio.gather(*(_one(target, s, uploaded) for s in specs))


@pytest.fixture(scope="module")
def batched(tiny: LoadedModel) -> Iterator[ServerThread]:
    config = EngineConfig(max_batch_size=16, max_queue=CLIENTS, kv_budget_bytes=16 * MIB)
    with ServerThread(
        local_config(), in_process(lambda: GatedBatchedEngine(tiny, config))
    ) as running:
        yield running


@pytest.fixture(scope="module")
def batched_stub(batched: ServerThread) -> Iterator[pb_grpc.VisionLanguageStub]:
    with grpc.insecure_channel(batched.target) as channel:
        yield pb_grpc.VisionLanguageStub(channel)


@pytest.fixture(scope="module")
def single(tiny: LoadedModel) -> Iterator[ServerThread]:
    """One sequence at a time, one waiting, a small KV cache."""
    config = EngineConfig(max_batch_size=1, max_queue=1, kv_budget_bytes=SINGLE_PAGES * PAGE_BYTES)
    with ServerThread(
        local_config(), in_process(lambda: GatedBatchedEngine(tiny, config))
    ) as running:
        yield running


@pytest.fixture(scope="module")
def single_stub(single: ServerThread) -> Iterator[pb_grpc.VisionLanguageStub]:
    with grpc.insecure_channel(single.target) as channel:
        yield pb_grpc.VisionLanguageStub(channel)


def _batched(server: ServerThread) -> GatedBatchedEngine:
    engine = engine_of(server)
    assert isinstance(engine, GatedBatchedEngine)
    return engine


@contextlib.contextmanager
def _held(engine: GatedBatchedEngine) -> Iterator[None]:
    """Hold every text token until the block ends (the gate always reopens)."""
    engine.token_gate.clear()
    try:
        yield
    finally:
        engine.token_gate.set()


def _settled(engine: GatedBatchedEngine) -> None:
    """Wait until the engine is idle, then check that only cached image prefixes hold pages;
    dropping them frees the whole cache."""
    wait_for(engine.idle, what="an idle engine")
    pages = engine.scheduler.pages
    assert pages.used_pages == engine.cached_prefix_pages()
    engine.scheduler.prefix_cache.clear()  # idle: the scheduler thread is waiting
    assert pages.used_pages == 0


def _rid(name: str) -> tuple[tuple[str, str], ...]:
    return (("x-request-id", name),)


def _long_query(max_tokens: int = 400) -> pb.QueryRequest:
    return pb.QueryRequest(
        question="tell me a long story",
        settings=pb.GenerationSettings(temperature=0, max_tokens=max_tokens),
    )


def _long_caption() -> pb.CaptionRequest:
    return pb.CaptionRequest(
        image_bytes=SMALL,
        settings=pb.GenerationSettings(temperature=0, max_tokens=LONG_CAPTION_TOKENS),
    )


# ---- many clients (batched engine) --------------------------------------------------------


def test_64_concurrent_clients_get_their_own_answers(
    batched: ServerThread, generator: ReferenceGenerator
) -> None:
    engine = _batched(batched)
    specs = _specs()
    results = asyncio.run(_all(batched.target, specs))
    cache: dict[Any, Any] = {}
    assert len(results) == CLIENTS
    for spec, got in zip(specs, results, strict=True):
        want = _expected(spec, generator, cache)
        if isinstance(got, TextResult):
            assert (got.text, got.finish_reason) == want, spec
        elif isinstance(got, PointResult):
            assert (got.points, got.finish_reason) == want, spec
        else:
            assert isinstance(got, DetectResult)
            assert (got.boxes, got.finish_reason) == want, spec
    assert engine.largest_batch > 1  # the requests really shared decode steps
    _settled(engine)


# ---- cancellation and deadlines (batched engine) ------------------------------------------


def test_cancel_mid_stream_frees_the_pages(
    batched: ServerThread, batched_stub: pb_grpc.VisionLanguageStub
) -> None:
    engine = _batched(batched)
    call = batched_stub.Caption(_long_caption(), timeout=60, metadata=_rid("cancel-me"))
    first = [next(call) for _ in range(3)]  # it runs: three deltas streamed
    assert [m.WhichOneof("event") for m in first] == ["delta"] * 3
    call.cancel()
    with pytest.raises(grpc.RpcError) as caught:
        list(call)
    assert caught.value.code() == grpc.StatusCode.CANCELLED
    wait_for(lambda: "cancel-me" in engine.outcomes, what="the engine to end the request")
    assert engine.outcomes["cancel-me"] == "CANCELLED"
    # The image prefix stays cached for reuse: once the request's last in-flight step
    # has committed, which can come after its outcome is recorded (an order, not a time).
    wait_for(lambda: engine.cached_prefix_pages() > 0, what="the image prefix cached")
    _settled(engine)


def test_a_cancelled_request_is_freed_without_a_garbage_collection(
    batched: ServerThread, batched_stub: pb_grpc.VisionLanguageStub
) -> None:
    """Nothing of a cancelled request (its sequence, image, stream) waits for the collector:
    gRPC's call state is a reference cycle, so the server must not hold the request from it."""
    engine = _batched(batched)
    gc.collect()
    gc.disable()
    try:
        call = batched_stub.Caption(_long_caption(), timeout=60, metadata=_rid("free-me"))
        assert next(call).WhichOneof("event") == "delta"
        call.cancel()
        with pytest.raises(grpc.RpcError):
            list(call)
        wait_for(lambda: "free-me" in engine.outcomes, what="the engine to end the request")
        wait_for(lambda: engine.ended["free-me"]() is None, what="the request to be freed")
    finally:
        gc.enable()
    _settled(engine)


def test_deadline_while_running_stops_the_request(
    batched: ServerThread, batched_stub: pb_grpc.VisionLanguageStub
) -> None:
    engine = _batched(batched)
    # Held once it streams its first token, so it cannot finish before its deadline however
    # fast or slow the machine is (no bet on how long a caption takes).
    with _held(engine):
        call = batched_stub.Caption(_long_caption(), timeout=2.0, metadata=_rid("too-slow"))
        with pytest.raises(grpc.RpcError) as caught:
            list(call)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: "too-slow" in engine.outcomes, what="the engine to end the request")
    # The server cancels the call's request, or the engine sees the deadline first.
    assert engine.outcomes["too-slow"] in ("CANCELLED", "DEADLINE_EXCEEDED")
    _settled(engine)


def test_deadline_while_queued_never_runs_the_request(
    single: ServerThread, single_stub: pb_grpc.VisionLanguageStub
) -> None:
    engine = _batched(single)
    running = single_stub.Query(
        _long_query(LONG_QUERY_TOKENS), timeout=60, metadata=_rid("occupant")
    )
    with _held(engine):  # the occupant holds the one slot until the late one expires
        assert next(running).WhichOneof("event") == "delta"
        wait_for(engine.holding.is_set, what="the occupant to be held")
        assert engine.held_requests == ("occupant",)
        late = single_stub.Query(_long_query(4), timeout=1.0, metadata=_rid("late"))
        with pytest.raises(grpc.RpcError) as caught:
            list(late)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        running.cancel()
    wait_for(
        lambda: len(engine.outcomes.keys() & {"late", "occupant"}) == 2,
        what="the engine to end both requests",
    )
    assert engine.outcomes["late"] in ("CANCELLED", "DEADLINE_EXCEEDED")
    assert engine.outcomes["occupant"] == "CANCELLED"
    assert "occupant" in engine.prefilled and "late" not in engine.prefilled  # never ran
    _settled(engine)


def test_full_queue_is_resource_exhausted(
    single: ServerThread, single_stub: pb_grpc.VisionLanguageStub
) -> None:
    engine = _batched(single)
    with _held(engine), VisionLanguageClient(single.target, timeout=30) as client:
        running = single_stub.Query(_long_query(LONG_QUERY_TOKENS), timeout=60)
        wait_for(engine.holding.is_set, what="the first token")
        queued = single_stub.Query(_long_query(4), timeout=60)
        wait_for(lambda: engine.stats().queue_depth == 1, what="a queued request")
        with pytest.raises(VlmError) as caught:
            client.query(None, "one more?", max_tokens=2)
        assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue is full" in caught.value.message
        running.cancel()
    assert list(queued)[-1].result.finish_reason == pb.FINISH_REASON_LENGTH
    _settled(engine)


def test_request_beyond_the_kv_cache_is_resource_exhausted(single: ServerThread) -> None:
    # The image prefix (46 pages) plus 300 tokens (19 pages) cannot fit 59 pages.
    with (
        VisionLanguageClient(single.target, timeout=30) as client,
        pytest.raises(VlmError) as caught,
    ):
        client.caption(SMALL, max_tokens=300)
    assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert caught.value.field == "settings.max_tokens"
    assert "KV pages" in caught.value.message
    _settled(_batched(single))


def test_request_that_fits_the_kv_cache_is_admitted(single: ServerThread) -> None:
    # 730 + 5 prompt + 30 positions: 46 pages of prefix and 3 of its own.
    with VisionLanguageClient(single.target, timeout=30) as client:
        got = client.caption(SMALL, max_tokens=30, temperature=0)
    assert got.finish_reason == "length" and got.metrics.output_tokens == 30
