"""Moondream 3's fused expert kernels over INT8 and INT4 expert weights on a CUDA device
(skipped elsewhere): the kernels over random shapes and uneven expert loads against
"dequantize, then the plain path"; a CUDA graph replayed with new routing; a Moondream-3-size
model with quantized experts through the engine's graphs, token for token as the reference over
its dequantized twin (fp32: ties vanishingly rare); the decode step time of each format beside
bf16 and FP8 experts (printed; ``-s`` shows it).

    python -m pytest -q -s tests/test_moondream3_moe_quant_gpu.py
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from image_pipeline import PreparedImage
from tests.support.quant_reference import assert_answers_as, dequantized_twin, fp32_engine_answers
from tests.test_engine import _finish_all, _reference_text, images  # noqa: F401  (fixtures)
from vlm_server.engine.api import GenerationRequest, Task
from vlm_server.models.interface import LoadedModel
from vlm_server.models.moondream3.moe import ExpertBank, experts_loop
from vlm_server.models.quant.formats import QuantFormat, weight_format
from vlm_server.models.registry import preset, random_model
from vlm_server.server.in_process import InProcessEngine

pytestmark = pytest.mark.gpu

FORMATS = ["int8", "int4"]
SHAPES = [  # tokens, top_k, experts, dim, expert width (INT4: multiples of the group, 128)
    (1, 8, 64, 2048, 1024),
    (7, 3, 8, 256, 128),
    (64, 8, 64, 2048, 1024),
    (300, 2, 16, 384, 128),
    (801, 8, 64, 256, 128),
    (1500, 8, 64, 2048, 1024),  # past 1024 tokens: the prefill tiles of 64 rows
]
# fp32 activations: the widened weights equal the dequantized ones exactly (both round to
# nearest), so only the fp32 sums' order differs. bf16: each product's output is rounded to
# bf16, and fc1's output again before fc2 (the 16-bit kernels' tests take the same bound).
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def _stored(
    fmt: QuantFormat, shape: tuple[int, ...], gen: torch.Generator, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(shape, generator=gen) * scale
    q, s = fmt.quantize("w", w)
    return q.cuda(), s.cuda()


def _case(
    n: int, k: int, e: int, d: int, i: int, fmt: QuantFormat, uneven: bool, seed: int
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    if uneven and n > 4:  # most tokens on the same k experts; many experts get none
        ids[: n * 3 // 4] = torch.arange(k)
    q1, s1 = _stored(fmt, (e, 2 * i, d), gen, d**-0.5)
    q2, s2 = _stored(fmt, (e, d, i), gen, i**-0.5)
    return x.cuda(), ids.cuda(), q1, s1, q2, s2


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("uneven", [False, True])
def test_quantized_experts_equal_the_dequantized_plain_path(
    shape: tuple[int, ...], dtype: torch.dtype, fmt: str, uneven: bool
) -> None:
    from vlm_server.models.moondream3.moe_triton import experts_fused

    f = weight_format(fmt)
    x, ids, q1, s1, q2, s2 = _case(*shape, f, uneven, seed=sum(shape))
    x = x.to(dtype)
    got = experts_fused(x, ids, q1, q2, s1, s2).float()
    d1, d2 = f.dequantize(q1, s1), f.dequantize(q2, s2)  # bf16, as the kernels widen
    want = experts_loop(x.float(), ids, d1.float(), d2.float())
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])
    # and the 16-bit kernels over the dequantized weights
    plain = experts_fused(x, ids, d1.to(dtype), d2.to(dtype)).float()
    torch.testing.assert_close(got, plain, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_experts_replay_in_a_cuda_graph_with_new_routing(fmt: str) -> None:
    from vlm_server.models.moondream3.moe_triton import experts_fused

    f = weight_format(fmt)
    x, ids, q1, s1, q2, s2 = _case(16, 8, 64, 256, 128, f, False, seed=3)
    x = x.bfloat16()
    static_x, static_ids = x.clone(), ids.clone()
    experts_fused(static_x, static_ids, q1, q2, s1, s2)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts_fused(static_x, static_ids, q1, q2, s1, s2)
    x2, ids2, *_ = _case(16, 8, 64, 256, 128, f, True, seed=4)
    static_x.copy_(x2.bfloat16())
    static_ids.copy_(ids2)
    graph.replay()
    want = experts_fused(x2.bfloat16(), ids2, q1, q2, s1, s2)
    torch.testing.assert_close(out, want, atol=0, rtol=0)


def _check(engine: InProcessEngine) -> None:
    rt = engine.batched.runtime
    assert rt.steps.decode_graphs and rt.steps.mixed_graphs and rt.prefill.prefix_graphs


@pytest.mark.parametrize("weights", FORMATS)
def test_moondream3_size_quantized_experts_engine_equals_the_dequantized_model_fp32(
    weights: str,
    images: list[PreparedImage],  # noqa: F811
) -> None:
    """Full-size shapes (64 experts of 1024, top-8, the real vision tower) with 6 decoder
    layers, 2 of them expert layers, every block linear quantized, in fp32."""
    full = preset("moondream3.1")
    config = dataclasses.replace(full, text=dataclasses.replace(full.text, n_layers=6))

    def load(w: str | None) -> LoadedModel:
        return random_model(
            config, seed=0, dtype=torch.float32, device="cuda", progress=False, weights=w
        )

    loaded = load(weights)
    bank = loaded.model.text.blocks[5].mlp.fc1
    assert isinstance(bank, ExpertBank) and bank.format == weights and bank.qweight.is_cuda
    reqs = [
        GenerationRequest(Task.CAPTION, images[0], temperature=0, max_tokens=12),
        GenerationRequest(
            Task.QUERY, images[1], question="what is it?", temperature=0, max_tokens=9
        ),
        GenerationRequest(Task.DETECT, images[2], object_name="car", max_objects=3),
    ]
    done = fp32_engine_answers(loaded, reqs, _check, 1 << 30)
    twin = dequantized_twin(loaded, load(None))
    assert_answers_as(twin, reqs, done)


def test_decode_step_time_per_expert_format() -> None:
    """Prints the decode period (ms per step, median, depth 2, graphs) of Moondream 3 (full
    size, random weights) with bf16 experts, FP8 experts (on chips with FP8 units), and every
    block linear in INT8 and INT4, at 1 and 32 streams; asserts only that every run finished."""
    from bench.step_bench import run_case
    from vlm_server.models.moondream3.fp8_experts import fp8_experts_supported

    cases = ["bf16", *(["fp8"] if fp8_experts_supported(torch.device("cuda")) else []), *FORMATS]
    rows = []
    for case in cases:
        weights = case if case in FORMATS else None
        loaded = random_model(
            preset("moondream3"), seed=0, dtype=torch.bfloat16, device="cuda", progress=False,
            weights=weights,
        )  # fmt: skip
        if case == "fp8":
            loaded.model.use_fp8_experts()
        for streams in (1, 32):
            row = asyncio.run(run_case(loaded, streams, 64, 2, True, 4 << 30))
            rows.append((case, streams, row))
            assert row["output_tokens"] > 0
        del loaded
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}, Moondream 3 random weights, 64 tokens a stream")
    print(f"{'experts':>7} {'streams':>7} {'period ms':>9} {'forward ms':>10}")
    for case, streams, row in rows:
        print(f"{case:>7} {streams:>7} {row['period_ms']:>9.3f} {row['forward_ms']:>10.3f}")
