"""GPU checks (run on a CUDA machine; skipped elsewhere): the Triton kernel against the
PyTorch path, and the engine (graphs, Triton attention, streams) against the reference."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from image_pipeline import PreparedImage
from tests.test_engine import (  # noqa: F401  (fixtures)
    BUDGETS,
    _collect,
    _engine,
    _text_requests,
    _wait_idle,
    images,
)
from vlm_server.config import preset
from vlm_server.engine.api import GenerationRequest, Task
from vlm_server.engine.device.kernels.paged_attention import paged_attention
from vlm_server.reference import ReferenceGenerator, SamplingSettings
from vlm_server.weights.loader import LoadedModel, random_model

pytestmark = pytest.mark.gpu


def _cuda(loaded: LoadedModel) -> LoadedModel:
    model = copy.deepcopy(loaded.model).cuda()
    return LoadedModel(model, loaded.tokenizer, loaded.config, loaded.source)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_paged_decode_matches_torch(dtype: torch.dtype) -> None:
    from vlm_server.engine.device.kernels.triton_attention import paged_decode_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    b, h, kvh, hd, ps, pages = 5, 32, 32, 64, 16, 300
    kp = torch.randn(pages, ps, kvh, hd, device="cuda", generator=g).to(dtype)
    vp = torch.randn(pages, ps, kvh, hd, device="cuda", generator=g).to(dtype)
    table = torch.randint(1, pages, (9, 128), device="cuda", dtype=torch.int32, generator=g)
    rows = torch.tensor([8, 0, 3, 3, 5], device="cuda")
    lengths = torch.tensor([1, 17, 730, 1500, 2048], device="cuda")
    q = torch.randn(b, h, hd, device="cuda", generator=g).to(dtype)
    got = paged_decode_attention(q, kp, vp, table, rows, lengths)
    want = paged_attention(
        q[:, :, None].float(), kp.float(), vp.float(), table[rows].long(), (lengths - 1)[:, None], 0
    )[:, :, 0]
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("depth", [1, 2])
def test_cuda_engine_equals_reference_tiny(
    text_model: LoadedModel,
    region_model: LoadedModel,
    images: list[PreparedImage],  # noqa: F811
    depth: int,
    budget: str,
) -> None:
    """Decode-only steps replay graphs; mixed steps (prompts chunked under the "chunked"
    budget) run eagerly between them."""
    tm, rm = _cuda(text_model), _cuda(region_model)
    reqs = _text_requests(images)
    regions = [
        GenerationRequest(Task.DETECT, images[0], object_name="car", max_objects=5),
        GenerationRequest(Task.POINT, images[1], object_name="dog", max_objects=4),
    ]

    async def run(loaded: LoadedModel, batch: list[GenerationRequest]) -> list:
        engine = _engine(loaded, depth, budget=budget, max_batch=4)
        await engine.start()
        assert engine.runtime.decode_graphs and engine.runtime.use_triton
        try:
            out = await asyncio.gather(*[_collect(engine, r) for r in batch])
            await _wait_idle(engine)
            return [fin for _, fin in out]
        finally:
            await engine.close()

    ref = ReferenceGenerator(tm.model, tm.tokenizer)
    for req, fin in zip(reqs, asyncio.run(run(tm, reqs)), strict=True):
        s = SamplingSettings(
            temperature=req.temperature, top_p=req.top_p, max_tokens=req.max_tokens, seed=req.seed
        )
        want = (
            ref.caption(req.image, req.caption_length, s)
            if req.task is Task.CAPTION
            else ref.query(req.image, req.question, s)
        )
        assert fin.text == want.text, req.request_id
    rref = ReferenceGenerator(rm.model, rm.tokenizer)
    det, pts = asyncio.run(run(rm, regions))
    assert [vars(b) for b in det.boxes] == [vars(b) for b in rref.detect(images[0], "car", 5).boxes]
    assert [vars(p) for p in pts.points] == [
        vars(p) for p in rref.point(images[1], "dog", 4).points
    ]


def test_moondream2_size_engine_equals_reference_fp32(
    images: list[PreparedImage],  # noqa: F811
) -> None:
    """Full-size random weights in fp32 (ties are then vanishingly rare)."""
    loaded = random_model(
        preset("moondream2"), seed=0, dtype=torch.float32, device="cuda", progress=False
    )
    reqs = [
        GenerationRequest(Task.CAPTION, images[0], temperature=0, max_tokens=12),
        GenerationRequest(
            Task.QUERY, images[1], question="what is it?", temperature=0, max_tokens=9
        ),
        GenerationRequest(Task.DETECT, images[2], object_name="car", max_objects=3),
    ]

    async def run() -> list:
        engine = _engine(loaded, 2, max_batch=4, kv_budget_bytes=2 << 30)
        await engine.start()
        try:
            out = await asyncio.gather(*[_collect(engine, r) for r in reqs])
            await _wait_idle(engine)
            return [fin for _, fin in out]
        finally:
            await engine.close()

    cap, qry, det = asyncio.run(run())
    ref = ReferenceGenerator(loaded.model, loaded.tokenizer)
    greedy = SamplingSettings(temperature=0, max_tokens=12)
    assert cap.text == ref.caption(images[0], "normal", greedy).text
    assert (
        qry.text
        == ref.query(images[1], "what is it?", SamplingSettings(temperature=0, max_tokens=9)).text
    )
    assert [vars(b) for b in det.boxes] == [vars(b) for b in ref.detect(images[2], "car", 3).boxes]
