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
from vlm_server.models.registry import preset, random_model
from vlm_server.reference import ReferenceGenerator
from vlm_server.server.in_process import InProcessEngine

pytestmark = pytest.mark.gpu


def _check(engine: InProcessEngine) -> None:
    rt = engine.batched.runtime
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


@pytest.mark.parametrize("budget", BUDGETS)
def test_cuda_engine_segments_as_the_reference_md3_tiny(
    images: list[PreparedImage],  # noqa: F811
    budget: str,
) -> None:
    """Moondream 3's segment (box, per-token path under its grammar's masks) on the device."""
    loaded = random_model(
        preset("md3-tiny"), seed=0, dtype=torch.float32, device="cuda", progress=False
    )
    refs = ((0.5, 0.5, 0.9, 0.95),)
    reqs = [
        GenerationRequest(Task.SEGMENT, images[2], object_name="car", max_tokens=40),
        GenerationRequest(Task.SEGMENT, images[1], object_name="dog", max_tokens=30),
        GenerationRequest(
            Task.SEGMENT, images[1], object_name="dog", max_tokens=30, spatial_refs=refs
        ),
    ]
    done = _finish_all(loaded, reqs, 2, _check, budget=budget, max_batch_size=4)
    ref = ReferenceGenerator(loaded.model, loaded.tokenizer)
    for req, fin in zip(reqs, done, strict=True):
        want, reason = ref.segment(req.image, req.object_name, req.max_tokens, req.spatial_refs)
        got = fin.segmentation
        assert got is not None and fin.finish_reason == reason
        assert (got.box.x_min, got.box.y_min, got.box.x_max, got.box.y_max) == want.box
        assert (got.box_path, got.svg_path) == (want.box_path, want.path)
        assert tuple(got.mask_rle) == tuple(want.mask_counts)


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


# ---- the fused expert kernels ---------------------------------------------------------------

DEVICE = "cuda"
SHAPES = [  # tokens, top_k, experts, dim, expert width
    (1, 8, 64, 2048, 1024),
    (7, 3, 8, 64, 32),
    (64, 8, 64, 2048, 1024),
    (300, 2, 16, 96, 48),
    (801, 8, 64, 256, 128),
]


