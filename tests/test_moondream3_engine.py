"""The batched engine on the tiny Moondream 3 model equals the reference generation under
every step budget: whole prompts, chunked prompts, and prompts riding with image prefixes
(each path hands the decoder's caches a different mix of positions)."""

from __future__ import annotations

import pytest
import torch

from image_pipeline import PreparedImage
from tests.support.reference_memo import shared_reference
from tests.test_engine import (  # noqa: F401  (fixtures)
    BUDGETS,
    _finish_all,
    _reference_text,
    _text_requests,
    images,
)
from vlm_server.engine.api import GenerationRequest, Task
from vlm_server.models.interface import LoadedModel
from vlm_server.models.registry import preset, random_model


@pytest.fixture(scope="module")
def md3_tiny() -> LoadedModel:
    return random_model(preset("md3-tiny"), seed=1, dtype=torch.float32, progress=False)


@pytest.mark.parametrize("budget", BUDGETS)
def test_engine_equals_reference_on_moondream3_tiny(
    md3_tiny: LoadedModel,
    images: list[PreparedImage],  # noqa: F811
    budget: str,
) -> None:
    reqs = [
        *_text_requests(images),
        GenerationRequest(Task.DETECT, images[0], object_name="car", max_objects=4),
        GenerationRequest(Task.POINT, images[1], object_name="dog", max_objects=4),
    ]
    done = _finish_all(md3_tiny, reqs, 2, budget=budget, max_batch_size=4)
    ref = shared_reference(md3_tiny.model, md3_tiny.tokenizer)
    for req, fin in zip(reqs[:-2], done[:-2], strict=True):
        assert fin.text == _reference_text(ref, req), req.request_id
    det, pts = done[-2:]
    assert [vars(b) for b in det.boxes] == [vars(b) for b in ref.detect(images[0], "car", 4).boxes]
    assert [vars(p) for p in pts.points] == [vars(p) for p in ref.point(images[1], "dog", 4).points]


@pytest.mark.parametrize("depth", [1, 2])
def test_reasoning_and_spatial_refs_on_moondream3_tiny(
    md3_tiny: LoadedModel,
    images: list[PreparedImage],  # noqa: F811
    depth: int,
) -> None:
    """Moondream 3's reasoning rules (eos and size suppressed, coordinates over 1023) and spatial
    references, against the reference's loop."""
    from vlm_server.reference import SamplingSettings

    refs = ((0.3, 0.6), (0.1, 0.2, 0.7, 0.8))
    settings = [SamplingSettings(temperature=1.0, top_p=0.9, seed=s, max_tokens=24) for s in (0, 1)]
    reqs = [
        GenerationRequest(
            Task.QUERY,
            images[i],
            question="where",
            reasoning=True,
            temperature=s.temperature,
            top_p=s.top_p,
            seed=s.seed,
            max_tokens=s.max_tokens,
            spatial_refs=refs if i else (),
        )
        for i, s in enumerate(settings)
    ]
    reqs.append(
        GenerationRequest(
            Task.POINT, images[0], object_name="car", max_objects=3, spatial_refs=refs
        )
    )
    done = _finish_all(md3_tiny, reqs, depth, max_batch_size=4)
    ref = shared_reference(md3_tiny.model, md3_tiny.tokenizer)
    for req, s, fin in zip(reqs, settings, done, strict=False):
        want = ref.reasoning_query(req.image, req.question, s, req.spatial_refs)
        assert fin.reasoning is not None and fin.reasoning.text == want.reasoning
        assert fin.text == want.answer and fin.finish_reason == want.finish_reason
    built, _, _ = ref.run(reqs[-1])
    assert [tuple(vars(p).values()) for p in done[-1].points] == list(built.grammar.objects)
