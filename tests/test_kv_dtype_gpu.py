"""Compact KV pages on the GPU (run on a CUDA machine; skipped elsewhere): every kernel that
writes or reads pages, over random shapes, against dequantize-then-attend in PyTorch; a
moondream2-size random model serving with FP8 (and INT8) KV through CUDA graphs; the decode
step time and the KV bytes per token beside bf16's, printed (``-s`` shows them).

    python -m pytest -q -s tests/test_kv_dtype_gpu.py
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from image_pipeline import PreparedImage
from tests.test_engine import _finish_all, images  # noqa: F401  (fixtures)
from vlm_server.chip_features import fp8_supported
from vlm_server.engine.api import GenerationRequest, Task
from vlm_server.engine.device.kernels.paged_attention import (
    paged_attention,
    ragged_paged_attention,
)
from vlm_server.engine.device.model_entry import ModelEntryPoints
from vlm_server.models.interface import LoadedModel
from vlm_server.models.kv import dequantize_kv, quantize_kv
from vlm_server.models.registry import preset, random_model
from vlm_server.server.in_process import InProcessEngine

pytestmark = pytest.mark.gpu

FORMATS = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
# The kernels fold the scales into fp32 dot products and softmax weights; the reference
# dequantizes to bf16 first, then attends in bf16 (SDPA): bf16 rounding of the values and
# of the output (2^-8 relative) bounds the difference, not the 8-bit format.
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


def _skip_without(fmt: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if fmt == "fp8" and not fp8_supported(torch.device("cuda")):
        pytest.skip("FP8 needs compute capability 8.9+")


def _pools(dtype: torch.dtype, pages: int, page: int, kvh: int, hd: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(2, pages, page, kvh, hd, device="cuda", generator=g)
    (k, ks), (v, vs) = quantize_kv(x[0], dtype), quantize_kv(x[1], dtype)
    return k, v, ks, vs


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("seed", range(4))
def test_every_kernel_over_random_shapes_equals_the_dequantized_path(fmt: str, seed: int) -> None:
    from vlm_server.engine.device.kernels.triton_attention import (
        paged_decode_attention,
        paged_tile_attention,
    )
    from vlm_server.engine.device.kernels.triton_kv_store import rope_and_store_kv

    _skip_without(fmt)
    dtype = FORMATS[fmt]
    rng = torch.Generator().manual_seed(seed)
    kvh, rep, hd = [(32, 1, 64), (8, 4, 64), (4, 8, 128), (16, 2, 64)][seed]
    heads, page, width = kvh * rep, 16, 64
    k, v, ks, vs = _pools(dtype, 600, page, kvh, hd, seed)
    table = torch.randint(1, 600, (9, width), generator=rng, dtype=torch.int32).cuda()
    b = int(torch.randint(1, 9, (1,), generator=rng))
    rows = torch.randperm(9, generator=rng)[:b].cuda()
    lengths = torch.randint(1, width * page, (b,), generator=rng).cuda()
    q = torch.randn(b, heads, hd, device="cuda", dtype=torch.bfloat16)
    got = paged_decode_attention(q, k, v, table, rows, lengths, k_scale=ks, v_scale=vs)
    kd, vd = dequantize_kv(k, ks, torch.bfloat16), dequantize_kv(v, vs, torch.bfloat16)
    want = paged_attention(q[:, :, None], kd, vd, table[rows].long(), (lengths - 1)[:, None], 0)
    torch.testing.assert_close(got, want[:, :, 0], **BF16_TOL)
    # Tiles: one row's prompt chunk of 16 tokens.
    pos = torch.arange(100, 116, device="cuda")
    tile_rows = torch.full((16,), 2, device="cuda")
    tiles = torch.tensor([[0, 16]], dtype=torch.int32, device="cuda")
    qt = torch.randn(16, heads, hd, device="cuda", dtype=torch.bfloat16)
    got = paged_tile_attention(qt, k, v, table, tile_rows, pos, tiles, 16, k_scale=ks, v_scale=vs)
    want = ragged_paged_attention(qt, kd, vd, table, tile_rows, pos, width)
    torch.testing.assert_close(got, want, **BF16_TOL)
    # The store: quantize_kv's elements and scales (a division's last bit aside).
    qkv = torch.randn(b, (heads + 2 * kvh) * hd, device="cuda", dtype=torch.bfloat16)
    cos, sin = (
        torch.ones(width * page, 16, device="cuda"),
        torch.zeros(width * page, 16, device="cuda"),
    )
    positions = (lengths - 1)[:, None].int()
    rope_and_store_kv(qkv, cos, sin, positions, table, rows, k, v, heads, k_scale=ks, v_scale=vs)
    pages = table[rows, positions[:, 0] // page].long()
    offsets = positions[:, 0] % page
    keys = qkv.view(b, heads + 2 * kvh, hd)[:, heads : heads + kvh]
    want_q, want_s = quantize_kv(keys, dtype)
    torch.testing.assert_close(ks[pages, offsets], want_s, rtol=1e-6, atol=0)
    same = (k[pages, offsets].float() == want_q.float()).float().mean()
    assert same > 0.99


def _md2() -> LoadedModel:
    return random_model(
        preset("moondream2"), seed=0, dtype=torch.bfloat16, device="cuda", progress=False
    )


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_md2_serves_with_compact_kv_through_graphs(
    fmt: str,
    images: list[PreparedImage],  # noqa: F811
) -> None:
    _skip_without(fmt)
    loaded = _md2()
    reqs = [
        GenerationRequest(Task.CAPTION, images[0], temperature=0, max_tokens=24),
        GenerationRequest(
            Task.QUERY, images[1], question="what is it?", temperature=0, max_tokens=16
        ),
        GenerationRequest(Task.DETECT, images[2], object_name="car", max_objects=3),
    ]

    def check(engine: InProcessEngine) -> None:
        rt = engine.batched.runtime
        assert rt.steps.decode_graphs and rt.steps.mixed_graphs and rt.prefill.prefix_graphs
        assert rt.pool.kv.dtype == FORMATS[fmt] and rt.pool.kv_scales is not None

    kw = dict(max_batch_size=4, kv_budget_bytes=2 << 30, kv_dtype=fmt)
    compact = _finish_all(loaded, reqs, 2, check, **kw)
    exact = _finish_all(loaded, reqs, 2, None, **{**kw, "kv_dtype": "auto"})
    for a, b in zip(compact, exact, strict=True):
        assert a.finish_reason in ("eos", "length", "max_objects")
        print(f"\n{fmt}: {a.text!r}\nbf16: {b.text!r}")


def test_decode_step_time_and_kv_bytes_beside_bf16() -> None:
    """Prints the decode period (ms per step, median, depth 2, graphs) and KV bytes per token
    of bf16 and each compact format at 1 and 32 streams; asserts only that runs finished."""
    from bench.step_bench import run_case

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    loaded = _md2()
    entry = ModelEntryPoints(loaded.model)
    rows = []
    kinds = ["auto", "int8"] + (["fp8"] if fp8_supported(torch.device("cuda")) else [])
    for kv in kinds:
        for streams in (1, 32):
            row = asyncio.run(run_case(loaded, streams, 64, 2, True, 4 << 30, kv_dtype=kv))
            rows.append((kv, streams, row, entry.kv_page_bytes(1, kv)))
            assert row["output_tokens"] > 0
    print(f"\n{torch.cuda.get_device_name()}, moondream2 random weights, 64 tokens a stream")
    print(f"{'kv':>5} {'streams':>7} {'period ms':>9} {'KV bytes/token':>14}")
    for kv, streams, row, per_token in rows:
        print(f"{kv:>5} {streams:>7} {row['period_ms']:>9.3f} {per_token:>14}")
