"""`ReferenceEngine` on its own: events, admission, deadlines, cancel, drain and close."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from image_pipeline import PreparedImage
from tests.support.service_harness import GatedReferenceEngine
from vlm_server.engine.api import (
    EngineError,
    ErrorCode,
    Finished,
    GenerationRequest,
    Task,
    TextDelta,
)
from vlm_server.engine.reference_engine import ReferenceEngine
from vlm_server.reference import ReferenceGenerator, SamplingSettings
from vlm_server.weights.loader import LoadedModel


async def until(predicate: Callable[[], Any], timeout: float = 20.0) -> None:
    """Poll without blocking the loop (events reach streams through it)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.005)


async def collect(stream: Any) -> list[Any]:
    return [event async for event in stream]


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 120))


def text_request(max_tokens: int = 400, **kwargs: Any) -> GenerationRequest:
    return GenerationRequest(
        task=Task.QUERY,
        image=None,
        question="tell me a story",
        temperature=0.0,
        max_tokens=max_tokens,
        **kwargs,
    )


def test_text_events_are_deltas_then_the_reference_result(
    tiny: LoadedModel, generator: ReferenceGenerator, sample_image: PreparedImage
) -> None:
    async def body() -> None:
        engine = ReferenceEngine(lambda: tiny)
        await engine.start()
        request = GenerationRequest(
            task=Task.CAPTION, image=sample_image, temperature=0.0, max_tokens=10
        )
        events = await collect(await engine.submit(request))
        await engine.close()
        want = generator.caption(
            sample_image, "normal", SamplingSettings(temperature=0.0, max_tokens=10)
        )
        assert all(isinstance(e, TextDelta) and e.text for e in events[:-1])
        done = events[-1]
        assert isinstance(done, Finished)
        assert "".join(e.text for e in events[:-1]) == done.text == want.text
        assert done.metrics.output_tokens == 10 and done.finish_reason == "length"
        assert engine.counts() == {"admitted": 1, "started": 1, "finished": 1}

    run(body)


def test_submit_checks_queue_limit_and_context(
    tiny: LoadedModel, sample_image: PreparedImage
) -> None:
    async def body() -> None:
        engine = GatedReferenceEngine(lambda: tiny, max_queue=1)
        with pytest.raises(EngineError) as caught:
            await engine.submit(text_request())
        assert caught.value.code == ErrorCode.UNAVAILABLE  # not started
        await engine.start()
        max_context = engine.info.max_context
        with pytest.raises(EngineError) as caught:
            await engine.submit(
                GenerationRequest(task=Task.CAPTION, image=sample_image, max_tokens=max_context)
            )
        assert caught.value.code == ErrorCode.OUT_OF_RANGE
        assert caught.value.field == "max_tokens"
        engine.token_gate.clear()
        running = await engine.submit(text_request())
        await until(engine.holding.is_set)
        queued = await engine.submit(text_request())
        with pytest.raises(EngineError) as caught:
            await engine.submit(text_request())
        assert caught.value.code == ErrorCode.RESOURCE_EXHAUSTED
        queued.cancel()
        assert engine.stats().queue_depth == 0  # the slot is free at once
        running.cancel()
        engine.token_gate.set()
        assert (await collect(running))[-1].finish_reason == "cancelled"
        await engine.close()

    run(body)


def test_deadline_passing_in_the_queue_fails_it_without_running(tiny: LoadedModel) -> None:
    async def body() -> None:
        engine = GatedReferenceEngine(lambda: tiny)
        await engine.start()
        engine.token_gate.clear()
        running = await engine.submit(text_request())
        await until(engine.holding.is_set)
        late = await engine.submit(text_request(deadline=time.monotonic() + 0.2))
        with pytest.raises(EngineError) as caught:
            await collect(late)  # fails while the worker is still held
        assert caught.value.code == ErrorCode.DEADLINE_EXCEEDED
        assert engine.counts()["started"] == 1
        already = await engine.submit(text_request(deadline=time.monotonic() - 1))
        with pytest.raises(EngineError):
            await collect(already)
        assert engine.counts()["expired_waiting"] == 2
        running.cancel()
        engine.token_gate.set()
        await collect(running)
        await engine.drain(10)
        assert engine.counts()["started"] == 1
        await engine.close()

    run(body)


def test_deadline_passing_while_running_stops_between_tokens(tiny: LoadedModel) -> None:
    async def body() -> None:
        engine = GatedReferenceEngine(lambda: tiny)
        await engine.start()
        engine.token_gate.clear()
        deadline = time.monotonic() + 0.3
        stream = await engine.submit(text_request(deadline=deadline))
        await until(engine.holding.is_set)
        await until(lambda: time.monotonic() > deadline)
        engine.token_gate.set()
        with pytest.raises(EngineError) as caught:
            await collect(stream)
        assert caught.value.code == ErrorCode.DEADLINE_EXCEEDED
        await until(lambda: engine.stats().active_sequences == 0)
        await engine.close()

    run(body)


def test_drain_refuses_new_work_and_waits_for_accepted(tiny: LoadedModel) -> None:
    async def body() -> None:
        engine = GatedReferenceEngine(lambda: tiny)
        await engine.start()
        engine.token_gate.clear()
        first = await engine.submit(text_request(max_tokens=5))
        await until(engine.holding.is_set)
        second = await engine.submit(text_request(max_tokens=5))
        drain = asyncio.create_task(engine.drain(30))
        await until(lambda: engine._draining)
        with pytest.raises(EngineError) as caught:
            await engine.submit(text_request())
        assert caught.value.code == ErrorCode.UNAVAILABLE
        assert not drain.done()
        engine.token_gate.set()
        results = await asyncio.gather(collect(first), collect(second))
        await drain
        assert [r[-1].finish_reason for r in results] == ["length", "length"]
        await engine.close()

    run(body)


def test_close_fails_what_is_left_with_unavailable(tiny: LoadedModel) -> None:
    async def body() -> None:
        engine = GatedReferenceEngine(lambda: tiny)
        await engine.start()
        engine.token_gate.clear()
        running = await engine.submit(text_request())
        await until(engine.holding.is_set)
        queued = await engine.submit(text_request())
        await engine.drain(0.05)  # the grace period runs out
        closing = asyncio.create_task(engine.close())
        engine.token_gate.set()
        await closing
        for stream in (running, queued):
            with pytest.raises(EngineError) as caught:
                await collect(stream)
            assert caught.value.code == ErrorCode.UNAVAILABLE

    run(body)


def test_a_model_that_fails_to_load_fails_start() -> None:
    def broken() -> LoadedModel:
        raise OSError("no such checkpoint")

    async def body() -> None:
        with pytest.raises(OSError, match="no such checkpoint"):
            await ReferenceEngine(broken).start()

    run(body)
