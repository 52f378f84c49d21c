"""Normalization to [-1, 1]: the reference's bf16 step order, dtypes, devices."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from image_pipeline import normalize_crops, prepare_image, sample_image_bytes

ALL_VALUES = np.arange(256, dtype=np.uint8)


def all_values_crops() -> np.ndarray:
    """[1, 16, 16, 3] holding every uint8 value in every channel."""
    grid = ALL_VALUES.reshape(16, 16)
    return np.stack([grid, grid[::-1], grid.T], axis=-1)[None]


def rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round float32 values to ``dtype`` and back: one step of arithmetic in dtype."""
    return x.to(dtype).to(torch.float32)


def stepwise_reference(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spec, one rounding per step: cast, /255, -0.5, /0.5, each in ``dtype``."""
    x = rounded(values.to(torch.float32), dtype)
    x = rounded(x / 255.0, dtype)
    x = rounded(x - 0.5, dtype)
    x = rounded(x / 0.5, dtype)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matches_stepwise_reference_for_every_value(dtype: torch.dtype) -> None:
    crops = all_values_crops()
    out = normalize_crops(crops, dtype=dtype)
    assert out.dtype == dtype
    expected = stepwise_reference(torch.from_numpy(crops).permute(0, 3, 1, 2), dtype)
    assert torch.equal(out, expected)


def test_bf16_step_order_matters() -> None:
    # Normalizing in float32 and casting once gives other bf16 values for about
    # half of the inputs, so this test would catch a wrong order.
    values = torch.from_numpy(ALL_VALUES)
    stepwise = stepwise_reference(values, torch.bfloat16)
    cast_last = ((values.float() / 255 - 0.5) / 0.5).to(torch.bfloat16)
    assert (stepwise != cast_last).sum() > 50


def test_shape_layout_and_range() -> None:
    crops = np.zeros((2, 4, 5, 3), dtype=np.uint8)
    crops[..., 0] = 255  # red channel full
    crops[1, 0, 0] = (0, 128, 255)
    out = normalize_crops(crops)
    assert out.shape == (2, 3, 4, 5)
    assert out.is_contiguous()
    assert out.dtype == torch.bfloat16
    assert torch.all(out[:, 0, 1:, :] == 1) and torch.all(out[:, 1:, 1:, :] == -1)
    # 128 -> 0.50196 rounds up to 0.50390625 in bf16, so the result is 2**-7, not
    # the float32 answer 0.0039: the reference's rounding, kept on purpose.
    assert out[1, :, 0, 0].tolist() == [-1.0, 0.0078125, 1.0]
    full = normalize_crops(all_values_crops(), dtype=torch.float32)
    assert full.min().item() == -1.0 and full.max().item() == 1.0


def test_numpy_and_torch_inputs_agree_and_are_not_modified() -> None:
    crops = all_values_crops()
    backup = crops.copy()
    tensor = torch.from_numpy(crops.copy())
    readonly = crops.copy()
    readonly.flags.writeable = False
    a = normalize_crops(crops)
    b = normalize_crops(tensor)
    c = normalize_crops(readonly)
    assert torch.equal(a, b) and torch.equal(a, c)
    np.testing.assert_array_equal(crops, backup)
    assert torch.equal(tensor, torch.from_numpy(backup))


def test_non_contiguous_input() -> None:
    crops = torch.from_numpy(all_values_crops()).repeat(2, 1, 1, 1)
    view = crops[:, ::2, ::2, :]
    assert not view.is_contiguous()
    assert torch.equal(normalize_crops(view), normalize_crops(view.contiguous()))


def test_device_argument_on_cpu() -> None:
    out = normalize_crops(all_values_crops(), device="cpu")
    assert out.device.type == "cpu"
    out = normalize_crops(all_values_crops(), device=torch.device("cpu"), dtype=torch.float16)
    assert out.dtype == torch.float16


@pytest.mark.parametrize(
    ("crops", "kwargs", "error"),
    [
        (np.zeros((1, 4, 4, 3), dtype=np.float32), {}, TypeError),
        (torch.zeros((1, 4, 4, 3), dtype=torch.int32), {}, TypeError),
        (np.zeros((4, 4, 3), dtype=np.uint8), {}, ValueError),
        (np.zeros((1, 3, 4, 4), dtype=np.uint8), {}, ValueError),
        (np.zeros((1, 4, 4, 3), dtype=np.uint8), {"dtype": torch.int8}, TypeError),
        (np.zeros((1, 4, 4, 3), dtype=np.uint8), {"dtype": "bfloat16"}, TypeError),
        ([[[[0, 0, 0]]]], {}, TypeError),
    ],
)
def test_input_validation(crops: object, kwargs: dict, error: type[Exception]) -> None:
    with pytest.raises(error):
        normalize_crops(crops, **kwargs)  # type: ignore[arg-type]


def test_prepared_image_normalized() -> None:
    prepared = prepare_image(sample_image_bytes())
    out = prepared.normalized()
    assert out.shape == (9, 3, 378, 378) and out.dtype == torch.bfloat16
    assert torch.equal(out, normalize_crops(prepared.crops))
    assert prepared.normalized(torch.float32).dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_matches_cpu(dtype: torch.dtype) -> None:
    crops = torch.from_numpy(all_values_crops())
    on_gpu = normalize_crops(crops.cuda(), dtype=dtype)
    moved = normalize_crops(crops, dtype=dtype, device="cuda")
    assert on_gpu.device.type == "cuda" and moved.device.type == "cuda"
    cpu = normalize_crops(crops, dtype=dtype)
    if dtype == torch.float32:
        # CUDA divides by a scalar through its reciprocal: allow one float32 ulp.
        torch.testing.assert_close(on_gpu.cpu(), cpu, rtol=0, atol=2e-7)
    else:
        assert torch.equal(on_gpu.cpu(), cpu)
    assert torch.equal(on_gpu, moved)
