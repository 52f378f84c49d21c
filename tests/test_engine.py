"""The batched engine against the reference generation, on the CPU with tiny models.

Greedy output must equal the reference token for token, at pipeline depth 1 and 2, with many
concurrent requests of different lengths, eos at different steps, max_objects hits, image
prefix hits and misses, and cancellations; afterwards every page, row and slot is free. The
reference comparisons also run with a step budget of three prompt tokens beside a full decode
batch, so prompts are prefilled in chunks over several mixed steps next to running decodes.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import gc
import re
import time
import weakref
from collections.abc import Callable

import pytest
import torch

from image_pipeline import PreparedImage, prepare_pil, sample_image
from tests.support.observers import StepLog
from tests.support.reference_memo import shared_reference
from tests.support.threads import one_torch_thread  # noqa: F401  (autouse)
from vlm_server.engine.api import (
    EngineError,
    ErrorCode,
    Finished,
    GenerationRequest,
    Task,
    TextDelta,
)
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.observer import NO_OBSERVER, Observer
from vlm_server.engine.core.pipeline import Step
from vlm_server.engine.core.step_plan import Chunk, StepPlan
from vlm_server.engine.engine import BatchedEngine
from vlm_server.models.interface import LoadedModel
from vlm_server.reference import ReferenceGenerator, SamplingSettings
from vlm_server.server.in_process import InProcessEngine


def _biased(loaded: LoadedModel, token: int, over: int, delta: float) -> LoadedModel:
    model = copy.deepcopy(loaded.model)
    with torch.no_grad():
        bias = model.text.lm_head.bias
        bias[token] = (bias.max() if over < 0 else bias[over]) + delta
    return LoadedModel(model, loaded.tokenizer, loaded.config, loaded.source)


@pytest.fixture(scope="module")
def images() -> list[PreparedImage]:
    base = sample_image()
    return [
        prepare_pil(base),
        prepare_pil(base.rotate(90, expand=True)),
        prepare_pil(base.resize((300, 200))),
    ]


async def _collect(engine: InProcessEngine, req: GenerationRequest) -> tuple[list[str], Finished]:
    parts: list[str] = []
    async for event in await engine.submit(req):
        if isinstance(event, TextDelta):
            parts.append(event.text)
        elif isinstance(event, Finished):
            return parts, event
    raise AssertionError("stream ended without Finished")


# Step budgets the reference comparisons run under: the default (prompts whole) and "chunked":
# the full decode batch plus three prompt tokens per step.
# default: the engine's defaults; chunked: a step budget that splits prompts, none riding
# their image prefix; mixed: that budget, and prompts of up to 12 tokens ride their prefix.
BUDGETS = ["default", "chunked", "mixed"]


class _Plans(StepLog):
    """Keeps the plan of every mixed step launched."""

    def __init__(self) -> None:
        super().__init__(self._on_step)
        self.plans: list[StepPlan] = []

    def _on_step(self, what: str, step: Step) -> None:
        if what == "launch" and step.plan is not None:
            self.plans.append(step.plan)

    def check(self, engine: InProcessEngine, budget: str, splits: bool = True) -> None:
        """Under the small budgets, prompts really were split and shared steps with decode
        rows, and under the mixed one others rode their prefix (a held row: no token); under
        any budget, no step held more tokens than it. ``splits``: whether the requests queue
        behind a full batch, which makes the split and shared steps certain; with every
        request admitted at once, they depend on when each arrived."""
        assert self.plans
        assert all(p.n_tokens <= engine.batched.cfg.max_step_tokens for p in self.plans)
        held = any(not c.length for p in self.plans for c in p.chunks)
        if budget != "default":
            if splits:
                assert any(not c.final for p in self.plans for c in p.chunks)
                assert any(p.n_decode and any(c.length for c in p.chunks) for p in self.plans)
            assert held == (budget == "mixed")


def _engine(
    loaded: LoadedModel,
    depth: int,
    observer: Observer = NO_OBSERVER,
    budget: str = "default",
    **kw: object,
) -> InProcessEngine:
    options: dict = {"max_batch_size": 8, "kv_budget_bytes": 32 << 20, **kw}
    if budget != "default":
        options["max_step_tokens"] = options["max_batch_size"] + 3
        options["prefix_prompt_tokens"] = 12 if budget == "mixed" else 0
    cfg = EngineConfig(pipeline_depth=depth, **options)
    return InProcessEngine(BatchedEngine(loaded, cfg, observer=observer))


def _assert_clean(engine: InProcessEngine) -> None:
    """Every row and slot free; pages held only by cached image prefixes."""
    assert engine.batched.idle()
    s = engine.batched.scheduler
    cached = sum(len(e.pages) for e in s.prefix_cache._entries.values())
    assert engine.batched.scheduler.pages.used_pages == cached
    assert all(e.users == 0 for e in s.prefix_cache._entries.values())
    s.prefix_cache.clear()
    assert engine.batched.scheduler.pages.used_pages == 0


def _text_requests(images: list[PreparedImage]) -> list[GenerationRequest]:
    reqs = []
    for i, (length, n) in enumerate([("short", 40), ("normal", 7), ("long", 33), ("short", 1)]):
        reqs.append(
            GenerationRequest(
                Task.CAPTION,
                images[i % 3],
                request_id=f"c{i}",
                caption_length=length,
                temperature=0,
                max_tokens=n,
            )
        )
    for i, q in enumerate(["what is this?", "count the cars", "where", "colour?"]):
        reqs.append(
            GenerationRequest(
                Task.QUERY,
                images[i % 2],
                request_id=f"q{i}",
                question=q,
                temperature=0,
                max_tokens=24 + 6 * i,
            )
        )
    reqs.append(
        GenerationRequest(
            Task.QUERY, None, request_id="t0", question="no image", temperature=0, max_tokens=15
        )
    )
    reqs.append(
        GenerationRequest(
            Task.CAPTION,
            images[0],
            request_id="s0",
            temperature=0.8,
            top_p=0.9,
            seed=11,
            max_tokens=25,
        )
    )
    return reqs


# KV formats the parity tests run with (--kv-dtype): the exact pages under every budget and
# depth, each compact one under the mixed budget (prompts riding prefixes, chunks, decode
# rows) at both depths; the rest slow.
KV_CASES = [
    *[("auto", b, d) for b in BUDGETS for d in (1, 2)],
    *[(kv, "mixed", d) for kv in ("int8", "fp8") for d in (1, 2)],
    *[
        pytest.param(kv, b, d, marks=pytest.mark.slow)
        for kv in ("int8", "fp8")
        for b in ("default", "chunked")
        for d in (1, 2)
    ],
]


@pytest.mark.parametrize(("kv_dtype", "budget", "depth"), KV_CASES)
def test_text_tasks_equal_the_reference(
    text_model: LoadedModel, images: list[PreparedImage], depth: int, budget: str, kv_dtype: str
) -> None:
    """The engine equals the reference token for token, with compact KV pages too: both store
    the same quantized keys and values (models/kv.py) and attend over them dequantized."""
    ref = shared_reference(text_model.model, text_model.tokenizer, kv_dtype=kv_dtype)
    reqs = _text_requests(images)

    async def run() -> list[tuple[list[str], Finished]]:
        engine = _engine(
            text_model, depth, plans, budget=budget, max_batch_size=4, kv_dtype=kv_dtype
        )
        await engine.start()
        try:
            out = await asyncio.gather(*[_collect(engine, r) for r in reqs])
            await _wait_idle(engine)  # the last zombies release after their results went out
            _assert_clean(engine)
            plans.check(engine, budget)
            return out
        finally:
            await engine.close()

    plans = _Plans()
    results = asyncio.run(run())
    reasons = set()
    for req, (parts, fin) in zip(reqs, results, strict=True):
        settings = SamplingSettings(
            temperature=req.temperature, top_p=req.top_p, max_tokens=req.max_tokens, seed=req.seed
        )
        want = (
            ref.caption(req.image, req.caption_length, settings)
            if req.task is Task.CAPTION
            else ref.query(req.image, req.question, settings)
        )
        assert fin.text == want.text, req.request_id
        assert "".join(parts) == fin.text
        assert fin.finish_reason == want.finish_reason, req.request_id
        assert fin.metrics.output_tokens == len(want.token_ids)
        reasons.add(fin.finish_reason)
    assert reasons == {"eos", "length"}  # both endings were exercised


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("depth", [1, 2])
def test_region_tasks_equal_the_reference(
    region_model: LoadedModel, images: list[PreparedImage], depth: int, budget: str
) -> None:
    ref = shared_reference(region_model.model, region_model.tokenizer)
    reqs = [
        GenerationRequest(
            task, images[i % 3], request_id=f"{task}{i}", object_name=obj, max_objects=n
        )
        for i, (task, obj, n) in enumerate(
            [
                (Task.DETECT, "car", 3),
                (Task.POINT, "dog", 4),
                (Task.DETECT, "tree", 8),
                (Task.POINT, "car", 1),
                (Task.DETECT, "person", 5),
                (Task.POINT, "sign", 6),
            ]
        )
    ]

    async def run() -> list[tuple[list[str], Finished]]:
        engine = _engine(region_model, depth, plans, budget=budget)
        await engine.start()
        try:
            out = await asyncio.gather(*[_collect(engine, r) for r in reqs])
            assert engine.stats().prefix_hits >= 3  # 6 requests over 3 images
            await _wait_idle(engine)
            _assert_clean(engine)
            plans.check(engine, budget)
            return out
        finally:
            await engine.close()

    plans = _Plans()
    reasons, counts = set(), set()
    for req, (_, fin) in zip(reqs, asyncio.run(run()), strict=True):
        if req.task is Task.DETECT:
            want = ref.detect(req.image, req.object_name, req.max_objects)
            assert [tuple(vars(b).values()) for b in fin.boxes] == [
                tuple(vars(b).values()) for b in want.boxes
            ]
        else:
            want = ref.point(req.image, req.object_name, req.max_objects)
            assert [tuple(vars(p).values()) for p in fin.points] == [
                tuple(vars(p).values()) for p in want.points
            ]
        assert fin.finish_reason == want.finish_reason
        reasons.add(fin.finish_reason)
        counts.add(len(fin.points) + len(fin.boxes))
    assert reasons == {"eos", "max_objects"}
    assert len(counts) >= 3


def test_cancel_mid_stream_frees_everything(tiny: LoadedModel, images: list[PreparedImage]) -> None:
    async def run() -> None:
        engine = _engine(tiny, 2)
        await engine.start()
        try:
            long = GenerationRequest(Task.CAPTION, images[0], temperature=0, max_tokens=1000)
            other = GenerationRequest(
                Task.QUERY, images[1], question="what is this?", temperature=0, max_tokens=12
            )
            stream = await engine.submit(long)
            other_task = asyncio.create_task(_collect(engine, other))
            seen = 0
            with pytest.raises(EngineError) as info:
                async for event in stream:
                    assert isinstance(event, TextDelta)
                    seen += 1
                    if seen == 3:
                        stream.cancel()
            assert info.value.code is ErrorCode.CANCELLED
            _, fin = await other_task  # untouched by the cancellation
            assert fin.finish_reason in ("eos", "length")
            await _wait_idle(engine)
            _assert_clean(engine)
        finally:
            await engine.close()

    asyncio.run(run())


async def _wait_idle(engine: InProcessEngine, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not engine.batched.idle():
        assert loop.time() < end, "engine did not become idle"
        await asyncio.sleep(0.005)


def _finish_all(
    loaded: LoadedModel,
    reqs: list[GenerationRequest],
    depth: int,
    check: Callable[[InProcessEngine], None] | None = None,
    **kw: object,
) -> list[Finished]:
    """Each request's `Finished`, in order, from one started engine (`_engine`'s options);
    ``check`` looks at the engine once started, before any request."""

    async def run() -> list[Finished]:
        engine = _engine(loaded, depth, **kw)  # type: ignore[arg-type]
        await engine.start()
        try:
            if check is not None:
                check(engine)
            out = await asyncio.gather(*[_collect(engine, r) for r in reqs])
            await _wait_idle(engine)
            return [fin for _, fin in out]
        finally:
            await engine.close()

    return asyncio.run(run())


def _reference_text(ref: ReferenceGenerator, req: GenerationRequest) -> str:
    """The reference's answer to a caption or query request, with its sampling settings."""
    s = SamplingSettings(
        temperature=req.temperature, top_p=req.top_p, max_tokens=req.max_tokens, seed=req.seed
    )
    if req.task is Task.CAPTION:
        return ref.caption(req.image, req.caption_length, s).text
    return ref.query(req.image, req.question, s).text


