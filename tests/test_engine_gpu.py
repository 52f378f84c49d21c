"""GPU checks (run on a CUDA machine; skipped elsewhere): the Triton kernel against the
PyTorch path, and the engine (graphs, Triton attention, streams) against the reference."""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import pytest
import torch

from image_pipeline import PreparedImage
from tests.support.quant_reference import md2_size_requests
from tests.test_engine import (  # noqa: F401  (fixtures)
    BUDGETS,
    _finish_all,
    _reference_text,
    _text_requests,
    images,
)
from vlm_server.engine.api import Finished, GenerationRequest, Task
from vlm_server.engine.device.kernels.paged_attention import paged_attention
from vlm_server.models.interface import LoadedModel
from vlm_server.models.registry import preset, random_model
from vlm_server.reference import ReferenceGenerator
from vlm_server.server.in_process import InProcessEngine

pytestmark = pytest.mark.gpu


def _cuda(loaded: LoadedModel) -> LoadedModel:
    model = copy.deepcopy(loaded.model).cuda()
    return LoadedModel(model, loaded.tokenizer, loaded.config, loaded.source)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_paged_decode_matches_torch(dtype: torch.dtype) -> None:
    from vlm_server.engine.device.kernels.triton_attention import paged_decode_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    b, h, kvh, hd, ps, pages = 5, 32, 32, 64, 16, 300
    kp = torch.randn(pages, ps, kvh, hd, device="cuda", generator=g).to(dtype)
    vp = torch.randn(pages, ps, kvh, hd, device="cuda", generator=g).to(dtype)
    table = torch.randint(1, pages, (9, 128), device="cuda", dtype=torch.int32, generator=g)
    rows = torch.tensor([8, 0, 3, 3, 5], device="cuda")
    lengths = torch.tensor([1, 17, 730, 1500, 2048], device="cuda")
    q = torch.randn(b, h, hd, device="cuda", generator=g).to(dtype)
    got = paged_decode_attention(q, kp, vp, table, rows, lengths)
    want = paged_attention(
        q[:, :, None].float(), kp.float(), vp.float(), table[rows].long(), (lengths - 1)[:, None], 0
    )[:, :, 0]
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("depth", [1, 2])
def test_cuda_engine_equals_reference_tiny(
    text_model: LoadedModel,
    region_model: LoadedModel,
    images: list[PreparedImage],  # noqa: F811
    depth: int,
    budget: str,
) -> None:
    """Decode-only steps replay decode graphs; mixed steps (prompts chunked under the
    "chunked" budget) replay graphs per token bucket, image prefixes per tiling and count."""
    tm, rm = _cuda(text_model), _cuda(region_model)
    reqs = _text_requests(images)
    regions = [
        GenerationRequest(Task.DETECT, images[0], object_name="car", max_objects=5),
        GenerationRequest(Task.POINT, images[1], object_name="dog", max_objects=4),
    ]

    def check(engine: InProcessEngine) -> None:
        rt = engine.batched.runtime
        assert rt.steps.decode_graphs and rt.steps.mixed_graphs and rt.prefill.prefix_graphs
        assert rt.pool.use_triton and rt.sampler.sample_graphs

    def run(loaded: LoadedModel, batch: list[GenerationRequest]) -> list[Finished]:
        return _finish_all(loaded, batch, depth, check, budget=budget, max_batch_size=4)

    ref = ReferenceGenerator(tm.model, tm.tokenizer)
    for req, fin in zip(reqs, run(tm, reqs), strict=True):
        assert fin.text == _reference_text(ref, req), req.request_id
    rref = ReferenceGenerator(rm.model, rm.tokenizer)
    det, pts = run(rm, regions)
    assert [vars(b) for b in det.boxes] == [vars(b) for b in rref.detect(images[0], "car", 5).boxes]
    assert [vars(p) for p in pts.points] == [
        vars(p) for p in rref.point(images[1], "dog", 4).points
    ]


def _moondream2_fp32_equals_reference(
    images: list[PreparedImage],  # noqa: F811
    check: Callable[[InProcessEngine], None] | None = None,
    **engine_options: object,
) -> LoadedModel:
    """A caption, a query and a detect through the engine on full-size random weights in
    fp32 (ties are then vanishingly rare) equal the reference's; returns the model."""
    loaded = random_model(
        preset("moondream2"), seed=0, dtype=torch.float32, device="cuda", progress=False
    )
    reqs = md2_size_requests(images)
    cap, qry, det = _finish_all(
        loaded, reqs, 2, check, max_batch_size=4, kv_budget_bytes=2 << 30, **engine_options
    )
    ref = ReferenceGenerator(loaded.model, loaded.tokenizer)
    assert cap.text == _reference_text(ref, reqs[0])
    assert qry.text == _reference_text(ref, reqs[1])
    assert [vars(b) for b in det.boxes] == [vars(b) for b in ref.detect(images[2], "car", 3).boxes]
    return loaded


