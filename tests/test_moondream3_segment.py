"""Moondream 3's segment through the batched engine on the tiny model: box, paths (box-relative
and in the picture), mask and the streamed outline equal the reference generation's, at
pipeline depth 1 and 2 under every step budget, spatial references included; its prompt; and
what is refused (as before for a contract without a segment template)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from image_pipeline import PreparedImage
from tests.support.reference_memo import shared_reference
from tests.test_engine import (  # noqa: F401  (fixtures)
    BUDGETS,
    _assert_clean,
    _engine,
    _Plans,
    _wait_idle,
    images,
)
from vlm_server.engine.api import (
    Box,
    EngineError,
    ErrorCode,
    Finished,
    GenerationRequest,
    PathDelta,
    Task,
)
from vlm_server.engine.requests.tasks import TaskCompiler
from vlm_server.models import prompts
from vlm_server.models.interface import LoadedModel
from vlm_server.models.registry import preset, random_model
from vlm_server.server.in_process import InProcessEngine

REFS = ((0.5, 0.5, 0.9, 0.95),)  # a box: coordinate and size placeholders


@pytest.fixture(scope="module")
def md3_tiny() -> LoadedModel:
    # Seed 0: its paths differ from request to request (several commands, signed numbers).
    return random_model(preset("md3-tiny"), seed=0, dtype=torch.float32, progress=False)


def _requests(images: list[PreparedImage]) -> list[GenerationRequest]:  # noqa: F811
    return [
        GenerationRequest(Task.SEGMENT, images[2], object_name="car", max_tokens=40),
        GenerationRequest(Task.SEGMENT, images[0], object_name="tree", max_tokens=25),
        GenerationRequest(
            Task.SEGMENT, images[1], object_name="dog", max_tokens=30, spatial_refs=REFS
        ),
        GenerationRequest(Task.DETECT, images[0], object_name="car", max_objects=3),
    ]


@pytest.fixture(scope="module")
def expected(md3_tiny: LoadedModel, images: list[PreparedImage]) -> list:  # noqa: F811
    """The reference's answers (one at a time, each path read back from its token ids)."""
    ref = shared_reference(md3_tiny.model, md3_tiny.tokenizer)
    out: list = []
    for req in _requests(images):
        if req.task is Task.SEGMENT:
            out.append(ref.segment(req.image, req.object_name, req.max_tokens, req.spatial_refs))
        else:
            out.append(ref.detect(req.image, req.object_name, req.max_objects))
    return out


async def _stream(engine: InProcessEngine, req: GenerationRequest) -> tuple[list, Finished]:
    deltas: list = []
    async for event in await engine.submit(req):
        if isinstance(event, Finished):
            return deltas, event
        deltas.append(event)
    raise AssertionError("stream ended without Finished")


def whole_chunks(deltas: list[str], chunks: tuple[str, ...]) -> bool:
    """Whether the streamed deltas are the reference's chunks, in order, each delta one or
    more whole chunks (a reader that fell behind gets several at once)."""
    i = 0
    for delta in deltas:
        j = i + 1
        while j <= len(chunks) and "".join(chunks[i:j]) != delta:
            j += 1
        if j > len(chunks):
            return False
        i = j
    return i == len(chunks)


def _box(b: Box) -> tuple[float, float, float, float]:
    return (b.x_min, b.y_min, b.x_max, b.y_max)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("depth", [1, 2])
