"""The batched engine on the tiny Moondream 3 model equals the reference generation under
every step budget: whole prompts, chunked prompts, and prompts riding with image prefixes
(each path hands the decoder's caches a different mix of positions)."""

from __future__ import annotations

import pytest
import torch

from image_pipeline import PreparedImage
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
from vlm_server.reference import ReferenceGenerator


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
    ref = ReferenceGenerator(md3_tiny.model, md3_tiny.tokenizer)
    for req, fin in zip(reqs[:-2], done[:-2], strict=True):
        assert fin.text == _reference_text(ref, req), req.request_id
    det, pts = done[-2:]
    assert [vars(b) for b in det.boxes] == [vars(b) for b in ref.detect(images[0], "car", 4).boxes]
    assert [vars(p) for p in pts.points] == [vars(p) for p in ref.point(images[1], "dog", 4).points]
