"""Crops in torch equal the reference's: libvips resize (pyvips) and Pillow LANCZOS, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from image_pipeline import (
    DEFAULT_TILING,
    ImagePreparer,
    ResizeMode,
    make_crops,
    overlap_crop,
    sample_image_bytes,
)
from image_pipeline.pillow_plan import pillow_resize_plan
from image_pipeline.resample import Resampler, _half_digits, matmul_is_exact_fp32
from image_pipeline.vips_plan import vips_resize_plan

SPEC = DEFAULT_TILING


def picture(height: int, width: int, seed: int = 0) -> np.ndarray:
    """Chart-like content (hard edges, thin lines, gradients) plus noise: every kernel tap
    and every rounding step shows."""
    rng = np.random.default_rng(seed)
    rows = np.arange(height)[:, None, None]
    cols = np.arange(width)[None, :, None]
    wave = (90 * np.sin(rows / 5.3) * np.cos(cols / 7.1)).astype(np.int16)
    checker = np.where((cols // 9 + rows // 13) % 2 == 0, 60, -60).astype(np.int16)
    noise = rng.integers(-40, 40, (height, width, 3), dtype=np.int16)
    return np.clip(128 + wave + checker + noise, 0, 255).astype(np.uint8)


def _pyvips():  # type: ignore[no-untyped-def]
    """pyvips, imported where a test needs it: the GPU tests here need none (their reference
    is the CPU path), and a broken libvips binding must not stop them."""
    import pyvips

    return pyvips


def vips_reference_crops(pixels: np.ndarray) -> tuple[np.ndarray, tuple[int, int]]:
    """The moondream reference's overlap_crop_image, pyvips branch, written out here."""
    pyvips = _pyvips()
    height, width = pixels.shape[:2]
    tiling = SPEC.tiling_for(height, width)
    canvas_h, canvas_w = SPEC.canvas_size(tiling)
    size = SPEC.crop_size
    crops = np.zeros((SPEC.num_crops(tiling), size, size, 3), dtype=np.uint8)
    image = pyvips.Image.new_from_array(pixels)
    canvas = image.resize(canvas_w / width, vscale=canvas_h / height).numpy()
    crops[0] = image.resize(size / width, vscale=size / height).numpy()
    for i in range(tiling[0]):
        for j in range(tiling[1]):
            y, x = i * SPEC.window, j * SPEC.window
            window = canvas[y : y + size, x : x + size]
            crops[1 + i * tiling[1] + j, : window.shape[0], : window.shape[1]] = window
    return crops, tiling


def torch_crops(pixels: np.ndarray, mode: ResizeMode, resampler: Resampler) -> np.ndarray:
    tiling = SPEC.tiling_for(*pixels.shape[:2])
    return make_crops(torch.from_numpy(pixels), tiling, SPEC, mode, resampler).numpy()


CPU = Resampler("cpu")

SHAPES = {
    "upscaled": (200, 300),
    "downscaled": (1100, 1500),
    "grows_down_shrinks_across": (300, 2000),
    "shrinks_down_grows_across": (2000, 300),
    "one_grows_one_equal": (378, 200),
    "extreme_aspect_wide": (40, 7000),
    "extreme_aspect_tall": (5000, 24),
    "one_pixel": (1, 1),
    "odd_sizes": (379, 1201),
}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_vips_mode_crops_equal_the_pyvips_reference(shape: tuple[int, int]) -> None:
    pixels = picture(*shape)
    expected, _ = vips_reference_crops(pixels)
    got = torch_crops(pixels, ResizeMode.VIPS, CPU)
    assert got.shape == expected.shape
    assert np.abs(got.astype(int) - expected.astype(int)).max() == 0


def test_vips_mode_crops_equal_the_pyvips_reference_at_12_megapixels() -> None:
    pixels = picture(3000, 4000, seed=3)  # box pre-shrink on both axes for the global crop
    expected, tiling = vips_reference_crops(pixels)
    assert tiling == (2, 4)
    np.testing.assert_array_equal(torch_crops(pixels, ResizeMode.VIPS, CPU), expected)