def test_an_ended_request_is_freed_without_the_cycle_collector(
    tiny: LoadedModel, images: list[PreparedImage]
) -> None:
    """A cancelled request and its image go away by reference counting alone: the sequence
    drops its link to the request's stream once the last event is out."""

    async def run() -> list[weakref.ref]:
        engine = _engine(tiny, 2)
        await engine.start()
        refs = []
        try:
            for cancel in (True, False):
                image = dataclasses.replace(
                    images[0], crops=images[0].crops.clone(), content_hash=f"cycle-{cancel}"
                )
                req = GenerationRequest(Task.CAPTION, image, temperature=0, max_tokens=40)
                stream = await engine.submit(req)
                refs += [weakref.ref(image.crops), weakref.ref(stream)]
                async for _ in stream:
                    if cancel:
                        stream.cancel()
                        break
                del image, req, stream
            await _wait_idle(engine)
        finally:
            await engine.close()
        return refs

    gc.disable()
    try:
        refs = asyncio.run(run())
        assert all(r() is None for r in refs)
    finally:
        gc.enable()


def test_deadline_while_queued_is_never_scheduled(
    tiny: LoadedModel, images: list[PreparedImage]
) -> None:
    async def run() -> None:
        launched: list[str] = []
        engine = _engine(
            tiny,
            2,
            max_batch_size=1,
            observer=StepLog(
                lambda what, step: launched.extend(
                    s.request.request_id for s in step.seqs if what == "launch"
                )
            ),
        )
        await engine.start()
        try:
            busy = await engine.submit(
                GenerationRequest(
                    Task.CAPTION, images[0], request_id="busy", temperature=0, max_tokens=400
                )
            )
            first = await anext(aiter(busy))
            assert isinstance(first, TextDelta)
            late = GenerationRequest(
                Task.CAPTION,
                images[1],
                request_id="late",
                temperature=0,
                max_tokens=5,
                deadline=time.monotonic() + 0.01,
            )
            with pytest.raises(EngineError) as info:
                await _collect(engine, late)
            assert info.value.code is ErrorCode.DEADLINE_EXCEEDED
            busy.cancel()
            with pytest.raises(EngineError) as info:
                async for _ in busy:
                    pass
            assert info.value.code is ErrorCode.CANCELLED
            await _wait_idle(engine)
            assert "late" not in launched and "busy" in launched
        finally:
            await engine.close()

    asyncio.run(run())