def test_segment_equals_the_reference(
    md3_tiny: LoadedModel,
    images: list[PreparedImage],  # noqa: F811
    expected: list,
    depth: int,
    budget: str,
) -> None:
    reqs = _requests(images)

    async def run() -> list[tuple[list, Finished]]:
        engine = _engine(md3_tiny, depth, plans, budget=budget)
        await engine.start()
        try:
            out = await asyncio.gather(*[_stream(engine, r) for r in reqs])
            await _wait_idle(engine)
            _assert_clean(engine)
            plans.check(engine, budget, splits=False)
            return out
        finally:
            await engine.close()

    plans = _Plans()
    results = asyncio.run(run())
    for req, (deltas, fin), want in zip(reqs, results, expected, strict=True):
        if req.task is Task.DETECT:
            assert [_box(b) for b in fin.boxes] == [_box(b) for b in want.boxes]
            continue
        seg, reason = want
        got = fin.segmentation
        assert got is not None and fin.finish_reason == reason
        assert _box(got.box) == seg.box and got.box_path == seg.box_path
        assert got.svg_path == seg.path and tuple(got.mask_rle) == tuple(seg.mask_counts)
        assert [[(p.x, p.y) for p in poly] for poly in got.polygons] == seg.polygons
        assert [(p.x, p.y) for p in fin.points] == list(seg.points)
        # Streamed: the box first (when the path begins), then the path's groups.
        assert all(isinstance(d, PathDelta) for d in deltas)
        assert deltas[0].box == got.box and all(d.box is None for d in deltas[1:])
        assert whole_chunks([d.chunk for d in deltas if d.chunk], seg.chunks)
        assert "".join(d.chunk for d in deltas) == seg.box_path
    paths = [want[0].box_path for want in expected[:3]]
    assert len(set(paths)) == 3  # the requests' answers differ: equality discriminates
    ref = shared_reference(md3_tiny.model, md3_tiny.tokenizer)
    unreferred, _ = ref.segment(reqs[2].image, reqs[2].object_name, reqs[2].max_tokens)
    assert unreferred.box_path != paths[2]  # and the references count


def test_the_segment_prompt_puts_no_space_before_the_object(md3_tiny: LoadedModel) -> None:
    tok = md3_tiny.tokenizer
    encode = prompts.CachedEncoder(tok)
    full = preset("moondream3.1").tokens
    assert full is not None and full.segment_language == "svg_tokens"
    assert prompts.segment_prompt(full, encode, "car") == [1, 17374, 2, *encode("car"), 3]
    tiny = md3_tiny.config.tokens
    refs = [1030, 1031]  # placeholders past the vocabulary, as spatial references make
    assert prompts.segment_prompt(tiny, encode, "car", refs) == [1, 17, 2, *refs, *encode("car"), 3]
    assert encode("car") != encode(" car")
    # Point and detect keep the space; Moondream 2's tiny segment does too.
    assert prompts.detect_prompt(tiny, encode, "car")[3:-1] == list(encode(" car"))
    md2 = preset("tiny").tokens
    assert prompts.segment_prompt(md2, encode, "car") == [1, 17, 2, *encode(" car"), 3]


@pytest.mark.parametrize(
    ("change", "code", "field"),
    [
        ({"max_tokens": 2}, ErrorCode.INVALID_ARGUMENT, "max_tokens"),  # M x y needs three
        ({"image": None}, ErrorCode.INVALID_ARGUMENT, "image"),
        ({"reasoning": True}, ErrorCode.INVALID_ARGUMENT, "reasoning"),
        ({"max_tokens": 4096}, ErrorCode.OUT_OF_RANGE, "max_tokens"),
        ({"spatial_refs": REFS * 9}, ErrorCode.INVALID_ARGUMENT, "spatial_refs"),
    ],
)
def test_bad_segment_requests_are_refused(
    md3_tiny: LoadedModel,
    images: list[PreparedImage],  # noqa: F811
    change: dict,
    code: ErrorCode,
    field: str,
) -> None:
    tasks = TaskCompiler(md3_tiny.config, md3_tiny.tokenizer)
    ok = GenerationRequest(Task.SEGMENT, images[0], object_name="car", max_tokens=3)
    tasks.build(ok).release()
    with pytest.raises(EngineError) as info:
        tasks.build(dataclasses.replace(ok, **change))
    assert (info.value.code, info.value.field) == (code, field)


def test_a_contract_without_a_segment_template_answers_unimplemented(
    md3_tiny: LoadedModel,
    images: list[PreparedImage],  # noqa: F811
) -> None:
    """Moondream 2's 2025-06 contract (the moondream2 preset) defines no segment prompt."""
    md2 = preset("moondream2").tokens
    assert md2 is not None and md2.templates.segment_prefix is None
    config = dataclasses.replace(preset("tiny"), tokens=md2)
    tasks = TaskCompiler(config, md3_tiny.tokenizer)
    with pytest.raises(EngineError) as info:
        tasks.build(GenerationRequest(Task.SEGMENT, images[0], object_name="car"))
    assert info.value.code is ErrorCode.UNIMPLEMENTED and info.value.field == "task"
    assert "defines no segment template" in info.value.message