def test_moondream2_size_engine_equals_reference_fp32(
    images: list[PreparedImage],  # noqa: F811
) -> None:
    """Full-size random weights in fp32 (ties are then vanishingly rare)."""
    _moondream2_fp32_equals_reference(images)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixed_graph_matches_pytorch_varlen(text_model: LoadedModel, seed: int) -> None:
    """One mixed step's token forward, graph-replayed with pad tokens and the decode kernels
    per token, gives the hidden states of the eager PyTorch varlen path (fp32)."""
    import numpy as np

    from decoding.mask_table import MaskTable
    from vlm_server.engine.config import EngineConfig
    from vlm_server.engine.core.pages import PageAllocator
    from vlm_server.engine.core.step_plan import DEVICE_INPUT
    from vlm_server.engine.device.runtime import ModelRuntime

    loaded = _cuda(text_model)
    model = loaded.model.float()
    cfg = EngineConfig(max_batch_size=8, max_step_tokens=64, kv_budget_bytes=64 << 20)
    rt = ModelRuntime(model, cfg, MaskTable(loaded.config.text.vocab_size, 4))
    mirror = rt.block_table
    pages = PageAllocator(
        rt.kv_pages, cfg.page_size, cfg.max_rows, mirror.shape[1], block_table=mirror
    )
    rng = np.random.default_rng(seed)
    ps = cfg.page_size
    for row in range(cfg.max_rows):
        pages.assign(row, pages.allocate(6))
    rt.pool.block_dev.copy_(rt.pool.block_host)
    rt.pool.kv.normal_()
    rt.buffers.next_embed.normal_()
    rt.capture_graphs(progress=False)
    # Decode rows, then two prompt chunks of rows 8 and 9 (positions continue their context).
    d = int(rng.integers(1, 8))
    chunks = [(8, int(rng.integers(20, 40)), int(rng.integers(2, 15))), (9, 3, 5)]
    rows = list(range(d)) + [r for r, _, n in chunks for _ in range(n)]
    pos = list(rng.integers(0, 5 * ps, d)) + [p + i for _, p, n in chunks for i in range(n)]
    ids = [DEVICE_INPUT] * d + list(rng.integers(0, 100, len(rows) - d))
    tokens = np.array([rows, pos, ids], np.int64).T.copy()
    last = np.array([*range(d), d + chunks[0][2] - 1, len(rows) - 1], np.int64)
    t = len(tokens)
    steps, kv = rt.steps, rt.pool.kv
    n = steps.token_bucket(t)
    assert n > t  # some padding in play
    lay, pad_row = rt.buffers.mixed_layout, rt.buffers.pad_row
    host = lay.pack(steps.mixed_scratch, tokens, last, [], n, pad_row)
    buf = rt.buffers.slots[1]
    buf.mixed_dev[: len(host)].copy_(torch.from_numpy(host))
    kv_before = kv.clone()
    stream = rt.dev.compute_stream
    with torch.inference_mode(), torch.cuda.stream(stream):
        steps.mixed_step(1, 0, t, n, 6)
    stream.synchronize()
    got = buf.hidden[: len(last)].clone()
    kv_graph = kv.clone()
    kv.copy_(kv_before)
    rt.pool.use_triton = False
    with torch.inference_mode(), torch.cuda.stream(stream):
        steps.mixed_forward(buf, t, 6)
    stream.synchronize()
    torch.testing.assert_close(got, buf.hidden[: len(last)], atol=2e-4, rtol=2e-4)
    # Same keys and values written, except into the sink page (pad tokens write there).
    torch.testing.assert_close(kv_graph[:, :, 1:], kv[:, :, 1:], atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("splits", [1, 2, 8])
def test_tile_attention_matches_pytorch_varlen(
    dtype: torch.dtype, kv_heads: int, seed: int, splits: int
) -> None:
    """The mixed step's Triton varlen kernel against the PyTorch path over random steps:
    decode rows and prompt chunks of random lengths and positions, GQA or not, padding
    (zeros out), each tile's positions in one program or split over several."""
    import numpy as np

    from vlm_server.engine.core.mixed_inputs import MixedLayout
    from vlm_server.engine.core.step_plan import N_TOK, T_POS, T_ROW
    from vlm_server.engine.device.kernels.paged_attention import ragged_paged_attention
    from vlm_server.engine.device.kernels.triton_attention import paged_tile_attention

    rng = np.random.default_rng(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    heads, hd, page, n_pages, width = 8, 64, 16, 300, 24
    kp, vp = (
        torch.randn(n_pages, page, kv_heads, hd, device="cuda", generator=gen, dtype=dtype)
        for _ in range(2)
    )
    table = torch.from_numpy(rng.integers(1, n_pages, (40, width))).int().cuda()
    rows, pos = [], []
    for r in range(int(rng.integers(0, 20))):  # decode rows
        rows.append(r)
        pos.append(int(rng.integers(0, width * page)))
    for r in range(20, 20 + int(rng.integers(1, 6))):  # prompt chunks
        length = int(rng.integers(1, 90))
        start = int(rng.integers(0, width * page - length))
        rows += [r] * length
        pos += list(range(start, start + length))
    t = len(rows)
    layout = MixedLayout(rows=41, max_tails=1)
    n = t + int(rng.integers(0, 20))
    tokens = np.zeros((t, N_TOK), np.int64)
    tokens[:, T_ROW], tokens[:, T_POS] = rows, pos
    host = layout.pack(np.zeros(layout.size(n), np.int64), tokens, np.zeros(0, np.int64), [], n, 39)
    dev = torch.from_numpy(host.copy()).cuda()
    batch = dev[layout.tokens_at : layout.tiles_at(n)].view(n, N_TOK)
    tiles = dev[layout.tiles_at(n) :].view(-1, 2)
    q = torch.randn(n, heads, hd, device="cuda", generator=gen, dtype=dtype)
    got = paged_tile_attention(
        q, kp, vp, table, batch[:, T_ROW], batch[:, T_POS], tiles, layout.tile_tokens, 64, splits
    )
    assert not got[t:].any()  # padding tokens
    want = ragged_paged_attention(
        q[:t].float(), kp.float(), vp.float(), table, batch[:t, T_ROW], batch[:t, T_POS], width
    )
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[:t].float(), want, atol=tol, rtol=tol)


def test_mlp_epilogue_gelu_is_the_tanh_gelu() -> None:
    """On CUDA the MLP puts fc1's bias and GELU in the GEMM epilogue: it must be the tanh
    GELU the model uses (the CPU's _addmm_activation would be the erf one)."""
    import torch.nn.functional as F

    from vlm_server.models.common.layers import MLP, gelu_tanh

    torch.manual_seed(0)
    mlp = MLP(64, 256, 32).cuda()
    x = torch.randn(3, 37, 64, device="cuda") * 3
    with torch.inference_mode():
        fused = mlp.fc1_gelu(x)
        plain = gelu_tanh(mlp.fc1(x))
        erf = F.gelu(mlp.fc1(x))
    torch.testing.assert_close(fused, plain, atol=2e-5, rtol=2e-5)
    assert (fused - erf).abs().max() > 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [1152, 2048])