def test_deadline_while_running(tiny: LoadedModel, images: list[PreparedImage]) -> None:
    async def run() -> None:
        engine = _engine(tiny, 2)
        await engine.start()
        try:
            req = GenerationRequest(
                Task.CAPTION,
                images[0],
                temperature=0,
                max_tokens=500,
                deadline=time.monotonic() + 0.3,
            )
            parts = []
            with pytest.raises(EngineError) as info:
                async for event in await engine.submit(req):
                    parts.append(event)
            assert info.value.code is ErrorCode.DEADLINE_EXCEEDED
            await _wait_idle(engine)
            _assert_clean(engine)
        finally:
            await engine.close()

    asyncio.run(run())


def test_constrained_query_and_segment_always_parse(
    tiny: LoadedModel, images: list[PreparedImage]
) -> None:
    async def run() -> None:
        engine = _engine(tiny, 2)
        await engine.start()
        try:
            choice = GenerationRequest(
                Task.QUERY,
                images[0],
                question="which?",
                choices=("red car", "blue bus", "no"),
                temperature=1.0,
                seed=3,
                max_tokens=20,
            )
            regex = GenerationRequest(
                Task.QUERY,
                images[0],
                question="count",
                regex=r"\d{1,3}",
                temperature=1.0,
                seed=4,
                max_tokens=20,
            )
            seg = GenerationRequest(Task.SEGMENT, images[2], object_name="car", max_tokens=60)
            (_, a), (_, b), (_, c) = await asyncio.gather(
                _collect(engine, choice), _collect(engine, regex), _collect(engine, seg)
            )
            assert a.text in choice.choices
            assert re.fullmatch(r"\d{1,3}", b.text)
            s = c.segmentation
            assert s is not None and s.svg_path.startswith("M") and s.svg_path.endswith("Z")
            assert s.mask_height == images[2].height and s.mask_width == images[2].width
            assert sum(s.mask_rle) == s.mask_height * s.mask_width
            with pytest.raises(EngineError) as info:
                await engine.submit(
                    GenerationRequest(Task.QUERY, images[0], question="x", regex="(unclosed")
                )
            assert info.value.code is ErrorCode.INVALID_ARGUMENT and info.value.field == "regex"
            await _wait_idle(engine)
            _assert_clean(engine)
        finally:
            await engine.close()

    asyncio.run(run())


