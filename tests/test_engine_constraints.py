"""Client constraints through the engine: errors name `choices` / `regex`, compile time is
bounded, mask-table rows are reclaimed once requests end (the device copy re-uploaded), and a
regex whose only answer is the empty string answers at once."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from decoding.limits import ConstraintLimits
from image_pipeline import PreparedImage
from tests.support.threads import one_torch_thread  # noqa: F401  (autouse)
from vlm_server.engine.api import EngineError, ErrorCode, Finished, GenerationRequest, Task
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.engine import BatchedEngine
from vlm_server.engine.requests.tasks import TaskCompiler
from vlm_server.models.interface import LoadedModel
from vlm_server.reference import ReferenceGenerator, SamplingSettings
from vlm_server.server.in_process import InProcessEngine


def _query(**kw: object) -> GenerationRequest:
    options: dict = {"question": "which?", "temperature": 0.0, "max_tokens": 8, **kw}
    return GenerationRequest(Task.QUERY, None, **options)


async def _answer(engine: InProcessEngine, req: GenerationRequest) -> Finished:
    async for event in await engine.submit(req):
        if isinstance(event, Finished):
            return event
    raise AssertionError("stream ended without Finished")


async def _wait_idle(engine: InProcessEngine, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not engine.batched.idle():
        assert time.monotonic() < end, "engine did not become idle"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize(
    ("req", "code", "field"),
    [
        (_query(choices=("x" * 2000,)), ErrorCode.INVALID_ARGUMENT, "choices"),
        (_query(choices=("yes",) * 2000), ErrorCode.INVALID_ARGUMENT, "choices"),
        (_query(regex="a" * 2000), ErrorCode.INVALID_ARGUMENT, "regex"),
        (_query(regex="(a|b)*a(a|b){12}"), ErrorCode.INVALID_ARGUMENT, "regex"),
        # The answer cannot fit max_tokens: refused naming the constraint, never `task`.
        (_query(choices=("abcdefgh" * 20,), max_tokens=2), ErrorCode.INVALID_ARGUMENT, "choices"),
        (_query(regex=r"\d{12}", max_tokens=2), ErrorCode.INVALID_ARGUMENT, "regex"),
        (_query(regex="(unclosed"), ErrorCode.INVALID_ARGUMENT, "regex"),
        (_query(choices=("a",), regex=""), ErrorCode.INVALID_ARGUMENT, "choices"),
    ],
)
def test_constraint_errors_name_their_field(
    tiny: LoadedModel, req: GenerationRequest, code: ErrorCode, field: str
) -> None:
    tasks = TaskCompiler(tiny.config, tiny.tokenizer)
    with pytest.raises(EngineError) as info:
        tasks.build(req)
    assert info.value.code is code and info.value.field == field
    assert info.value.message.startswith(f"{field}: ")


def test_compile_time_budget_is_resource_exhausted(tiny: LoadedModel) -> None:
    limits = ConstraintLimits(constraint_compile_seconds=1e-9)
    tasks = TaskCompiler(tiny.config, tiny.tokenizer, limits=limits)
    with pytest.raises(EngineError) as info:
        tasks.build(_query(regex=r"[a-z]{2,5}( [a-z]{2,5}){0,3}"))
    assert info.value.code is ErrorCode.RESOURCE_EXHAUSTED and info.value.field == "regex"
    assert "budget" in info.value.message


def test_failed_builds_give_their_rows_back(tiny: LoadedModel) -> None:
    tasks = TaskCompiler(tiny.config, tiny.tokenizer)
    live = tasks.table.live_rows
    with pytest.raises(EngineError) as info:
        # The constraint compiles, then the prompt plus budget overflows the context.
        tasks.build(_query(regex="[a-z]+", question="word " * 3000, max_tokens=64))
    assert info.value.code is ErrorCode.OUT_OF_RANGE
    assert tasks.table.live_rows == live
    built = tasks.build(_query(regex="[a-z]+"))
    assert tasks.table.live_rows > live
    built.release()
    built.release()  # idempotent
    assert tasks.table.live_rows == live


def test_table_rows_are_reclaimed_across_many_distinct_constraints(
    tiny: LoadedModel, sample_image: PreparedImage
) -> None:
    """Far more distinct rows than the table holds, over time: every query still gets its
    rows (reclaimed ones rewritten and re-uploaded), answers always match, and segment, whose
    rows are reserved at start, keeps working."""
    cfg = EngineConfig(
        max_batch_size=4,
        kv_budget_bytes=16 << 20,
        mask_table_rows=64,
        constraint_limits=ConstraintLimits(max_mask_rows=12),
    )
    patterns = [f"[{chr(97 + i)}-{chr(97 + i + 1 + i % 5)}]+x?" for i in range(20)]
    patterns += [f"{d}[0-{d}]{{1,2}}" for d in range(1, 10)]

    async def run() -> None:
        engine = InProcessEngine(BatchedEngine(tiny, cfg))
        pinned = engine.batched.table.live_rows
        await engine.start()
        try:
            for group in range(0, len(patterns), 3):  # a few at a time, each group new rows
                chunk = patterns[group : group + 3]
                answers = await asyncio.gather(
                    *[
                        _answer(engine, _query(regex=p, temperature=1.0, seed=i))
                        for i, p in enumerate(chunk)
                    ]
                )
                for pattern, fin in zip(chunk, answers, strict=True):
                    assert re.fullmatch(pattern, fin.text or ""), (pattern, fin.text)
            seg = await _answer(
                engine,
                GenerationRequest(Task.SEGMENT, sample_image, object_name="car", max_tokens=30),
            )
            assert seg.segmentation is not None
            await _wait_idle(engine)
            assert engine.batched.table.live_rows == pinned
            assert (
                len(engine.batched.table) == cfg.mask_table_rows
            )  # every slot was used at least once
        finally:
            await engine.close()

    asyncio.run(run())


def test_a_full_table_is_resource_exhausted_naming_the_field(tiny: LoadedModel) -> None:
    tasks = TaskCompiler(tiny.config, tiny.tokenizer, mask_rows=40)
    held = []
    with pytest.raises(EngineError) as info:
        for i in range(40):
            held.append(tasks.build(_query(regex=f"[{chr(97 + i % 20)}-z]{{{i % 3 + 1}}}x")))
    assert info.value.code is ErrorCode.RESOURCE_EXHAUSTED and info.value.field == "regex"
    for built in held:
        built.release()
    tasks.build(_query(regex="[q-z]{3}x")).release()  # rows came back


@pytest.mark.parametrize("pattern", ["", "()", "a{0}", "(b{0}){3}"])
def test_empty_string_language_answers_at_once(
    tiny: LoadedModel, generator: ReferenceGenerator, pattern: str
) -> None:
    async def run() -> Finished:
        engine = InProcessEngine(
            BatchedEngine(tiny, EngineConfig(max_batch_size=2, kv_budget_bytes=16 << 20))
        )
        await engine.start()
        try:
            req = _query(regex=pattern, max_tokens=500, deadline=time.monotonic() + 20)
            fin = await asyncio.wait_for(_answer(engine, req), 15)
            await _wait_idle(engine)
            return fin
        finally:
            await engine.close()

    fin = asyncio.run(run())
    assert fin.text == "" and fin.finish_reason == "eos"
    want = generator.query(None, "which?", SamplingSettings(temperature=0), regex=pattern)
    assert want.text == "" and want.finish_reason == "eos"


def test_a_segment_budget_too_small_for_any_path_names_max_tokens(
    tiny: LoadedModel, sample_image: PreparedImage
) -> None:
    tasks = TaskCompiler(tiny.config, tiny.tokenizer)
    req = GenerationRequest(Task.SEGMENT, sample_image, object_name="car", max_tokens=2)
    with pytest.raises(EngineError) as info:
        tasks.build(req)
    assert info.value.code is ErrorCode.INVALID_ARGUMENT and info.value.field == "max_tokens"


def test_a_caller_gone_mid_build_leaks_no_rows(tiny: LoadedModel) -> None:
    async def run() -> None:
        engine = InProcessEngine(
            BatchedEngine(tiny, EngineConfig(max_batch_size=2, kv_budget_bytes=16 << 20))
        )
        pinned = engine.batched.table.live_rows
        try:
            for i in range(3):
                task = asyncio.create_task(engine.submit(_query(regex=f"[a-{chr(100 + i)}]{{3}}")))
                await asyncio.sleep(0)  # the build is on the builder thread now
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            # The builder thread gives back what an abandoned build took before it takes
            # its next job: once this one ran, every build above has been released.
            await asyncio.get_running_loop().run_in_executor(
                engine.batched.intake.builder, lambda: None
            )
            assert engine.batched.table.live_rows == pinned
        finally:
            await engine.close()

    asyncio.run(run())
