"""Crop graphs (image_pipeline/crop_graphs.py): a picture size seen twice is captured, and
replays give exactly the eager crops, for new pixels of that size, in both resize modes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from image_pipeline import HostImage, ImagePreparer, ResizeMode
from image_pipeline.crop_graphs import CropGraphs


def _host(preparer: ImagePreparer, h: int, w: int, seed: int) -> HostImage:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    tiling = preparer.tiling.tiling_for(h, w)
    return HostImage(pixels, tiling, f"{seed}", w, h, (h, w), 1 + tiling[0] * tiling[1])


def test_a_cpu_preparer_is_refused() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        CropGraphs(ImagePreparer(device="cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(ResizeMode))
def test_replays_equal_eager_crops(mode: ResizeMode) -> None:
    preparer = ImagePreparer(resize=mode, device="cuda")
    graphs = CropGraphs(preparer, sizes=2, max_pixels=1_000_000)
    # 600x800 three times (eager, captured, replayed), then two other sizes (the first one
    # is evicted by the second capture), then 600x800 again (eager: forgotten), one too big.
    sizes = [(600, 800)] * 3 + [(90, 1400), (90, 1400), (378, 378), (378, 378)]
    sizes += [(600, 800), (1200, 900)]
    for seed, (h, w) in enumerate(sizes):
        image = _host(preparer, h, w, seed)
        got = graphs.crops(image).clone()
        want = preparer.crops_of(image)
        torch.cuda.synchronize()
        assert torch.equal(got, want), (h, w)
    assert graphs.captures == 3 and len(graphs) == 2
    assert graphs.replays == 2 + 1 + 1  # each capture replays once, 600x800 once more


@pytest.mark.gpu
def test_back_to_back_replays_of_one_size_keep_each_output_until_the_next_call() -> None:
    """The engine consumes each output in stream order before asking again: copies queued
    behind each call see that call's pixels, not a later one's."""
    preparer = ImagePreparer(device="cuda")
    graphs = CropGraphs(preparer)
    images = [_host(preparer, 480, 640, seed) for seed in range(6)]
    copies = [graphs.crops(image).clone() for image in images]  # queued, nothing waited
    torch.cuda.synchronize()
    for image, got in zip(images, copies, strict=True):
        assert torch.equal(got, preparer.crops_of(image))
