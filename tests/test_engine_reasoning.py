"""Grounded reasoning and spatial references through the batched engine, against the reference.

The reasoning oracle is `ReferenceGenerator.reasoning_query`, the reference's own loop (not the
engine's grammar); spatial references are encoded there as the reference does. The tiny model
is biased so that reasoning grounds coordinates, opens spans and reaches the answer marker.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from image_pipeline import PreparedImage, prepare_pil, sample_image
from tests.support.reference_memo import shared_reference
from tests.support.threads import one_torch_thread  # noqa: F401  (autouse)
from tests.test_engine import BUDGETS, _assert_clean, _engine, _Plans, _wait_idle
from vlm_server.engine.api import (
    EngineError,
    ErrorCode,
    Finished,
    GenerationRequest,
    Task,
    TextDelta,
)
from vlm_server.models.interface import LoadedModel
from vlm_server.reference import SamplingSettings


@pytest.fixture(scope="module")
def images() -> list[PreparedImage]:
    base = sample_image()
    return [prepare_pil(base), prepare_pil(base.rotate(90, expand=True))]


async def _events(engine, req: GenerationRequest) -> tuple[list[TextDelta], Finished]:
    deltas: list[TextDelta] = []
    async for event in await engine.submit(req):
        if isinstance(event, TextDelta):
            deltas.append(event)
        else:
            return deltas, event
    raise AssertionError("stream ended without Finished")


def _run(loaded: LoadedModel, reqs, depth: int, budget: str = "default", plans=None):
    async def run():
        engine = (
            _engine(loaded, depth, plans, budget=budget)
            if plans
            else _engine(loaded, depth, budget=budget)
        )
        await engine.start()
        try:
            out = await asyncio.gather(*[_events(engine, r) for r in reqs])
            await _wait_idle(engine)
            _assert_clean(engine)
            if plans is not None:
                plans.check(engine, budget, splits=False)
            return out
        finally:
            await engine.close()

    return asyncio.run(run())


# (image index, seed): sampled reasonings of the biased model that ground points and answer,
# plus others that end in the budget or answer at once.
REASONING_CASES = [(1, 4), (1, 23), (0, 2), (0, 1), (1, 0)]


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("depth", [1, 2])
def test_reasoning_equals_the_reference(
    reasoning_model: LoadedModel, images: list[PreparedImage], depth: int, budget: str
) -> None:
    ref = shared_reference(reasoning_model.model, reasoning_model.tokenizer)
    settings = [
        SamplingSettings(temperature=1.0, top_p=0.3, seed=s, max_tokens=40)
        for _, s in REASONING_CASES
    ]
    reqs = [
        GenerationRequest(
            Task.QUERY,
            images[i],
            request_id=f"r{k}",
            question="where",
            reasoning=True,
            temperature=s.temperature,
            top_p=s.top_p,
            seed=s.seed,
            max_tokens=s.max_tokens,
        )
        for k, ((i, _), s) in enumerate(zip(REASONING_CASES, settings, strict=True))
    ]
    # A plain query and a caption ride along in the same batches.
    reqs.append(
        GenerationRequest(Task.QUERY, images[0], question="what", temperature=0, max_tokens=9)
    )
    plans = _Plans()
    results = _run(reasoning_model, reqs, depth, budget, plans)
    grounded = answered = 0
    for req, s, (deltas, fin) in zip(reqs, settings, results, strict=False):
        want = ref.reasoning_query(req.image, req.question, s)
        assert fin.reasoning is not None
        assert fin.reasoning.text == want.reasoning, req.request_id
        got = [
            (g.start_idx, g.end_idx, [(p.x, p.y) for p in g.points])
            for g in fin.reasoning.grounding
        ]
        assert got == want.grounding, req.request_id
        assert fin.text == want.answer, req.request_id
        assert fin.finish_reason == want.finish_reason, req.request_id
        assert fin.metrics.output_tokens == len(want.reasoning_ids) + len(want.answer_ids)
        assert fin.metrics.reasoning_tokens == len(want.reasoning_ids)
        # Reasoning deltas come first, and each kind concatenates to its text.
        flags = [d.reasoning for d in deltas]
        assert flags == sorted(flags, reverse=True)
        assert "".join(d.text for d in deltas if d.reasoning) == want.reasoning
        assert "".join(d.text for d in deltas if not d.reasoning) == want.answer
        grounded += any(len(g[2]) for g in want.grounding)
        answered += bool(want.answer_ids)
    assert grounded and answered  # the cases exercise grounding and answers
    assert results[-1][1].reasoning is None


def test_reasoning_budget_and_refusals(
    reasoning_model: LoadedModel, images: list[PreparedImage], tiny: LoadedModel
) -> None:
    ref = shared_reference(reasoning_model.model, reasoning_model.tokenizer)
    # A budget that ends inside the reasoning: as in the reference, the answer marker follows
    # and the answer gets a budget of its own.
    s = SamplingSettings(temperature=0, max_tokens=5)
    want = ref.reasoning_query(images[0], "where", s)
    assert len(want.reasoning_ids) == 5 and want.answer_ids
    req = GenerationRequest(
        Task.QUERY, images[0], question="where", reasoning=True, temperature=0, max_tokens=5
    )
    [(deltas, fin)] = _run(reasoning_model, [req], 2)
    assert fin.reasoning is not None and fin.reasoning.text == want.reasoning
    assert fin.text == want.answer != "" and fin.finish_reason == want.finish_reason
    assert fin.metrics.reasoning_tokens == 5
    assert fin.metrics.output_tokens == 5 + len(want.answer_ids)
    assert [d.reasoning for d in deltas] == sorted((d.reasoning for d in deltas), reverse=True)

    async def refused(req: GenerationRequest) -> EngineError:
        engine = _engine(tiny, 2)
        await engine.start()
        try:
            with pytest.raises(EngineError) as info:
                async for _ in await engine.submit(req):
                    pass
            return info.value
        finally:
            await engine.close()

    err = asyncio.run(refused(GenerationRequest(Task.CAPTION, images[0], reasoning=True)))
    assert err.code is ErrorCode.INVALID_ARGUMENT and err.field == "reasoning"
    err = asyncio.run(
        refused(GenerationRequest(Task.QUERY, None, question="q", spatial_refs=((0.5, 0.5),)))
    )
    assert err.code is ErrorCode.INVALID_ARGUMENT and err.field == "spatial_refs"


REFS = ((0.25, 0.75), (0.1, 0.2, 0.6, 0.9))


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("depth", [1, 2])
def test_spatial_refs_equal_the_reference(
    tiny: LoadedModel, images: list[PreparedImage], depth: int, budget: str
) -> None:
    """A point and a box on query, point and detect; the same image without references and
    with others in the same batches (the references belong to the prompt, not the prefix)."""
    img = images[0]

    def query(rid: str, refs: tuple) -> GenerationRequest:
        return GenerationRequest(
            Task.QUERY,
            img,
            request_id=rid,
            question="what is here",
            temperature=0,
            max_tokens=12,
            spatial_refs=refs,
        )

    def region(task: Task, rid: str, refs: tuple) -> GenerationRequest:
        return GenerationRequest(
            task, img, request_id=rid, object_name="car", max_objects=4, spatial_refs=refs
        )

    queries = [query("q-refs", REFS), query("q-none", ()), query("q-box", REFS[1:])]
    regions = [
        region(Task.POINT, "p-refs", REFS),
        region(Task.POINT, "p-none", ()),
        region(Task.DETECT, "d-refs", REFS[1:]),
        region(Task.DETECT, "d-none", ()),
    ]
    answers: dict[str, object] = {}
    ref = shared_reference(tiny.model, tiny.tokenizer)
    reqs = queries + regions
    for req, (_, fin) in zip(reqs, _run(tiny, reqs, depth, budget), strict=True):
        built, reason, out = ref.run(req)
        if req.task is Task.QUERY:
            got: object = fin.text
            assert got == ref.tokenizer.decode(out), req.request_id
        else:
            got = [tuple(vars(o).values()) for o in (fin.points or fin.boxes)]
            assert got == [tuple(o) for o in built.grammar.objects], req.request_id
        assert fin.finish_reason == reason, req.request_id
        answers[req.request_id] = got
    # The references change the answers (else this test could not see them dropped; the
    # tiny model's region answers barely read the prompt, its text answers do).
    assert answers["q-none"] not in (answers["q-refs"], answers["q-box"])


def test_reasoning_with_spatial_refs(
    reasoning_model: LoadedModel, images: list[PreparedImage]
) -> None:
    ref = shared_reference(reasoning_model.model, reasoning_model.tokenizer)
    s = SamplingSettings(temperature=0, max_tokens=20)
    want = ref.reasoning_query(images[1], "where", s, spatial_refs=REFS)
    req = GenerationRequest(
        Task.QUERY,
        images[1],
        question="where",
        reasoning=True,
        temperature=0,
        max_tokens=20,
        spatial_refs=REFS,
    )
    [(_, fin)] = _run(reasoning_model, [req], 2)
    assert fin.reasoning.text == want.reasoning and fin.text == want.answer


def test_reasoning_leaves_room_for_a_constrained_answer(
    reasoning_model: LoadedModel, images: list[PreparedImage]
) -> None:
    """With choices, the reasoning has its whole budget and the answer its own: the answer
    is one of them."""
    req = GenerationRequest(
        Task.QUERY,
        images[0],
        question="where",
        reasoning=True,
        temperature=0,
        max_tokens=6,
        choices=("left side", "right"),
    )
    [(deltas, fin)] = _run(reasoning_model, [req], 2)
    assert fin.text in ("left side", "right")
    assert fin.reasoning is not None and fin.metrics.reasoning_tokens <= 6
    assert fin.metrics.output_tokens - fin.metrics.reasoning_tokens <= 6
    assert [d.reasoning for d in deltas] == sorted((d.reasoning for d in deltas), reverse=True)


def test_reasoning_budgets_meet_the_context(
    reasoning_model: LoadedModel, images: list[PreparedImage]
) -> None:
    """Each phase's budget fits the context, both together do not: the sampled reasoning
    spends its whole budget, the answer ends at the context's last position (as the oracle's
    does); a budget whose one phase cannot fit is refused, naming max_tokens."""
    ref = shared_reference(reasoning_model.model, reasoning_model.tokenizer)
    s = SamplingSettings(temperature=1.0, top_p=0.3, seed=3, max_tokens=700)
    want = ref.reasoning_query(images[1], "where", s)
    req = GenerationRequest(
        Task.QUERY,
        images[1],
        question="where",
        reasoning=True,
        temperature=s.temperature,
        top_p=s.top_p,
        seed=s.seed,
        max_tokens=s.max_tokens,
    )
    [(_, fin)] = _run(reasoning_model, [req], 2)
    assert fin.reasoning is not None and fin.reasoning.text == want.reasoning
    assert fin.text == want.answer and fin.finish_reason == want.finish_reason == "length"
    config = reasoning_model.config
    room = config.text.max_context - config.image_prefix_len - fin.metrics.input_tokens
    assert len(want.reasoning_ids) == 700 and 0 < len(want.answer_ids) < 700
    assert fin.metrics.reasoning_tokens + 1 + len(want.answer_ids) == room
    assert fin.metrics.output_tokens == room - 1

    async def refused() -> EngineError:
        engine = _engine(reasoning_model, 2)
        await engine.start()
        try:
            with pytest.raises(EngineError) as info:
                async for _ in await engine.submit(replace(req, max_tokens=room)):
                    pass
            return info.value
        finally:
            await engine.close()

    err = asyncio.run(refused())
    assert err.code is ErrorCode.OUT_OF_RANGE and err.field == "max_tokens"