@pytest.mark.parametrize(
    ("in_size", "out_size"),
    [((600, 800), (644, 1176)), ((997, 1283), (378, 378)), ((8, 5000), (300, 377))],
)
def test_vips_plans_equal_pyvips_for_arbitrary_sizes(
    in_size: tuple[int, int], out_size: tuple[int, int]
) -> None:
    pixels = picture(*in_size, seed=5)
    scale = (out_size[0] / in_size[0], out_size[1] / in_size[1])
    image = _pyvips().Image.new_from_array(pixels)
    expected = image.resize(scale[1], vscale=scale[0]).numpy()
    got = CPU.run(torch.from_numpy(pixels), vips_resize_plan(in_size, scale))
    np.testing.assert_array_equal(got.to(torch.uint8).numpy(), expected)


PILLOW_SHAPES = {
    "landscape": (600, 800),
    "portrait_both_shrink": (1000, 800),  # Pillow 13 may run its vertical pass first
    "upscaled": (200, 300),
    "mixed": (2000, 300),
    "odd": (2363, 1550),
}


@pytest.mark.parametrize("shape", PILLOW_SHAPES.values(), ids=PILLOW_SHAPES.keys())
def test_pillow_mode_crops_equal_pillow(shape: tuple[int, int]) -> None:
    pixels = picture(*shape, seed=1)
    expected, _ = overlap_crop(Image.fromarray(pixels))
    np.testing.assert_array_equal(torch_crops(pixels, ResizeMode.PILLOW, CPU), expected)


def test_pillow_plan_equals_pillow_resize_both_orders() -> None:
    pixels = picture(700, 500, seed=2)
    for out_size in [(300, 450), (450, 300), (300, 200), (701, 200), (200, 900)]:
        expected = np.asarray(
            Image.fromarray(pixels).resize(out_size[::-1], Image.Resampling.LANCZOS)
        )
        got = CPU.run(torch.from_numpy(pixels), pillow_resize_plan((700, 500), out_size))
        np.testing.assert_array_equal(got.to(torch.uint8).numpy(), expected, str(out_size))


def test_results_stay_exact_when_matmuls_may_round_operands() -> None:
    """With reduced-precision float32 matmuls allowed (TF32 on a GPU), weights are split
    into 11-bit digits and the crops stay bit-exact."""
    pixels = picture(600, 800, seed=4)
    expected_vips, _ = vips_reference_crops(pixels)
    expected_pillow, _ = overlap_crop(Image.fromarray(pixels))
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        assert not matmul_is_exact_fp32(torch.device("cpu"))
        resampler = Resampler("cpu")
        np.testing.assert_array_equal(
            torch_crops(pixels, ResizeMode.VIPS, resampler), expected_vips
        )
        np.testing.assert_array_equal(
            torch_crops(pixels, ResizeMode.PILLOW, resampler), expected_pillow
        )
    finally:
        torch.set_float32_matmul_precision(previous)


@pytest.mark.parametrize("shape", [(600, 800), (1080, 1920), (480, 640), (379, 1201)])
def test_half_products_give_the_reference_crops(shape: tuple[int, int]) -> None:
    """float16 digits combined by Horner's rule (emulated in float32 on the CPU: the same
    integers) give pyvips' and Pillow's crops, and run for the stages where they are exact."""
    pixels = picture(*shape, seed=9)
    resampler = Resampler("cpu", half=True)
    expected_vips, _ = vips_reference_crops(pixels)
    np.testing.assert_array_equal(torch_crops(pixels, ResizeMode.VIPS, resampler), expected_vips)
    expected_pillow, _ = overlap_crop(Image.fromarray(pixels))
    np.testing.assert_array_equal(
        torch_crops(pixels, ResizeMode.PILLOW, resampler), expected_pillow
    )
    prepared = [p for _, p in resampler._cache.values()]
    assert any(p.half for p in prepared)  # vips' 12- and 13-bit weights: two float16 digits
    assert any(p.half and len(p.blocks[0].digits) == 2 for p in prepared)
    for p in prepared:
        assert all(
            d.dtype == (torch.float16 if p.half else torch.float32) for d in p.blocks[0].digits
        )


def test_half_digits_only_where_exact() -> None:
    band = np.array([[3000, -500, 1200], [100, 2047, 0]], dtype=np.int64)
    bits, digits = _half_digits(band, 255, 12)
    assert bits <= 11 and len(digits) == 2
    assert all(int(np.abs(d).max()) < 1 << 11 for d in digits)
    np.testing.assert_array_equal(sum(d * (1 << bits) ** k for k, d in enumerate(digits)), band)
    assert _half_digits(band, 2049, 12) is None  # inputs past float16's integers
    wide = np.array([[1 << 22, 5]], dtype=np.int64)  # Pillow's weights: two float32 digits
    assert _half_digits(wide, 255, 22) is None
    assert Resampler("cpu").half is False