def test_admission_errors(tiny: LoadedModel, images: list[PreparedImage]) -> None:
    """The engine's own checks: the context, the task's image, the queue and the KV cache.
    Value ranges that need no model are the service's (tests/test_service_rpcs.py)."""

    async def run() -> None:
        engine = _engine(tiny, 2, max_queue=1)
        cases = [
            (
                dict(task=Task.CAPTION, image=images[0], max_tokens=1500),
                ErrorCode.OUT_OF_RANGE,
                "max_tokens",
            ),
            (
                dict(task=Task.CAPTION, image=images[0], max_tokens=100_000),
                ErrorCode.OUT_OF_RANGE,
                "max_tokens",
            ),
            (dict(task=Task.CAPTION, image=None), ErrorCode.INVALID_ARGUMENT, "image"),
        ]
        for kwargs, code, field in cases:
            with pytest.raises(EngineError) as info:
                await engine.submit(GenerationRequest(**kwargs))  # type: ignore[arg-type]
            assert info.value.code is code and info.value.field == field
        # The engine is not started: the first request waits, the second finds the queue full.
        await engine.submit(GenerationRequest(Task.CAPTION, images[0], max_tokens=2))
        with pytest.raises(EngineError) as info:
            await engine.submit(GenerationRequest(Task.CAPTION, images[0], max_tokens=2))
        assert info.value.code is ErrorCode.RESOURCE_EXHAUSTED
        small = _engine(tiny, 2, kv_budget_bytes=1 << 20)
        with pytest.raises(EngineError) as info:
            await small.submit(GenerationRequest(Task.CAPTION, images[0], max_tokens=1200))
        assert info.value.code is ErrorCode.RESOURCE_EXHAUSTED
        await engine.close()

    asyncio.run(run())


