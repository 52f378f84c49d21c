"""``--vision-weights`` on the GPU (run on a CUDA machine; skipped elsewhere), on a
moondream2-size random model: the engine, its image path captured as CUDA graphs with the
tower's products in the quantized layers' Triton kernels, answers token for token (and box for
box) as the reference over the dequantized 16-bit twin in fp32 (where ties are vanishingly
rare); in bf16 the tower's image embeddings stay within a stated tolerance of the twin's.

    python -m pytest -q -s tests/test_vision_weights_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from image_pipeline import PreparedImage
from tests.support.quant_reference import (
    assert_answers_as,
    dequantized_twin,
    fp32_engine_answers,
    md2_size_requests,
)
from tests.test_engine import _finish_all, _reference_text, images  # noqa: F401  (fixtures)
from vlm_server.models.common.quant_linear import QuantLinear
from vlm_server.models.interface import LoadedModel
from vlm_server.models.registry import preset, random_model
from vlm_server.server.in_process import InProcessEngine

pytestmark = pytest.mark.gpu

# The bf16 tower over the quantized kernels against cuBLAS over the dequantized weights: the
# same weights, fp32 sums in another order, each product's output rounded to bf16 (a relative
# step of 2^-8) through 27 blocks and the projection.
BF16_EMBEDDING_REL_ERR = 2e-2
BLOCKS = 27  # moondream2's tower


def _md2(dtype: torch.dtype, vision_weights: str = "exact") -> LoadedModel:
    return random_model(
        preset("moondream2"),
        seed=0,
        dtype=dtype,
        device="cuda",
        progress=False,
        vision_weights=vision_weights,
    )


def test_the_engine_answers_as_the_dequantized_tower_fp32(
    images: list[PreparedImage],  # noqa: F811
) -> None:
    loaded = _md2(torch.float32, "int8")
    tower = loaded.model.capabilities.vision_quantized
    assert tower is not None and len(tower.weights) == 4 * BLOCKS and not tower.kept
    assert loaded.model.capabilities.quantized is None  # the decoder as loaded
    reqs = md2_size_requests(images)

    def check(engine: InProcessEngine) -> None:
        rt = engine.batched.runtime
        assert rt.prefill.image_graphs and rt.prefill.prefix_graphs  # the tower, captured

    done = fp32_engine_answers(loaded, reqs, check, 2 << 30)
    twin = dequantized_twin(loaded, _md2(torch.float32))
    assert_answers_as(twin, reqs, done)


@pytest.mark.parametrize("vision_weights", ["int8", "int4"])
def test_bf16_embeddings_within_tolerance_of_the_dequantized_tower(
    vision_weights: str,
    images: list[PreparedImage],  # noqa: F811
) -> None:
    """Every local crop of a picture: more rows than a decode step (the tiled kernel)."""
    loaded = _md2(torch.bfloat16, vision_weights)
    tower = loaded.model.capabilities.vision_quantized
    assert tower is not None
    # INT4 keeps fc2 (4304 input columns, not a multiple of 128) 16-bit.
    assert len(tower.kept) == (BLOCKS if vision_weights == "int4" else 0)
    layer = loaded.model.vision.blocks[0].attn.qkv  # type: ignore[attr-defined]
    assert isinstance(layer, QuantLinear) and layer.qweight.is_cuda
    twin = dequantized_twin(loaded, _md2(torch.bfloat16))
    image = max(images, key=lambda im: im.tiling[0] * im.tiling[1])
    crops = image.normalized(torch.bfloat16, "cuda")
    with torch.inference_mode():
        got = loaded.model.image_embeddings(crops, image.tiling).float()
        want = twin.model.image_embeddings(crops, image.tiling).float()
    rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    print(
        f"\n{vision_weights} tower: bf16 embeddings vs the dequantized twin: max rel err {rel:.2e}"
    )
    assert rel < BF16_EMBEDDING_REL_ERR