def test_fused_add_layernorm_matches_pytorch(dtype: torch.dtype, dim: int) -> None:
    """The residual sum is exactly the unfused one; the norm matches PyTorch's to rounding."""
    from vlm_server.models.common.fused_norm import add_layernorm
    from vlm_server.models.common.layers import LayerNorm

    torch.manual_seed(0)
    norm = LayerNorm(dim).cuda().to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x, a, b = (torch.randn(5, 33, dim, device="cuda", dtype=dtype) * 4 for _ in range(3))
    with torch.inference_mode():
        for extra in (None, b):
            s, out = add_layernorm(x, a, extra, norm)
            want = x + a if extra is None else x + a + extra
            assert torch.equal(s, want)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out, norm(want), atol=tol, rtol=tol)


def _random_decoder(dtype: torch.dtype) -> torch.nn.Module:
    """The tiny preset's text decoder on CUDA with seeded random weights."""
    from vlm_server.models.moondream2.text import TextDecoder

    torch.manual_seed(0)
    dec = TextDecoder(preset("tiny").text)
    for p in dec.parameters():
        p.data.normal_(0, 0.05)
    dec = dec.cuda().to(dtype)
    dec.reset_rotary("cuda")
    return dec


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefix_kv_matches_the_pytorch_prefix_path(dtype: torch.dtype) -> None:
    """The BOS + image forward through the Triton rotary/KV-write kernel (PrefixKV) gives the
    hidden states and the pages of the PyTorch path (PagedKV, fresh prefix)."""
    from vlm_server.engine.device.kernels.paged_attention import PagedKV, PrefixKV

    cfg = preset("tiny").text
    dec = _random_decoder(dtype)
    length, n_img, page = 45, 3, 16
    ppe = -(-length // page)
    shape = (40, page, cfg.n_kv_heads, cfg.head_dim)

    def pools() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return (
            [torch.zeros(shape, device="cuda", dtype=dtype) for _ in range(cfg.n_layers)],
            [torch.zeros(shape, device="cuda", dtype=dtype) for _ in range(cfg.n_layers)],
        )

    pages = torch.arange(1, 1 + n_img * ppe, device="cuda").view(n_img, ppe)
    x = torch.randn(n_img, length, cfg.dim, device="cuda", dtype=dtype)
    pos = torch.arange(length, device="cuda")[None].expand(n_img, length)
    (k1, v1), (k2, v2) = pools(), pools()
    image_of_token = torch.arange(n_img, device="cuda").repeat_interleave(length)
    rope = (dec.rope_cos, dec.rope_sin)
    with torch.inference_mode():
        want = dec(x, pos, PagedKV(k1, v1, pages, length, fresh_prefix=True))
        got = dec(x, pos, PrefixKV(k2, v2, pages, image_of_token, rope, cfg.n_heads))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    for a, b in zip(k1 + v1, k2 + v2, strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefix_with_riding_prompts_matches_the_pytorch_path(dtype: torch.dtype) -> None:
    """Prefixes and the prompts riding them as one token batch: the Triton path (rotary/KV
    write kernels, paged tile attention for the prompts) gives the hidden states and pages of
    the PyTorch path, for prompts over a page boundary, a prefix without a prompt, and pad
    tokens."""
    from vlm_server.engine.core.mixed_inputs import MixedLayout
    from vlm_server.engine.device.kernels.paged_attention import PrefixPromptKV

    cfg = preset("tiny").text
    dec = _random_decoder(dtype)
    length, n_img, page, pad_job = 45, 3, 16, 4
    prompts = [20, 0, 3]  # prompt tokens of each prefix: the second has none
    width = -(-(length + max(prompts)) // page)
    table = torch.zeros(pad_job + 1, width, dtype=torch.int64)
    table[:n_img] = torch.arange(1, 1 + n_img * width).view(n_img, width)
    table = table.cuda()
    rows = [j for j, n in enumerate(prompts) for _ in range(n)]
    pos = [length + i for n in prompts for i in range(n)]
    n_pad = 5
    tokens = np.zeros((len(rows), 3), np.int64)
    tokens[:, 0], tokens[:, 1] = rows, pos
    lay = MixedLayout(rows=pad_job + 1, max_tails=0)
    p = len(rows) + n_pad
    flat = lay.pack(np.zeros(lay.size(p), np.int64), tokens, np.zeros(0, np.int64), [], p, pad_job)
    flat = torch.from_numpy(flat.copy()).cuda()
    packed = flat[lay.tokens_at : lay.tiles_at(p)].view(p, 3)
    tiles = flat[lay.tiles_at(p) : lay.size(p)].view(-1, 2)
    t = n_img * length + p
    x = torch.randn(1, t, cfg.dim, device="cuda", dtype=dtype)
    positions = torch.cat([torch.arange(length, device="cuda").repeat(n_img), packed[:, 1]])
    image_of_token = torch.arange(n_img, device="cuda").repeat_interleave(length)
    rope = (dec.rope_cos, dec.rope_sin)
    shape = (n_img * width + 2, page, cfg.n_kv_heads, cfg.head_dim)

    def run(use_tiles: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        k = [torch.zeros(shape, device="cuda", dtype=dtype) for _ in range(cfg.n_layers)]
        v = [torch.zeros(shape, device="cuda", dtype=dtype) for _ in range(cfg.n_layers)]
        kv = PrefixPromptKV(
            k, v, table, n_img, length, image_of_token, packed[:, 0], packed[:, 1], rope,
            cfg.n_heads, tiles if use_tiles else None,
        )  # fmt: skip
        with torch.inference_mode():
            h = dec(x, positions[None], kv)
        return h[0, : n_img * length + len(rows)], [c[1:] for c in k + v]  # page 0: the sink

    (want, want_pages), (got, got_pages) = run(False), run(True)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    for a, b in zip(got_pages, want_pages, strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