def test_many_concurrent_requests_under_page_pressure(
    text_model: LoadedModel, images: list[PreparedImage]
) -> None:
    """More requests than pages for all of them at once: they wait, then all finish."""
    reqs = [
        GenerationRequest(
            Task.QUERY,
            images[i % 3],
            request_id=str(i),
            question=f"q{i}",
            temperature=0,
            max_tokens=3 + i % 5,
        )
        for i in range(24)
    ]

    async def run() -> list[Finished]:
        engine = _engine(
            text_model, 2, max_batch_size=6, kv_budget_bytes=2 << 20, prefix_cache_entries=2
        )
        await engine.start()
        try:
            out = await asyncio.gather(*[_collect(engine, r) for r in reqs])
            await _wait_idle(engine)  # the last zombies release after their results went out
            _assert_clean(engine)
            return [fin for _, fin in out]
        finally:
            await engine.close()

    ref = shared_reference(text_model.model, text_model.tokenizer)
    for req, fin in zip(reqs, asyncio.run(run()), strict=True):
        want = ref.query(
            req.image, req.question, SamplingSettings(temperature=0, max_tokens=req.max_tokens)
        )
        assert fin.text == want.text


@pytest.mark.parametrize("depth", [1, 2])
def test_commit_before_finalize_order(
    tiny: LoadedModel, images: list[PreparedImage], depth: int
) -> None:
    """A row's mask for step t is built only after the step t-1 holding the same sequence was
    committed; commits follow launch order; no sequence is in more than two steps at once."""
    log: list[tuple[str, int, tuple[int, ...]]] = []

    async def run() -> None:
        engine = _engine(
            tiny,
            depth,
            max_batch_size=4,
            observer=StepLog(
                lambda what, step: log.append((what, step.step_id, tuple(id(s) for s in step.seqs)))
            ),
        )
        await engine.start()
        try:
            reqs = [
                GenerationRequest(
                    Task.QUERY,
                    images[i % 2],
                    question="q",
                    max_tokens=6,
                    regex=r"[a-z ]{1,12}",
                    temperature=1.0,
                    seed=i,
                )
                for i in range(6)
            ]
            reqs += [GenerationRequest(Task.DETECT, images[2], object_name="car", max_objects=2)]
            await asyncio.gather(*[_collect(engine, r) for r in reqs])
            await _wait_idle(engine)
        finally:
            await engine.close()

    asyncio.run(run())
    committed: set[int] = set()
    launched: list[tuple[int, tuple[int, ...]]] = []
    commit_order = []
    for what, step_id, seqs in log:
        if what == "launch":
            launched.append((step_id, seqs))
            in_flight = [s for sid, s in launched if sid not in committed]
            for seq in seqs:
                assert sum(seq in s for s in in_flight) <= 2  # I4
        elif what == "finalize":
            for earlier_id, earlier_seqs in launched:
                if earlier_id < step_id and set(earlier_seqs) & set(seqs):
                    assert earlier_id in committed, (earlier_id, step_id)
        else:
            committed.add(step_id)
            commit_order.append(step_id)
    assert commit_order == sorted(commit_order)  # I2: FIFO
    assert len(committed) == len(launched)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("depth", [1, 2])
