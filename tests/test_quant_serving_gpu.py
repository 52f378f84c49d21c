"""Serving 8- and 4-bit weights on the GPU (run on a CUDA machine; skipped elsewhere), on a
moondream2-size random model: the engine (CUDA graphs, the quantized layers' Triton
kernels) answers token for token as the reference over the dequantized 16-bit twin in fp32
(where ties are vanishingly rare), the bf16 decoder's logits stay within a stated tolerance
of the twin's, and the decode step time beside bf16's is printed (``-s`` shows it).

    python -m pytest -q -s tests/test_quant_serving_gpu.py
"""

from __future__ import annotations

import asyncio

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
from vlm_server.models.kv import DenseKVCache
from vlm_server.models.registry import preset, random_model
from vlm_server.server.in_process import InProcessEngine

pytestmark = pytest.mark.gpu

FORMATS = ["int8", "int4"]
# The bf16 decoder over the quantized kernels against cuBLAS over the dequantized weights:
# the same weights, fp32 sums in another order, each product's output rounded to bf16 (a
# relative step of 2^-8) and 24 blocks of them. Measured on an H100 well below this bound.
BF16_LOGITS_REL_ERR = 2e-2


def _md2(dtype: torch.dtype, weights: str | None) -> LoadedModel:
    return random_model(
        preset("moondream2"), seed=0, dtype=dtype, device="cuda", progress=False, weights=weights
    )


@pytest.mark.parametrize("weights", FORMATS)
def test_the_engine_answers_as_the_dequantized_model_fp32(
    weights: str,
    images: list[PreparedImage],  # noqa: F811
) -> None:
    loaded = _md2(torch.float32, weights)
    held = loaded.model.capabilities.quantized
    assert held is not None and len(held.weights) == 4 * 24 and not held.kept
    reqs = md2_size_requests(images)

    def check(engine: InProcessEngine) -> None:
        rt = engine.batched.runtime
        assert rt.steps.decode_graphs and rt.steps.mixed_graphs and rt.prefill.prefix_graphs
        assert rt.fused_decode  # the fused products over the stacked quantized weights

    done = fp32_engine_answers(loaded, reqs, check, 2 << 30)
    twin = dequantized_twin(loaded, _md2(torch.float32, None))
    assert_answers_as(twin, reqs, done)


@pytest.mark.parametrize("weights", FORMATS)
def test_bf16_logits_within_tolerance_of_the_dequantized_model(weights: str) -> None:
    """A 100-token prompt (the tiled kernel) and one decode row (the skinny kernel)."""
    loaded = _md2(torch.bfloat16, weights)
    twin = dequantized_twin(loaded, _md2(torch.bfloat16, None))
    layer = loaded.model.text.blocks[0].mlp.fc1
    assert isinstance(layer, QuantLinear) and layer.qweight.is_cuda
    cfg = loaded.config
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, cfg.text.vocab_size, (1, 101), device="cuda", generator=g)
    out = []
    for model in (loaded.model, twin.model):
        cache = DenseKVCache(model.kv_shape, 256, 1, torch.bfloat16, "cuda", 0)
        with torch.inference_mode():
            x = model.text.embed(ids)
            pos = torch.arange(101, device="cuda")[None]
            prompt = model.text.logits(model.text(x[:, :100], pos[:, :100], cache))
            step = model.text.logits(model.text(x[:, 100:], pos[:, 100:], cache))
        out.append(torch.cat([prompt, step], dim=1).float())
    got, want = out
    rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    print(f"\n{weights}: bf16 logits vs the dequantized twin: max rel err {rel:.2e}, top-1 {top1}")
    assert rel < BF16_LOGITS_REL_ERR
    assert top1 >= 0.95


def test_decode_step_time_beside_bf16() -> None:
    """Prints the decode period (ms per step, median, at depth 2 with graphs) of bf16 and
    each quantized format, at 1 and 32 streams; asserts only that every run finished."""
    from bench.step_bench import run_case

    rows = []
    for weights in ["bf16", *FORMATS]:
        loaded = _md2(torch.bfloat16, weights)
        for streams in (1, 32):
            row = asyncio.run(run_case(loaded, streams, 64, 2, True, 4 << 30))
            rows.append((weights, streams, row))
            assert row["output_tokens"] > 0
        del loaded
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}, moondream2 random weights, 64 tokens a stream")
    print(f"{'weights':>7} {'streams':>7} {'period ms':>9} {'forward ms':>10} {'fused':>5}")
    for weights, streams, row in rows:
        print(
            f"{weights:>7} {streams:>7} {row['period_ms']:>9.3f} {row['forward_ms']:>10.3f} "
            f"{row['fused_decode']!s:>5}"
        )
