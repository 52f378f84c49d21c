"""Grounded reasoning and spatial references on CUDA (graphs, Triton attention, streams)
against the reference on the same device (run on a CUDA machine; skipped elsewhere)."""

from __future__ import annotations

import pytest

from image_pipeline import PreparedImage
from tests.test_engine_gpu import _cuda
from tests.test_engine_reasoning import REASONING_CASES, REFS, _run, images  # noqa: F401
from vlm_server.engine.api import GenerationRequest, Task
from vlm_server.models.interface import LoadedModel
from vlm_server.reference import ReferenceGenerator, SamplingSettings

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("depth", [1, 2])
def test_cuda_reasoning_and_refs_equal_the_reference(
    reasoning_model: LoadedModel,
    tiny: LoadedModel,
    images: list[PreparedImage],  # noqa: F811
    depth: int,
) -> None:
    model = _cuda(reasoning_model)
    ref = ReferenceGenerator(model.model, model.tokenizer)
    settings = [
        SamplingSettings(temperature=1.0, top_p=0.3, seed=s, max_tokens=40)
        for _, s in REASONING_CASES
    ]
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
        )
        for (i, _), s in zip(REASONING_CASES, settings, strict=True)
    ]
    refs = [
        GenerationRequest(
            Task.QUERY,
            images[0],
            question="what is here",
            temperature=0,
            max_tokens=12,
            spatial_refs=REFS,
        ),
        GenerationRequest(
            Task.DETECT, images[1], object_name="car", max_objects=3, spatial_refs=REFS[1:]
        ),
    ]
    results = _run(model, reqs + refs, depth, budget="chunked")
    for req, s, (_, fin) in zip(reqs, settings, results, strict=False):
        want = ref.reasoning_query(req.image, req.question, s)
        assert fin.reasoning is not None and fin.reasoning.text == want.reasoning
        assert fin.text == want.answer and fin.finish_reason == want.finish_reason
    for req, (_, fin) in zip(refs, results[len(reqs) :], strict=True):
        built, reason, out = ref.run(req)
        if req.task is Task.QUERY:
            assert fin.text == ref.tokenizer.decode(out)
        else:
            assert [tuple(vars(b).values()) for b in fin.boxes] == list(built.grammar.objects)
        assert fin.finish_reason == reason
