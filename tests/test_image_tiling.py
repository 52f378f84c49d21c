"""Overlap-crop tiling: the spec's table, select_tiling properties, crop placement."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageDraw

from image_pipeline import DEFAULT_TILING, TilingSpec, overlap_crop, select_tiling
from image_pipeline.tiling import cut_local_crops

SPEC = DEFAULT_TILING

# Spec section 2, "Examples": (H, W) -> tiling, N crops, local canvas, stitched grid.
TABLE = [
    *[(hw, (1, 1), 2, (378, 378), (27, 27)) for hw in [(300, 200), (378, 378), (378, 2000)]],
    *[
        (hw, (3, 3), 10, (910, 910), (65, 65))
        for hw in [(379, 379), (500, 500), (1024, 1024), (2048, 2048)]
    ],
    *[
        (hw, (2, 4), 9, (644, 1176), (46, 84))
        for hw in [(480, 640), (600, 800), (720, 1280), (1080, 1920), (3000, 4000)]
    ],
    ((800, 600), (4, 2), 9, (1176, 644), (84, 46)),
    ((768, 1024), (3, 4), 13, (910, 1176), (65, 84)),
    ((400, 4000), (1, 9), 10, (378, 2506), (27, 179)),
    ((500, 3000), (1, 8), 9, (378, 2240), (27, 160)),
]


def _ids(row: tuple) -> str:
    (h, w), *_ = row
    return f"{h}x{w}"


# ---------------------------------------------------------------- TilingSpec


def test_tiling_spec_defaults_and_derived() -> None:
    assert (SPEC.crop_size, SPEC.patch_size, SPEC.overlap_margin, SPEC.max_crops) == (
        378,
        14,
        4,
        12,
    )
    assert SPEC.grid == 27
    assert SPEC.margin_px == 56
    assert SPEC.window == 266
    assert SPEC.window_patches == 19
    assert SPEC.canvas_size((1, 1)) == (378, 378)
    assert SPEC.num_crops((3, 4)) == 13


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"crop_size": 0}, ValueError),
        ({"crop_size": 380}, ValueError),  # not a multiple of 14
        ({"patch_size": -14}, ValueError),
        ({"overlap_margin": -1}, ValueError),
        ({"overlap_margin": 14}, ValueError),  # no window left in a 27-patch crop
        ({"max_crops": 0}, ValueError),
        ({"max_crops": 12.0}, TypeError),
        ({"crop_size": True}, TypeError),
    ],
)
def test_tiling_spec_validation(kwargs: dict, error: type[Exception]) -> None:
    with pytest.raises(error):
        TilingSpec(**kwargs)


def test_tiling_spec_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        SPEC.max_crops = 4  # type: ignore[misc]


def test_tiling_spec_other_geometry() -> None:
    spec = TilingSpec(crop_size=224, patch_size=14, overlap_margin=2, max_crops=6)
    assert (spec.grid, spec.margin_px, spec.window) == (16, 28, 168)
    assert spec.canvas_size((2, 3)) == (2 * 168 + 56, 3 * 168 + 56)
    crops, tiling = overlap_crop(Image.new("RGB", (700, 500), (9, 9, 9)), spec)
    assert crops.shape == (1 + tiling[0] * tiling[1], 224, 224, 3)
    assert tiling[0] * tiling[1] <= 6


# ---------------------------------------------------------------- the spec's table


@pytest.mark.parametrize("row", TABLE, ids=_ids)
def test_spec_example_table(row: tuple) -> None:
    (h, w), tiling, n, canvas, grid = row
    assert SPEC.tiling_for(h, w) == tiling
    assert select_tiling(h - 112, w - 112, 266, 12) == tiling
    assert SPEC.num_crops(tiling) == n
    assert SPEC.canvas_size(tiling) == canvas
    assert SPEC.feature_grid(tiling) == grid


@pytest.mark.parametrize("row", TABLE, ids=_ids)
def test_spec_example_table_through_overlap_crop(row: tuple) -> None:
    (h, w), tiling, n, _, _ = row
    crops, got = overlap_crop(Image.new("RGB", (w, h), (40, 80, 120)))
    assert got == tiling
    assert crops.shape == (n, 378, 378, 3)
    assert crops.dtype == np.uint8 and crops.flags["C_CONTIGUOUS"]
    # A flat colour stays flat through LANCZOS, and no crop is padded.
    assert np.all(crops == (40, 80, 120))


# ---------------------------------------------------------------- select_tiling


@pytest.mark.parametrize(
    ("h", "w", "expected"),
    [
        (0, 0, (1, 1)),
        (-112, -112, (1, 1)),  # a 0x0 image after removing the margins
        (266, 10_000, (1, 1)),  # one side within a single window
        (10_000, 266, (1, 1)),
        (267, 267, (3, 3)),  # just over one window on both sides
        (532, 532, (3, 3)),
        (533, 533, (3, 3)),
        (266 * 3, 266 * 4, (3, 4)),  # exactly 12 windows
        (266 * 3 + 1, 266 * 4, (3, 3)),  # 16 windows needed: scaled down
        (100_000, 100_000, (3, 3)),
    ],
)
def test_select_tiling_edges(h: int, w: int, expected: tuple[int, int]) -> None:
    assert select_tiling(h, w) == expected


def test_select_tiling_max_crops_parameter() -> None:
    assert select_tiling(1000, 1000, max_crops=1) == (1, 1)
    assert select_tiling(1000, 1000, max_crops=4) == (2, 2)
    assert select_tiling(2000, 1000, max_crops=2) == (2, 1)
    assert select_tiling(1000, 1000, patch_window=100, max_crops=100) == (10, 10)


def test_select_tiling_extreme_aspect_follows_reference() -> None:
    # Documented reference behaviour: when the short side gets clamped up to one
    # tile the long side is not re-budgeted, so the local crops exceed max_crops.
    assert select_tiling(288, 7888) == (1, 13)
    assert SPEC.tiling_for(400, 8000) == (1, 13)
    assert select_tiling(7888, 288) == (13, 1)
    # The widest picture the default limits accept (side <= 32768) gets 1x27.
    assert SPEC.tiling_for(644, 32_564) == (1, 27)


sizes = st.integers(min_value=-200, max_value=40_000)
budgets = st.integers(min_value=1, max_value=40)


@settings(max_examples=400, deadline=None)
@given(h=sizes, w=sizes, max_crops=budgets)
def test_select_tiling_properties(h: int, w: int, max_crops: int) -> None:
    h_t, w_t = select_tiling(h, w, 266, max_crops)
    assert isinstance(h_t, int) and isinstance(w_t, int)
    assert h_t >= 1 and w_t >= 1
    # Transposing the image transposes the tiling, and the longer side never
    # gets fewer tiles.
    assert select_tiling(w, h, 266, max_crops) == (w_t, h_t)
    if h >= w:
        assert h_t >= w_t
    if h <= 266 or w <= 266:
        assert (h_t, w_t) == (1, 1)
        return
    min_h, min_w = math.ceil(h / 266), math.ceil(w / 266)
    if min_h * min_w <= max_crops:
        # Fits the budget at native scale: every pixel is covered without
        # shrinking, and the budget holds.
        assert h_t >= min_h and w_t >= min_w
        assert h_t * w_t <= max_crops
    elif h_t > 1 and w_t > 1:
        # Scaled down; the budget holds unless one side was clamped up to 1.
        assert h_t * w_t <= max_crops
        assert h_t <= min_h and w_t <= min_w
    else:
        assert max(h_t, w_t) <= max(min_h, min_w)


@settings(max_examples=200, deadline=None)
@given(h=st.integers(1, 20_000), w=st.integers(1, 20_000))
def test_tiling_for_canvas_properties(h: int, w: int) -> None:
    tiling = SPEC.tiling_for(h, w)
    canvas_h, canvas_w = SPEC.canvas_size(tiling)
    assert canvas_h >= SPEC.crop_size and canvas_w >= SPEC.crop_size
    # Canvas = tiles * window + both margins, so the last crop ends on its edge.
    assert (canvas_h - 2 * SPEC.margin_px) % SPEC.window == 0
    assert (canvas_w - 2 * SPEC.margin_px) % SPEC.window == 0
    content_h, content_w = h - 112, w - 112
    if (
        content_h > 266
        and content_w > 266
        and (math.ceil(content_h / 266) * math.ceil(content_w / 266) <= 12)
    ):
        # When the budget allows it the image is never shrunk for the local crops.
        # (With one side within a single window the tiling is 1x1 and the long
        # side is squashed: 378x2000 in the spec's table.)
        assert canvas_h >= h and canvas_w >= w


# ---------------------------------------------------------------- crop placement


def _coordinate_image(h: int, w: int) -> np.ndarray:
    """Every pixel encodes its own (y, x)."""
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([y % 256, x % 256, (y // 256) * 16 + x // 256], axis=-1).astype(np.uint8)


def test_local_crops_are_canvas_windows_in_row_major_order() -> None:
    # 1176x644 is its own canvas (tiling 4x2), so the resize is an identity and
    # every local crop must be an exact window of the input.
    pixels = _coordinate_image(1176, 644)
    crops, tiling = overlap_crop(pixels)
    assert tiling == (4, 2)
    assert crops.shape == (9, 378, 378, 3)
    h_t, w_t = tiling
    for i in range(h_t):
        for j in range(w_t):
            expected = pixels[266 * i : 266 * i + 378, 266 * j : 266 * j + 378]
            np.testing.assert_array_equal(crops[1 + i * w_t + j], expected)


def test_local_crop_content_position_after_resize() -> None:
    # 800 high, 600 wide: tiling 4x2, canvas 1176x644. Paint each tile's own
    # (non-overlapping) window region in a distinct colour, scaled to the image.
    h, w = 800, 600
    h_t, w_t = 4, 2
    colours = [
        (60 * i + 20, 120 * j + 40, 255 - 30 * (i * w_t + j)) for i in range(4) for j in range(2)
    ]
    image = Image.new("RGB", (w, h))
    draw = ImageDraw.Draw(image)
    sy, sx = h / 1176, w / 644
    for i in range(h_t):
        for j in range(w_t):
            y0, x0 = 56 + 266 * i, 56 + 266 * j
            box = [x0 * sx, y0 * sy, (x0 + 266) * sx - 1, (y0 + 266) * sy - 1]
            draw.rectangle(box, fill=colours[i * w_t + j])
    crops, tiling = overlap_crop(image)
    assert tiling == (h_t, w_t)
    for index, colour in enumerate(colours, start=1):
        centre = crops[index, 150:228, 150:228].reshape(-1, 3).astype(int)
        assert np.abs(centre - colour).max() <= 2, index


def test_global_crop_is_squashed_not_letterboxed() -> None:
    # A wide image, left half red, right half blue. Squashed to 378x378 it must
    # fill the whole square: no black bars at top or bottom.
    image = Image.new("RGB", (1200, 300), (255, 0, 0))
    ImageDraw.Draw(image).rectangle([600, 0, 1199, 299], fill=(0, 0, 255))
    crops, _ = overlap_crop(image)
    glob = crops[0].astype(int)
    assert np.abs(glob[:, :180] - (255, 0, 0)).max() <= 2
    assert np.abs(glob[:, 198:] - (0, 0, 255)).max() <= 2
    assert glob[0].min(axis=-1).max() == 0 and glob[0].max() == 255  # top row is content


def test_cut_local_crops_zero_pads_a_short_canvas() -> None:
    canvas = np.full((500, 700, 3), 7, dtype=np.uint8)
    crops = cut_local_crops(canvas, (2, 2), SPEC)
    assert crops.shape == (4, 378, 378, 3)
    assert np.all(crops[0] == 7)
    assert np.all(crops[1][:, : 700 - 266] == 7) and np.all(crops[1][:, 700 - 266 :] == 0)
    assert np.all(crops[2][: 500 - 266] == 7) and np.all(crops[2][500 - 266 :] == 0)
    assert np.all(crops[3][: 500 - 266, : 700 - 266] == 7)
    assert crops[3][500 - 266 :].sum() == 0 and crops[3][:, 700 - 266 :].sum() == 0


def test_explicit_tiling_overrides_the_image_size() -> None:
    # A reduced-scale decode keeps the original's tiling.
    small = Image.new("RGB", (400, 300), (1, 2, 3))
    crops, tiling = overlap_crop(small, SPEC, (2, 4))
    assert tiling == (2, 4)
    assert crops.shape == (9, 378, 378, 3)


def test_overlap_crop_input_validation() -> None:
    with pytest.raises(ValueError):
        overlap_crop(Image.new("L", (500, 500)))
    with pytest.raises(ValueError):
        overlap_crop(np.zeros((500, 500, 3), dtype=np.float32))
    with pytest.raises(ValueError):
        overlap_crop(np.zeros((500, 500), dtype=np.uint8))


# ---------------------------------------------------------------- the spec's own tests


def _reconstruct_pixels(local: np.ndarray, tiling: tuple[int, int]) -> np.ndarray:
    """Pixel-domain stitching: keep each tile's centre, plus margins on image edges."""
    h_t, w_t = tiling
    crop, margin, window = 378, 56, 266
    out = np.zeros((h_t * window + 2 * margin, w_t * window + 2 * margin, 3), dtype=local.dtype)
    for i in range(h_t):
        for j in range(w_t):
            y0 = 0 if i == 0 else margin
            y1 = crop if i == h_t - 1 else crop - margin
            x0 = 0 if j == 0 else margin
            x1 = crop if j == w_t - 1 else crop - margin
            out[window * i + y0 : window * i + y1, window * j + x0 : window * j + x1] = local[
                i * w_t + j, y0:y1, x0:x1
            ]
    return out