def _case(
    n: int, k: int, e: int, d: int, i: int, dtype: torch.dtype, uneven: bool, seed: int
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    if uneven and n > 4:  # most tokens on the same experts, the rest spread
        ids[: n * 3 // 4] = torch.arange(k)
    w1 = torch.randn(e, 2 * i, d, generator=gen) / d**0.5
    w1[:, i:] *= 0.25
    w2 = torch.randn(e, d, i, generator=gen) / i**0.5
    return tuple(
        t.to(DEVICE, dtype if t.is_floating_point() else t.dtype) for t in (x, ids, w1, w2)
    )


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("uneven", [False, True])
def test_fused_experts_equal_the_plain_path(
    shape: tuple[int, ...], dtype: torch.dtype, uneven: bool
) -> None:
    from vlm_server.models.moondream3.moe import experts_loop
    from vlm_server.models.moondream3.moe_triton import experts_fused

    x, ids, w1, w2 = _case(*shape, dtype, uneven, seed=sum(shape))
    got = experts_fused(x, ids, w1, w2).float()
    want = experts_loop(x.float(), ids, w1.float(), w2.float())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("shape", SHAPES[:3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_fp8_experts_equal_the_dequantized_plain_path(
    shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    from vlm_server.models.moondream3 import fp8_experts
    from vlm_server.models.moondream3.moe import experts_loop
    from vlm_server.models.moondream3.moe_triton import experts_fused

    x, ids, w1, w2 = _case(*shape, torch.float32, True, seed=7)
    (q1, s1), (q2, s2) = fp8_experts.quantize(w1), fp8_experts.quantize(w2)
    got = experts_fused(x.to(dtype), ids, q1, q2, s1, s2).float()
    d1 = fp8_experts.dequantize(q1, s1, torch.float32)
    d2 = fp8_experts.dequantize(q2, s2, torch.float32)
    want = experts_loop(x.to(dtype).float(), ids, d1, d2)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_fused_experts_replay_in_a_cuda_graph_with_new_routing() -> None:
    from vlm_server.models.moondream3.moe_triton import experts_fused

    x, ids, w1, w2 = _case(16, 8, 64, 256, 128, torch.bfloat16, False, seed=3)
    static_x, static_ids = x.clone(), ids.clone()
    experts_fused(static_x, static_ids, w1, w2)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts_fused(static_x, static_ids, w1, w2)
    x2, ids2, _, _ = _case(16, 8, 64, 256, 128, torch.bfloat16, True, seed=4)
    static_x.copy_(x2)
    static_ids.copy_(ids2)
    graph.replay()
    torch.testing.assert_close(out, experts_fused(x2, ids2, w1, w2), atol=0, rtol=0)


def test_md3_layout_on_an_fp8_gpu_keeps_fp8_experts_and_serves_as_the_reference(
    tmp_path: object,
    images: list[PreparedImage],  # noqa: F811
) -> None:
    from pathlib import Path

    from vlm_server.models.moondream3.fp8_experts import fp8_experts_supported
    from vlm_server.models.registry import load_model, write_checkpoint

    out = write_checkpoint(preset("md3-tiny"), Path(str(tmp_path)), layout="md3", progress=False)
    loaded = load_model(out, dtype=torch.bfloat16, device="cuda", progress=False)
    bank = loaded.model.text.blocks[2].mlp.fc1  # type: ignore[attr-defined]
    fp8 = fp8_experts_supported(torch.device("cuda"))
    assert (bank.weight.dtype == torch.float8_e4m3fn) is fp8
    reqs = [
        GenerationRequest(Task.CAPTION, images[0], temperature=0, max_tokens=12),
        GenerationRequest(Task.DETECT, images[1], object_name="car", max_objects=3),
    ]
    cap, det = _finish_all(loaded, reqs, 2, _check, max_batch_size=4)
    ref = ReferenceGenerator(loaded.model, loaded.tokenizer)
    assert cap.text == _reference_text(ref, reqs[0])
    assert [vars(b) for b in det.boxes] == [vars(b) for b in ref.detect(images[1], "car", 3).boxes]


def test_auto_serves_an_fp8_build_with_the_fp8_tower(tmp_path: object, caplog) -> None:
    """`vision_fp8` auto (the server's default) on an FP8-expert checkpoint on a chip with FP8
    units: the tower runs its FP8 products, and the start-up log says why."""
    import logging
    from pathlib import Path

    from vlm_server.engine.config import EngineConfig
    from vlm_server.engine.engine import BatchedEngine
    from vlm_server.models.registry import load_model, write_checkpoint

    out = write_checkpoint(preset("md3-tiny"), Path(str(tmp_path)), layout="md3", progress=False)
    loaded = load_model(out, dtype=torch.bfloat16, device="cuda", progress=False)
    if not loaded.model.experts_in_fp8:  # type: ignore[attr-defined]
        pytest.skip("this GPU holds no FP8 experts")
    with caplog.at_level(logging.INFO, logger="vlm_server.engine.device.runtime"):
        engine = BatchedEngine(loaded, EngineConfig(vision_fp8=None, kv_budget_bytes=64 << 20))
    assert "vision_fp8 auto: on, an FP8 build" in caplog.text
    assert loaded.model.vision.fp8 is not None  # type: ignore[attr-defined]
    del engine


# ---- the routing and combine kernels, the tile table --------------------------------------


def _distinct_logits(n: int, e: int, k: int, uneven: bool, seed: int) -> torch.Tensor:
    """Distinct logits per token (exact in bf16), so the top-k is unique."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.stack([torch.randperm(e, generator=gen) for _ in range(n)]).float() / 8 - 4
    if uneven and n > 4:
        rows[: n * 3 // 4, :k] += 16
    return rows.to(DEVICE, torch.bfloat16)


@pytest.mark.parametrize("n", [1, 37, 64, 65, 730, 2048, 5840])
@pytest.mark.parametrize("uneven", [False, True])
@pytest.mark.parametrize("block_m", [16, 64])
def test_route_align_kernels_equal_route_then_align(n: int, uneven: bool, block_m: int) -> None:
    from vlm_server.models.moondream3.moe import route
    from vlm_server.models.moondream3.moe_routing import align, align_fused, route_align

    logits = _distinct_logits(n, 64, 8, uneven, seed=n)
    weights, ids, routing = route_align(logits, 8, block_m)
    want_w, want_ids = route(logits, 8)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=8e-3, atol=0)
    for got in (routing, align_fused(want_ids, 64, block_m)):
        for a, b in zip(got[:3], align(want_ids, 64, block_m), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 64, 730])
def test_combine_fused_is_bit_exact(dtype: torch.dtype, n: int) -> None:
    from vlm_server.models.moondream3.moe import combine_slots
    from vlm_server.models.moondream3.moe_routing import combine_fused

    y = torch.randn(n, 8, 2048, device=DEVICE).to(dtype) * 3
    w = torch.softmax(torch.randn(n, 8, device=DEVICE), -1).to(dtype)
    assert torch.equal(combine_fused(y, w), combine_slots(y, w))


def _table_tiles() -> list[object]:
    from vlm_server.models.moondream3.moe_triton import TILES, ExpertTiles, Tile

    split = ExpertTiles(16, Tile(64, 128, 4, 4, 3), Tile(32, 128, 4, 4, 4))  # uneven K splits
    default = ExpertTiles(16, Tile(), Tile())  # Triton's default warps and stages
    return [*(t for _, t in TILES), default, split]


@pytest.mark.parametrize("tiles", range(len(_table_tiles())))
@pytest.mark.parametrize("n", [1, 64, 300])
@pytest.mark.parametrize("fp8", [False, True])
def test_fused_experts_with_each_tile_equal_the_plain_path(tiles: int, n: int, fp8: bool) -> None:
    from vlm_server.models.moondream3 import fp8_experts
    from vlm_server.models.moondream3.moe import experts_loop
    from vlm_server.models.moondream3.moe_triton import experts_fused

    if fp8 and not fp8_experts.fp8_experts_supported(torch.device(DEVICE)):
        pytest.skip("FP8 experts need compute capability 9.0")
    x, ids, w1, w2 = _case(n, 8, 64, 2048, 1024, torch.float32, True, seed=n)
    s1 = s2 = None
    if fp8:
        (w1, s1), (w2, s2) = fp8_experts.quantize(w1), fp8_experts.quantize(w2)
        d1 = fp8_experts.dequantize(w1, s1, torch.float32)
        d2 = fp8_experts.dequantize(w2, s2, torch.float32)
    else:
        w1, w2 = w1.bfloat16(), w2.bfloat16()
        d1, d2 = w1.float(), w2.float()
    xb = x.bfloat16()
    got = experts_fused(xb, ids, w1, w2, s1, s2, tiles=_table_tiles()[tiles]).float()
    want = experts_loop(xb.float(), ids, d1, d2)
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


@torch.no_grad()
def test_fused_moe_layer_equals_the_plain_layer_and_replays_with_new_routing() -> None:
    """The whole fused layer (router, route + grouping, grouped kernels, combine) at full
    size with FP8 experts where the chip takes them, against the dense path on the same
    weights; then captured in a graph and replayed on inputs that route elsewhere."""
    from vlm_server.models.moondream3 import fp8_experts
    from vlm_server.models.moondream3.config import MoeConfig
    from vlm_server.models.moondream3.moe import MoeMLP, route
    from vlm_server.models.moondream3.moe_routing import route_align

    torch.manual_seed(0)
    mlp = MoeMLP(2048, MoeConfig()).to(DEVICE)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.02)
    mlp = mlp.bfloat16()
    if fp8_experts.fp8_experts_supported(torch.device(DEVICE)):
        mlp.fc1.use_fp8()
        mlp.fc2.use_fp8()
    for n in (1, 33, 730):
        h = torch.randn(1, n, 2048, device=DEVICE, dtype=torch.bfloat16)
        h[:, : n // 2] += 2 * torch.randn(2048, device=DEVICE, dtype=torch.bfloat16)  # uneven
        # bf16 logits tie now and then; a tie at the k-th place may go to another expert in
        # torch.topk: the routings must agree wherever there is none, outputs are compared there
        logits = mlp.router(h[0])
        top = logits.float().topk(9).values
        clear = top[:, 7] > top[:, 8]
        same = route_align(logits, 8, 16)[1].sort(1).values == route(logits, 8)[1].sort(1).values
        same = same.all(1)
        assert same[clear].all() and same.float().mean() > 0.9
        mlp.method = "dense"  # route() on the same logits, every expert computed
        want = mlp(h)[0].float()
        mlp.method = "fused"
        torch.testing.assert_close(mlp(h)[0].float()[same], want[same], atol=3e-2, rtol=3e-2)
    static = torch.randn(1, 48, 2048, device=DEVICE, dtype=torch.bfloat16)
    mlp(static)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mlp(static)
    new = torch.randn(1, 48, 2048, device=DEVICE, dtype=torch.bfloat16)
    new[:, :40] += 3 * torch.randn(2048, device=DEVICE, dtype=torch.bfloat16)
    static.copy_(new)
    graph.replay()
    torch.testing.assert_close(out, mlp(new), atol=0, rtol=0)