def test_constrained_and_segment_equal_the_reference(
    tiny: LoadedModel, images: list[PreparedImage], depth: int, budget: str
) -> None:
    """Choices, regex (sampled and greedy) and segment: the engine's answers are the
    reference's, through the same grammars and masks."""
    reqs = [
        GenerationRequest(
            Task.QUERY,
            images[0],
            question="which?",
            seed=1,
            temperature=1.0,
            top_p=0.95,
            choices=("red car", "blue bus", "a dog", "no"),
        ),
        GenerationRequest(
            Task.QUERY,
            images[1],
            question="count",
            seed=2,
            temperature=0.8,
            regex=r"[0-9]{1,3} (cars|dogs)",
            max_tokens=12,
        ),
        GenerationRequest(
            Task.QUERY,
            None,
            question="name",
            temperature=0,
            regex=r"[a-z]+( [a-z]+)?",
            max_tokens=8,
        ),
        GenerationRequest(Task.SEGMENT, images[2], object_name="car", max_tokens=40),
        GenerationRequest(Task.SEGMENT, images[0], object_name="tree", max_tokens=25),
    ]

    async def run() -> list[Finished]:
        engine = _engine(tiny, depth, plans, budget=budget)
        await engine.start()
        # The compiling child up first, as a server has it: the requests then arrive
        # together, as the plan checks want.
        await asyncio.to_thread(engine.batched.tasks.constraints.warm)
        try:
            out = await asyncio.gather(*[_collect(engine, r) for r in reqs])
            await _wait_idle(engine)
            _assert_clean(engine)
            plans.check(engine, budget, splits=False)
            return [fin for _, fin in out]
        finally:
            await engine.close()

    plans = _Plans()
    ref = shared_reference(tiny.model, tiny.tokenizer)
    for req, fin in zip(reqs, asyncio.run(run()), strict=True):
        if req.task is Task.QUERY:
            s = SamplingSettings(
                temperature=req.temperature,
                top_p=req.top_p,
                max_tokens=req.max_tokens,
                seed=req.seed,
            )
            want = ref.query(req.image, req.question, s, choices=req.choices, regex=req.regex)
            assert fin.text == want.text and fin.finish_reason == want.finish_reason
            if req.choices:
                assert fin.text in req.choices
            else:
                assert re.fullmatch(req.regex or "", fin.text)
        else:
            seg, reason = ref.segment(req.image, req.object_name, req.max_tokens)
            got = fin.segmentation
            assert got is not None and fin.finish_reason == reason
            assert got.svg_path == seg.path and tuple(got.mask_rle) == tuple(seg.mask_counts)
            assert (got.box.x_min, got.box.y_min, got.box.x_max, got.box.y_max) == seg.box


