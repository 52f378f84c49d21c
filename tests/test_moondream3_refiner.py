"""Moondream 3's segmentation refiner on the CPU: the head's released layout, its file, the
mask work (components, clean-up, tracing) and the pipeline around the head."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from decoding.segment_output import SegmentResult, rasterize, rle_decode, rle_encode
from vlm_server.models.common.graphed_call import GraphedCall
from vlm_server.models.common.vision import VisionEncoder
from vlm_server.models.moondream2.config import VisionConfig
from vlm_server.models.moondream3 import refiner_masks
from vlm_server.models.moondream3.refiner import SegmentRefiner, load_head, save_head
from vlm_server.models.moondream3.refiner_head import RefinerHead, random_head

TINY = {"enc_dim": 64, "grid": 27, "width": 64}


def test_the_head_has_the_released_files_layout() -> None:
    state = RefinerHead().state_dict()
    assert len(state) == 150  # the published file's tensor and parameter counts
    assert sum(t.numel() for t in state.values()) == 6_147_460
    head = random_head(**TINY)
    final, early = torch.randn(2, 729, 64), torch.randn(2, 729, 64)
    mask = torch.rand(2, 1, 50, 40)
    logits, iou = head(final, early, mask)
    assert logits.shape == (2, 4, 50, 40) and iou.shape == (2, 4)
    again = random_head(**TINY)(final, early, mask)[1]
    assert torch.equal(iou, again)  # seeded


def test_a_refiner_file_loads_and_a_wrong_tensor_is_named(tmp_path: Path) -> None:
    head = random_head(seed=3, **TINY)
    path = tmp_path / "model.pt"
    save_head(head, path)
    loaded = load_head(path, RefinerHead(**TINY))
    for name, t in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    torch.save(head.state_dict(), tmp_path / "bare.pt")  # a bare state dict is taken too
    load_head(tmp_path / "bare.pt", RefinerHead(**TINY))
    state = head.state_dict()
    state["iou_token"] = torch.zeros(2, 64)
    torch.save({"head": state}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=r"iou_token has shape \[2, 64\].*\[1, 64\]"):
        load_head(tmp_path / "bad.pt", RefinerHead(**TINY))
    del state["iou_token"]
    torch.save({"head": state}, tmp_path / "short.pt")
    with pytest.raises(ValueError, match=r"missing tensors.*iou_token"):
        load_head(tmp_path / "short.pt", RefinerHead(**TINY))


def _flood_labels(mask: np.ndarray) -> np.ndarray:
    """8-connected labels by flood fill, first-pixel (row-major) order: the oracle."""
    h, w = mask.shape
    labels = np.zeros((h, w), np.int32)
    n = 0
    for y in range(h):
        for x in range(w):
            if mask[y, x] and not labels[y, x]:
                n += 1
                stack = [(y, x)]
                labels[y, x] = n
                while stack:
                    cy, cx = stack.pop()
                    for dy in (-1, 0, 1):
                        for dx in (-1, 0, 1):
                            ny, nx = cy + dy, cx + dx
                            if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not labels[ny, nx]:
                                labels[ny, nx] = n
                                stack.append((ny, nx))
    return labels


@pytest.mark.parametrize("seed", range(6))
def test_components_match_a_flood_fill(seed: int) -> None:
    rng = np.random.default_rng(seed)
    mask = rng.random((23, 31)) < (0.3 + 0.1 * seed)
    labels, sizes = refiner_masks.components(mask)
    want = _flood_labels(mask)
    assert np.array_equal(labels, want)
    assert sizes.tolist() == np.bincount(want.ravel(), minlength=want.max() + 1).tolist()


def test_clean_mask_fills_small_holes_drops_small_islands_and_closes() -> None:
    mask = np.zeros((100, 100), bool)
    mask[10:60, 10:60] = True
    mask[20:23, 20:23] = False  # a 9-pixel hole: under 0.15% of 10000 (15 pixels)
    mask[30:40, 30:40] = False  # a 100-pixel hole: kept
    mask[80:82, 80:82] = True  # a 4-pixel island: dropped
    mask[10:60, 70] = True  # a 50-pixel line: kept, and closed onto nothing
    out = refiner_masks.clean_mask(mask)
    assert out[20:23, 20:23].all() and not out[32:38, 32:38].any()
    assert not out[80:82, 80:82].any() and out[10:60, 70].all()
    gap = np.zeros((40, 40), bool)
    gap[5:35, 5:19] = True
    gap[5:35, 20:35] = True  # a one-pixel slit: the closing fills it
    assert refiner_masks.clean_mask(gap)[10:30, 19].all()
    edge = np.zeros((30, 30), bool)
    edge[:, :10] = True  # touching the border: the erosion leaves the edge alone
    assert np.array_equal(refiner_masks.clean_mask(edge), edge)
    specks = np.zeros((100, 100), bool)
    specks[5:7, 5:7] = True
    specks[50:53, 50:53] = True  # every island small: the largest stays
    out = refiner_masks.clean_mask(specks)
    assert out[50:53, 50:53].all() and not out[5:7, 5:7].any()


def test_boxes_rasters_and_traces() -> None:
    assert refiner_masks.expand_box((0.25, 0.25, 0.75, 0.5), 100, 80) == (12, 15, 87, 45)
    assert refiner_masks.expand_box((0.0, 0.0, 1.0, 1.0), 100, 80) == (0, 0, 100, 80)
    square = [[(0.2, 0.2), (0.6, 0.2), (0.6, 0.6), (0.2, 0.6)]]
    coarse = refiner_masks.coarse_mask(square, 50, 50)
    assert coarse[10:30, 10:30].all() and coarse.sum() == 400
    mask = np.zeros((60, 80), bool)
    mask[10:40, 20:60] = True
    mask[20:30, 30:40] = False
    traced = refiner_masks.trace(mask)
    assert traced is not None
    assert traced.box == (20 / 80, 10 / 60, 60 / 80, 40 / 60)
    assert traced.box_path.startswith("M") and traced.box_path.endswith("z")
    assert traced.box_path.count("M") == 2 and "0." not in traced.box_path.replace("-0.", "")
    assert traced.path.startswith("M ") and traced.path.count("Z") == 2
    # the outline, filled, is the mask again (the hole is its own polygon: union fill)
    drawn = rasterize(traced.polygons[:1], 80, 60)
    outer = mask.copy()
    outer[20:30, 30:40] = True
    assert (drawn & outer).sum() / (drawn | outer).sum() > 0.9  # corners rounded
    assert refiner_masks.trace(np.zeros((5, 5), bool)) is None


class _Echo(nn.Module):
    """A head stand-in: hypothesis 1 is the input mask (logits +-10), the others empty, and
    hypothesis 1 predicted best; ``empty``: every hypothesis empty."""

    def __init__(self, empty: bool = False) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.zeros(1))
        self.empty = empty

    def forward(self, final: torch.Tensor, early: torch.Tensor, mask: torch.Tensor):
        b, _, h, w = mask.shape
        logits = torch.full((b, 4, h, w), -10.0)
        if not self.empty:
            logits[:, 1] = torch.where(mask[:, 0] > 0.5, 10.0, -10.0)
        return logits, torch.tensor([[0.1, 0.9, 0.2, 0.3]]).expand(b, -1)


def _coarse(width: int, height: int) -> SegmentResult:
    polygon = [(0.3, 0.25), (0.7, 0.25), (0.7, 0.75), (0.3, 0.75)]
    return SegmentResult(
        box=(0.3, 0.25, 0.7, 0.75),
        path="M 0.3 0.25 L 0.7 0.25 L 0.7 0.75 L 0.3 0.75 Z",
        polygons=[polygon],
        mask_size=(height, width),
        mask_counts=rle_encode(rasterize([polygon], width, height)),
        box_path="M 0 0 L 1 0 L 1 1 L 0 1 Z",
        chunks=("M 0 0", "L 1 0"),
        points=((0.5, 0.5),),
    )


def _features(cfg: VisionConfig, early_layer: int):
    torch.manual_seed(0)
    tower = VisionEncoder(cfg).eval()
    with torch.no_grad():
        for p in tower.parameters():
            p.normal_(std=0.05)

    def run(crops: torch.Tensor):
        with torch.no_grad():
            return tower.encode_early(crops, early_layer)

    return tower, run


def test_the_refiner_keeps_what_the_head_keeps_and_falls_back_on_nothing() -> None:
    cfg = VisionConfig(enc_dim=64, enc_n_layers=2, enc_n_heads=4, enc_ff_dim=128)
    _, features = _features(cfg, 0)
    image = np.random.default_rng(0).integers(0, 256, (90, 120, 3), dtype=np.uint8)
    coarse = _coarse(120, 90)
    echo = SegmentRefiner(_Echo(), features, cfg.crop_size)  # type: ignore[arg-type]
    refined = echo.refine(image, coarse)
    assert refined is not None
    want = rasterize(coarse.polygons, 120, 90)
    got = rle_decode(refined.mask_counts, refined.mask_size)
    assert (got & want).sum() / (got | want).sum() > 0.95  # through both resizes, cleaned
    assert refined.box == pytest.approx(coarse.box, abs=0.02)
    assert refined.box_path != coarse.box_path and refined.chunks == coarse.chunks
    assert refined.points == coarse.points and refined.mask_size == (90, 120)
    blank = SegmentRefiner(_Echo(empty=True), features, cfg.crop_size)  # type: ignore[arg-type]
    assert blank.refine(image, coarse) is None  # an empty mask keeps the coarse segment
    half = echo.refine(image[::2, ::2].copy(), coarse)  # pixels of a reduced-scale decode
    assert half is not None and half.mask_size == (90, 120)
    assert half.box == pytest.approx(coarse.box, abs=0.03)
    with pytest.raises(ValueError, match="uint8 RGB"):
        echo.refine(image[..., 0], coarse)


def test_the_refiner_runs_a_random_head_over_the_towers_features() -> None:
    cfg = VisionConfig(enc_dim=64, enc_n_layers=2, enc_n_heads=4, enc_ff_dim=128)
    tower, features = _features(cfg, 1)
    crops = torch.randn(1, 3, cfg.crop_size, cfg.crop_size)
    final, early = features(crops)
    with torch.no_grad():
        want = tower.post_ln(tower.blocks[1](tower.blocks[0](
            tower.patch_emb(tower.patchify(crops)) + tower.pos_emb)))  # fmt: skip
    assert torch.allclose(final, want, atol=1e-5) and early.shape == final.shape
    with pytest.raises(ValueError, match="early_layer 2 outside the 2 blocks"):
        tower.encode_early(crops, 2)
    refiner = SegmentRefiner(random_head(**TINY), features, cfg.crop_size)
    image = np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    out = refiner.refine(image, _coarse(64, 64))
    if out is not None:  # random weights: any mask, or none; the result always well formed
        assert out.mask_size == (64, 64) and 0.0 <= out.box[0] < out.box[2] <= 1.0
        assert out.box_path.startswith("M") and out.path.startswith("M ")


@pytest.mark.gpu
def test_the_refiner_at_full_size_on_cuda_matches_the_cpu() -> None:
    """The released sizes (tower 1152 wide, 27 blocks; the 6.1M-parameter head) on CUDA in
    float32 give the CPU's mask, and in bf16 a well-formed answer."""
    cfg = VisionConfig()
    tower, _ = _features(cfg, 8)
    head = random_head(seed=2)
    image = np.random.default_rng(2).integers(0, 256, (300, 400, 3), dtype=np.uint8)
    coarse = _coarse(400, 300)
    crop, mask = image[50:250, 80:320], rasterize(coarse.polygons, 400, 300)[50:250, 80:320]
    masks = []
    for device in ("cpu", "cuda"):
        t, h = tower.to(device), head.to(device)
        refiner = SegmentRefiner(h, lambda c, t=t: t.encode_early(c, 8), cfg.crop_size)
        masks.append(refiner.refine_crop(crop, mask))
    assert (masks[0] == masks[1]).mean() > 0.99  # fp32 on both: rounding apart, the same
    t, h = tower.to("cuda", torch.bfloat16), head.to("cuda", torch.bfloat16)
    refiner = SegmentRefiner(h, lambda c: t.encode_early(c, 8), cfg.crop_size)
    out = refiner.refine(image, coarse)
    if out is not None:
        assert out.mask_size == (300, 400) and out.box_path.startswith("M")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_graphed_refiner_answers_as_the_eager_one(dtype: torch.dtype) -> None:
    """The tower pass and head rounds captured once (`graphed`) give the eager masks, crop
    after crop (the graph's static inputs are refilled per call)."""
    cfg = VisionConfig()
    tower, _ = _features(cfg, 9)
    t, h = tower.to("cuda", dtype), random_head(seed=3).to("cuda", dtype)
    refiners = [
        SegmentRefiner(h, lambda c: t.encode_early(c, 8), cfg.crop_size, graphed=graphed)
        for graphed in (False, True)
    ]
    rng = np.random.default_rng(3)
    for size in ((200, 240), (90, 300), (200, 240)):
        crop = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
        mask = np.zeros(size, bool)
        mask[size[0] // 4 : size[0] * 3 // 4, size[1] // 3 : size[1] * 2 // 3] = True
        eager, graphed = (r.refine_crop(crop, mask) for r in refiners)
        assert (eager == graphed).mean() > 0.999
    with pytest.raises(ValueError, match="input 1 has shape"):
        refiners[1]._rounds(torch.zeros(1, 3, cfg.crop_size, cfg.crop_size, device="cuda"),
                            torch.zeros(1, 1, 8, 8, device="cuda"))  # fmt: skip


def test_a_graphed_call_needs_cuda_inputs() -> None:
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        GraphedCall(lambda x: x * 2, torch.zeros(2))


@pytest.mark.parametrize("fraction", [0.01, 0.2])
@pytest.mark.parametrize("seed", range(8))
def test_the_mask_work_on_a_window_equals_it_on_the_picture(seed: int, fraction: float) -> None:
    """Raster, clean-up and tracing of a crop and its 2-pixel margin give the picture's."""
    rng = np.random.default_rng(seed)
    h, w = 60, 80
    x1, y1 = int(rng.integers(0, 30)), int(rng.integers(0, 20))
    x2, y2 = int(rng.integers(x1 + 10, w + 1)), int(rng.integers(y1 + 10, h + 1))
    full = np.zeros((h, w), bool)
    for _ in range(6):  # rectangles and holes, some tiny, inside the crop
        a, b = sorted(rng.integers(x1, x2, 2)), sorted(rng.integers(y1, y2, 2))
        full[b[0] : b[1] + 1, a[0] : a[1] + 1] = rng.random() < 0.7
    polygon = [(x1 / w, y1 / h), (x2 / w, y1 / h), (x2 / w, y2 / h), (x1 / w, (y1 + y2) / 2 / h)]
    whole = refiner_masks.coarse_mask([polygon], w, h)
    part = refiner_masks.coarse_mask([polygon], w, h, (x1, y1, x2, y2))
    assert np.array_equal(part, whole[y1:y2, x1:x2])
    wx1, wy1, wx2, wy2 = max(0, x1 - 2), max(0, y1 - 2), min(w, x2 + 2), min(h, y2 + 2)
    edges = (wy1 > 0, wy2 < h, wx1 > 0, wx2 < w)
    window = refiner_masks.clean_mask(
        full[wy1:wy2, wx1:wx2], area=h * w, open_edges=edges, area_fraction=fraction
    )
    cleaned = refiner_masks.clean_mask(full, area_fraction=fraction)
    placed = np.zeros_like(full)
    placed[wy1:wy2, wx1:wx2] = window
    assert np.array_equal(placed, cleaned)
    a = refiner_masks.trace(window, origin=(wx1, wy1), size=(w, h))
    b = refiner_masks.trace(cleaned)
    assert (a is None) == (b is None)
    if a is not None and b is not None:
        assert a.box == b.box and a.box_path == b.box_path and a.path == b.path


def test_the_mask_process_answers_as_in_process_and_replaces_a_dead_child() -> None:
    import os
    import signal
    from concurrent.futures.process import BrokenProcessPool

    window = np.zeros((40, 50), bool)
    window[5:35, 8:40] = True
    window[15:18, 20:23] = False  # a small hole
    args = (window, 60 * 80, (True, False, True, False), (3, 4), (80, 60))
    want_mask, want = refiner_masks.finish_window(*args)
    worker = refiner_masks.MaskProcess()
    try:
        got_mask, got = worker(*args)
        assert np.array_equal(got_mask, want_mask) and got == want and want is not None
        pool = worker._pool
        assert pool is not None
        for pid in list(pool._processes):  # the child dies: that call fails, the next works
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(BrokenProcessPool):
            worker(*args)
        assert worker(*args)[1] == want
    finally:
        worker.close()