def test_spec_overlap_crop_basic() -> None:
    crops, tiling = overlap_crop(np.zeros((800, 600, 3), dtype=np.uint8))
    assert crops[0].shape == (378, 378, 3)
    assert len(crops) > 1
    assert all(c.shape == (378, 378, 3) for c in crops)
    assert len(tiling) == 2
    assert tiling == (4, 2)


def test_spec_overlap_crop_small_image() -> None:
    crops, tiling = overlap_crop(np.zeros((300, 200, 3), dtype=np.uint8))
    assert len(crops) == 2
    assert tiling == (1, 1)


def test_spec_reconstruction() -> None:
    image = Image.new("RGB", (600, 800))  # 800 high, 600 wide
    ImageDraw.Draw(image).rectangle([200, 300, 400, 500], fill=(255, 255, 255))
    crops, tiling = overlap_crop(image)
    rebuilt = _reconstruct_pixels(crops[1:], tiling)
    assert rebuilt.shape == (1176, 644, 3)
    centre = rebuilt[488:688, 222:422].mean()
    assert centre > rebuilt[:100, :100].mean() + 100
    # Stitching the local crops gives back the resized canvas exactly.
    canvas = np.asarray(image.resize((644, 1176), Image.Resampling.LANCZOS))
    np.testing.assert_array_equal(rebuilt, canvas)