@pytest.mark.parametrize("block", [1, 7, 4096])
def test_block_size_does_not_change_the_result(block: int) -> None:
    pixels = picture(500, 900, seed=6)
    expected, _ = vips_reference_crops(pixels)
    np.testing.assert_array_equal(
        torch_crops(pixels, ResizeMode.VIPS, Resampler("cpu", block)), expected
    )


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(ResizeMode))
@pytest.mark.parametrize("shape", [(1080, 1920), (600, 800), (480, 640), (379, 1201)])
def test_cuda_crops_equal_cpu_crops(mode: ResizeMode, shape: tuple[int, int]) -> None:
    """The GPU's crops, float16 tensor-core products included, are the CPU's bit for bit."""
    pixels = picture(*shape, seed=7)
    cpu = torch_crops(pixels, mode, CPU)
    resampler = Resampler("cuda")
    assert resampler.half
    gpu = make_crops(
        torch.from_numpy(pixels).cuda(), SPEC.tiling_for(*shape), SPEC, mode, resampler
    )
    np.testing.assert_array_equal(gpu.cpu().numpy(), cpu)
    if mode == ResizeMode.VIPS:  # its 11- to 13-bit weights take the float16 products
        assert any(p.half for _, p in resampler._cache.values())


@pytest.mark.gpu
def test_cuda_preparer_gives_the_cpu_preparers_crops_on_the_gpu() -> None:
    device_times: list[float] = []
    source_times: list[float] = []
    gpu = ImagePreparer(
        device="cuda", on_device_time=device_times.append, on_source_time=source_times.append
    )
    cpu = ImagePreparer(device="cpu")
    data = sample_image_bytes()
    a, b = gpu.prepare(data), cpu.prepare(data)
    assert a.crops.is_cuda and a.content_hash == b.content_hash and a.tiling == b.tiling
    np.testing.assert_array_equal(a.crops.cpu().numpy(), b.crops.numpy())
    assert len(device_times) == 1 and device_times[0] > 0
    assert len(source_times) == 1 and 0 < source_times[0] < device_times[0]
    normalized = a.normalized(torch.bfloat16)
    assert normalized.is_cuda and torch.equal(normalized.cpu(), b.normalized(torch.bfloat16))


def test_weight_cache_is_bounded_by_bytes() -> None:
    resampler = Resampler("cpu")
    resampler.CACHE_BYTES = 200_000
    pixels = picture(300, 400, seed=8)
    for width in range(380, 400, 4):
        resampler.run(torch.from_numpy(pixels), vips_resize_plan((300, 400), (1.0, width / 400)))
    assert resampler._cached_bytes <= 200_000 or len(resampler._cache) == 1
    assert resampler._cached_bytes == sum(p.nbytes for _, p in resampler._cache.values())


def test_large_stages_take_the_large_stage_block_size() -> None:
    assert Resampler("cpu")._block_for(10**9) == 32  # no large_block: one size everywhere
    r = Resampler("cpu", block=2048, large_block=256)
    assert r._block_for(3_999_999) == 2048 and r._block_for(4_000_000) == 256
    assert ImagePreparer(device="cpu")._decoded_resampler is None


@pytest.mark.parametrize("plan_of", [vips_resize_plan, pillow_resize_plan], ids=["vips", "pillow"])
def test_block_sizes_never_change_the_pixels(plan_of: object) -> None:
    """Small blocks on the large stages (GPU-decoded pictures) give the same pixels as one
    block per stage: each block multiplies only the span its band touches, exactly."""
    pixels = torch.from_numpy(picture(1500, 1000))  # 4.5M values: a large stage
    out = (644, 1176)
    if plan_of is vips_resize_plan:
        plan = vips_resize_plan((1500, 1000), (out[0] / 1500, out[1] / 1000))
    else:
        plan = pillow_resize_plan((1500, 1000), out)
    whole = Resampler("cpu", block=4096).run(pixels, plan)
    split = Resampler("cpu", block=4096, large_block=100).run(pixels, plan)
    assert split.shape == whole.shape and torch.equal(split, whole)
