"""Moondream 3 on a CUDA device (skipped elsewhere): the engine's fused attention kernels,
graphs and streams serve the tau-scaled decoder and its expert layers as the reference does."""

from __future__ import annotations

import dataclasses

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
from vlm_server.engine.engine import BatchedEngine
from vlm_server.models.registry import preset, random_model
from vlm_server.reference import ReferenceGenerator

pytestmark = pytest.mark.gpu


def _check(engine: BatchedEngine) -> None:
    rt = engine.runtime
    assert rt.steps.decode_graphs and rt.steps.mixed_graphs and rt.prefill.prefix_graphs
    assert rt.pool.use_triton


@pytest.mark.parametrize("budget", BUDGETS)
def test_cuda_engine_equals_reference_md3_tiny(
    images: list[PreparedImage],  # noqa: F811
    budget: str,
) -> None:
    loaded = random_model(
        preset("md3-tiny"), seed=1, dtype=torch.float32, device="cuda", progress=False
    )
    reqs = [
        *_text_requests(images),
        GenerationRequest(Task.DETECT, images[0], object_name="car", max_objects=5),
        GenerationRequest(Task.POINT, images[1], object_name="dog", max_objects=4),
    ]
    done = _finish_all(loaded, reqs, 2, _check, budget=budget, max_batch_size=4)
    ref = ReferenceGenerator(loaded.model, loaded.tokenizer)
    for req, fin in zip(reqs[:-2], done[:-2], strict=True):
        assert fin.text == _reference_text(ref, req), req.request_id
    det, pts = done[-2:]
    assert [vars(b) for b in det.boxes] == [vars(b) for b in ref.detect(images[0], "car", 5).boxes]
    assert [vars(p) for p in pts.points] == [vars(p) for p in ref.point(images[1], "dog", 4).points]


def test_moondream3_size_layers_engine_equals_reference_fp32(
    images: list[PreparedImage],  # noqa: F811
) -> None:
    """Full-size shapes (64 experts of 1024, top-8, the real vision tower) with 6 decoder
    layers, 2 of them expert layers, in fp32 (ties are then vanishingly rare)."""
    full = preset("moondream3.1")
    config = dataclasses.replace(full, text=dataclasses.replace(full.text, n_layers=6))
    loaded = random_model(config, seed=0, dtype=torch.float32, device="cuda", progress=False)
    reqs = [
        GenerationRequest(Task.CAPTION, images[0], temperature=0, max_tokens=12),
        GenerationRequest(
            Task.QUERY, images[1], question="what is it?", temperature=0, max_tokens=9
        ),
        GenerationRequest(Task.DETECT, images[2], object_name="car", max_objects=3),
    ]
    cap, qry, det = _finish_all(loaded, reqs, 2, _check, max_batch_size=4, kv_budget_bytes=1 << 30)
    ref = ReferenceGenerator(loaded.model, loaded.tokenizer)
    assert cap.text == _reference_text(ref, reqs[0])
    assert qry.text == _reference_text(ref, reqs[1])
    assert [vars(b) for b in det.boxes] == [vars(b) for b in ref.detect(images[2], "car", 3).boxes]