@pytest.mark.parametrize("code", [ErrorCode.CANCELLED, ErrorCode.DEADLINE_EXCEEDED])
@pytest.mark.parametrize("depth", [1, 2])
def test_a_stop_in_the_middle_of_a_chunked_prefill_frees_everything(
    tiny: LoadedModel, images: list[PreparedImage], depth: int, code: ErrorCode
) -> None:
    """A request cancelled, or whose deadline passes, between two chunks of its prompt ends
    with that error, launches no further chunk, and gives back every page and row; the
    request decoding beside it is untouched."""
    chunks: dict[str, list[Chunk]] = {}
    beside: list[int] = []  # decode rows in the steps holding the victim's chunks

    def on_step(what: str, step: Step) -> None:
        if what != "launch" or step.plan is None:
            return
        for seq, chunk in zip(step.seqs[step.plan.n_decode :], step.plan.chunks, strict=True):
            rid = seq.request.request_id
            chunks.setdefault(rid, []).append(chunk)
            if rid == "victim":
                beside.append(step.plan.n_decode)
            if rid == "victim" and len(chunks[rid]) == 1:  # its first chunk (after its prefix)
                assert chunk.length and not chunk.final
                if code is ErrorCode.CANCELLED:
                    seq.cancelled = ErrorCode.CANCELLED  # as the stream's cancel() does
                else:  # the scheduler thread itself outlives the deadline
                    assert seq.request.deadline is not None
                    time.sleep(max(0.0, seq.request.deadline - time.monotonic()) + 0.01)

    async def run() -> None:
        engine = _engine(tiny, depth, StepLog(on_step), budget="chunked", max_batch_size=4)
        await engine.start()
        try:
            other = GenerationRequest(
                Task.CAPTION, images[0], request_id="other", temperature=0, max_tokens=100
            )
            other_task = asyncio.create_task(_collect(engine, other))
            while engine.stats().last_batch_size == 0:
                await asyncio.sleep(0.001)  # the other request is decoding
            victim = GenerationRequest(
                Task.QUERY,
                images[1],
                request_id="victim",
                question="please describe every single thing you can see in this picture",
                temperature=0,
                max_tokens=20,
                deadline=time.monotonic() + 2.0 if code is ErrorCode.DEADLINE_EXCEEDED else None,
            )
            with pytest.raises(EngineError) as info:
                await _collect(engine, victim)
            assert info.value.code is code
            _, fin = await other_task
            assert fin.finish_reason in ("eos", "length")
            await _wait_idle(engine)
            _assert_clean(engine)
        finally:
            await engine.close()

    asyncio.run(run())
    assert len(chunks["victim"]) == 1 and chunks["victim"][0].start == 0
    assert beside[-1] == 1  # the other request decoded in the same step


@pytest.mark.parametrize("depth", [1, 2])
def test_requests_for_one_new_image_share_one_prefix_computation(
    text_model: LoadedModel, images: list[PreparedImage], depth: int
) -> None:
    """Requests for an image whose prefix is still being computed wait for that computation
    instead of starting their own; each image's prefix is computed once, in batches of the
    images admitted together, and every answer equals the reference's."""
    ref = shared_reference(text_model.model, text_model.tokenizer)
    questions = ["what is it?", "how many?", "which color?", "where?"]
    reqs = [
        GenerationRequest(
            Task.QUERY, images[i % 2], request_id=f"q{i}", question=q, temperature=0, max_tokens=6
        )
        for i, q in enumerate(questions)
    ]
    batches: list[list[str]] = []

    async def run() -> list[tuple[list[str], Finished]]:
        engine = _engine(text_model, depth, max_batch_size=4)
        launch = engine.batched.runtime.launch_prefixes

        def recording(jobs: list, partitioned: bool = False, interactive: bool = False) -> object:
            batches.append([job.image.content_hash for job in jobs])
            return launch(jobs, partitioned, interactive)

        engine.batched.runtime.launch_prefixes = recording  # type: ignore[method-assign]
        await engine.start()
        try:
            out = await asyncio.gather(*[_collect(engine, r) for r in reqs])
            await _wait_idle(engine)
            _assert_clean(engine)
            return out
        finally:
            await engine.close()

    results = asyncio.run(run())
    computed = [h for batch in batches for h in batch]
    assert sorted(computed) == sorted({images[0].content_hash, images[1].content_hash})
    for req, (_, fin) in zip(reqs, results, strict=True):
        want = ref.query(req.image, req.question, SamplingSettings(temperature=0, max_tokens=6))
        assert fin.text == want.text, req.request_id
