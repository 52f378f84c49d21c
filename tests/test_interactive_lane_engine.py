"""The interactive prefill lane in the engine, on the CPU and on CUDA: interactive pictures
arriving while background captions stream take the lane (on CUDA its own stream, graphs and
buffers, ahead of the steps), and every answer, background and interactive, equals the
reference's."""

from __future__ import annotations

import asyncio

import pytest

from image_pipeline import PreparedImage, prepare_pil, sample_image
from tests.test_engine import (
    _collect,
    _engine,
    _reference_text,
    _wait_idle,
)
from tests.test_engine_gpu import _cuda
from vlm_server.engine.api import BATCH_PRIORITY, Finished, GenerationRequest, Task, TextDelta
from vlm_server.models.interface import LoadedModel
from vlm_server.reference import ReferenceGenerator


def _pictures(n: int, offset: int) -> list[PreparedImage]:
    base = sample_image()
    return [prepare_pil(base.resize((160 + 9 * (k + offset), 120 + 5 * k))) for k in range(n)]


def test_interactive_pictures_under_background_captions_take_the_lane_cpu(
    text_model: LoadedModel,
) -> None:
    _lane_run(text_model, 2, 60)


@pytest.mark.gpu
@pytest.mark.parametrize("depth", [1, 2])
def test_interactive_pictures_under_background_captions_take_the_lane_cuda(
    text_model: LoadedModel,
    depth: int,
) -> None:
    loaded = _cuda(text_model)
    _lane_run(loaded, depth, 200)


def _lane_run(loaded: LoadedModel, depth: int, caption_tokens: int) -> None:
    background = [
        GenerationRequest(
            Task.CAPTION,
            image,
            request_id=f"bg{i}",
            caption_length="long",
            temperature=0,
            max_tokens=caption_tokens,
            priority=BATCH_PRIORITY,
        )
        for i, image in enumerate(_pictures(6, 0))
    ]
    interactive = [
        GenerationRequest(
            Task.QUERY,
            image,
            request_id=f"q{i}",
            question="what is it?",
            temperature=0,
            max_tokens=6,
        )
        for i, image in enumerate(_pictures(4, 40))
    ]
    lanes: list[bool] = []

    async def streaming(engine: object, req: GenerationRequest, started: asyncio.Event) -> Finished:
        async for event in await engine.submit(req):  # type: ignore[attr-defined]
            if isinstance(event, TextDelta):
                started.set()
            elif isinstance(event, Finished):
                return event
        raise AssertionError("stream ended without Finished")

    async def run() -> tuple[list[Finished], list[Finished]]:
        engine = _engine(loaded, depth, kv_budget_bytes=256 << 20, background_reserved_rows=2)
        rt = engine.batched.runtime
        launch = rt.launch_prefixes

        def recording(jobs: list, partitioned: bool = False, interactive: bool = False) -> object:
            lanes.append(interactive)
            return launch(jobs, partitioned, interactive)

        rt.launch_prefixes = recording  # type: ignore[method-assign]
        await engine.start()
        try:
            lane = rt.interactive_prefill
            assert lane is not None
            if rt.dev.is_cuda:  # graphs of its own, captured on its stream
                assert lane.prefix_graphs and lane.image_graphs
            started = asyncio.Event()
            bg = [asyncio.create_task(streaming(engine, r, started)) for r in background]
            await started.wait()
            fg = await asyncio.gather(*[_collect(engine, r) for r in interactive])
            done = await asyncio.gather(*bg)
            await _wait_idle(engine)
            return list(done), [fin for _, fin in fg]
        finally:
            await engine.close()

    done, answers = asyncio.run(run())
    assert True in lanes and False in lanes
    ref = ReferenceGenerator(loaded.model, loaded.tokenizer)
    for req, fin in zip(background + interactive, done + answers, strict=True):
        assert fin.text == _reference_text(ref, req), req.request_id
