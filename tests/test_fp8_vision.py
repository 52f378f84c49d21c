"""The FP8 vision tower (models/common/fp8_vision.py): quantization on the CPU, kernels and the
moondream2-size tower on a GPU."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from image_pipeline import PreparedImage
from tests.support.interpreted import interpreted_copy
from tests.test_engine import (  # noqa: F401  (fixtures)
    _engine,
    images,
)
from tests.test_engine_gpu import _moondream2_fp32_equals_reference
from vlm_server.chip_features import fp8_supported
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.device.model_entry import fp8_vision_choice
from vlm_server.engine.engine import BatchedEngine
from vlm_server.models.common import fp8_vision
from vlm_server.models.common.fp8_vision import (
    FP8,
    FP8_MAX,
    Fp8Weight,
    Unscaled,
    gelu_fp8,
    layernorm_fp8,
    quantize_rows,
)
from vlm_server.models.common.layers import LayerNorm
from vlm_server.models.common.vision import VisionEncoder
from vlm_server.models.interface import LoadedModel
from vlm_server.models.moondream2.config import VisionConfig
from vlm_server.server.in_process import InProcessEngine

# e4m3: 3 mantissa bits, so a normal value rounds within 2^-4 of itself; below 2^-6 (times
# the scale) values are subnormal, spaced 2^-9.
_REL, _SUB = 2.0**-4, 2.0**-9


def _within_e4m3(q: torch.Tensor, scale: torch.Tensor, y: torch.Tensor) -> None:
    back = q.float() * scale
    bound = _REL * y.abs() + _SUB * scale + 1e-12
    assert bool(((back - y).abs() <= bound).all()), (back - y).abs().max()


def _small_encoder(seed: int = 0) -> VisionEncoder:
    torch.manual_seed(seed)
    cfg = VisionConfig(
        enc_dim=64,
        enc_n_layers=3,
        enc_n_heads=4,
        enc_ff_dim=200,  # not a multiple of 128: fc2's inner width is padded
        crop_size=56,
        patch_size=14,
        overlap_margin=1,
        proj_inner_dim=64,
        proj_out_dim=32,
    )
    enc = VisionEncoder(cfg).eval()
    for p in enc.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return enc


def test_rows_quantize_within_one_e4m3_step_of_their_values() -> None:
    y = torch.randn(37, 300) * torch.logspace(-3, 3, 37)[:, None]
    y[5] = 0.0  # an all-zero row keeps a finite scale and stays zero
    q, scale = quantize_rows(y, width=320)
    assert q.dtype == FP8 and q.shape == (37, 320) and scale.shape == (37, 1)
    assert bool(torch.isfinite(scale).all()) and bool((q[:, 300:].float() == 0).all())
    assert bool((q[5].float() == 0).all())
    # each row's largest value maps to the top of e4m3's range
    top = q[:, :300].float().abs().amax(dim=1)
    assert bool(((top == FP8_MAX) | (y.abs().amax(dim=1) == 0)).all())
    _within_e4m3(q[:, :300], scale, y)


def test_weights_quantize_per_output_channel_with_zero_padding() -> None:
    torch.manual_seed(1)
    lin = torch.nn.Linear(200, 48)
    lin.weight.data[3] *= 1000  # one loud channel must not swamp the others' precision
    w = Fp8Weight.quantize(lin, in_padded=256)
    assert w.weight.dtype == FP8 and w.weight.shape == (48, 256) and w.scale.shape == (1, 48)
    assert bool((w.weight[:, 200:].float() == 0).all())
    _within_e4m3(w.weight[:, :200], w.scale.t(), lin.weight.detach())
    x = torch.randn(5, 200)
    q, s = quantize_rows(x, width=256)
    got = w(q, s, torch.float32)
    want = lin(x).detach()
    assert float((got - want).norm() / want.norm()) < 0.08


def _unscaled_fc(seed: int, rows: int, k: int, n: int) -> tuple[Fp8Weight, Unscaled, torch.Tensor]:
    """A quantized linear, an `Unscaled` product of it and the scaled product (bf16)."""
    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n)
    torch.nn.init.normal_(lin.bias, std=2.0)
    w = Fp8Weight.quantize(lin)
    q, s = quantize_rows(torch.randn(rows, k) * torch.logspace(-2, 2, rows)[:, None])
    return w, w.unscaled(q, s), w(q, s, torch.bfloat16)


def test_unscaled_products_are_the_scaled_ones_before_their_scales() -> None:
    w, u, scaled = _unscaled_fc(5, 9, 96, 40)
    assert u.raw.dtype == torch.bfloat16 and u.raw.shape == (9, 40)
    assert u.row.shape == (9, 1) and u.col is w.scale and u.bias is w.bias
    # the raw product's range is the quantized values', far from the scaled one's
    assert float(u.raw.float().abs().max()) > 1e3 * float(scaled.float().abs().max())
    # one bf16 rounding of the product before the bias, one of the scaled result
    product = (u.value() - u.bias.float()).abs()
    bound = 2**-8 * (product + scaled.float().abs()) + 1e-6
    assert bool(((u.value() - scaled.float()).abs() <= bound).all())


def test_quantizers_apply_an_unscaled_products_scales_and_bias() -> None:
    _, u, _ = _unscaled_fc(6, 7, 64, 200)
    g, g_scale = gelu_fp8(u, 256)
    want_g, want_scale = gelu_fp8(u.value(), 256)
    assert torch.equal(g_scale, want_scale) and torch.equal(
        g.view(torch.uint8), want_g.view(torch.uint8)
    )
    _within_e4m3(g[:, :200], g_scale, F.gelu(u.value(), approximate="tanh"))
    assert bool((g[:, 200:].float() == 0).all())
    torch.manual_seed(7)
    norm = LayerNorm(200)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(7, 200).bfloat16()
    norm = norm.bfloat16()
    s, q, scale = layernorm_fp8(x, u, norm)
    assert torch.equal(s, (x.float() + u.value()).bfloat16())
    _within_e4m3(q, scale, norm(s).float())


@pytest.fixture(scope="module")
def interpreted_fp8() -> Iterator[ModuleType]:
    """fp8_vision whose Triton kernels run in the interpreter on CPU tensors."""
    with interpreted_copy(fp8_vision) as module:
        module._on_triton = lambda t: True
        module.Unscaled = Unscaled  # the class the test's products are made of
        yield module


def _within_one_e4m3_step(q: torch.Tensor, want: torch.Tensor) -> None:
    """At most one e4m3 step apart (2^-3 of a normal value, 2^-6 among subnormals): the
    statistics' summation orders differ. Values whose rounding carries into the next power of
    two are left out: Triton 3.6's interpreter converts those a binade low (GPUs do not)."""
    got, want = q.float(), want.float()
    carry = (want.abs().frexp().mantissa == 0.5) & (got * 2 == want)
    assert int(carry.sum()) < want.numel() // 10
    diff = torch.where(carry, 0.0, (got - want).abs())
    assert bool((diff <= 0.13 * want.abs() + 2**-6).all()), float(diff.max())


@pytest.mark.parametrize("split", [True, False])
def test_quantizer_kernels_equal_the_torch_ones(interpreted_fp8: ModuleType, split: bool) -> None:
    """Both kernels, on plain and on `Unscaled` inputs, against the PyTorch path; the GELU
    quantizer with the row as a block and a tail, and as one block."""
    kern = interpreted_fp8
    _, u, _ = _unscaled_fc(8, 5, 64, 300)
    for src in (u, u.value().bfloat16()):
        g, g_scale = kern.gelu_fp8(src, 384, (split, 4))
        want_g, want_scale = gelu_fp8(src, 384)
        torch.testing.assert_close(g_scale, want_scale, rtol=1e-5, atol=0)
        _within_one_e4m3_step(g, want_g)
        assert bool((g[:, 300:].float() == 0).all())
    torch.manual_seed(9)
    norm = LayerNorm(300)
    torch.nn.init.normal_(norm.weight)
    torch.nn.init.normal_(norm.bias)
    # a float32 residual stream: the interpreter's bf16 arithmetic is not the GPU's (its sums
    # of two bf16 values overflow, its conversions to bf16 truncate); the GPU test has bf16
    x = torch.randn(5, 300) * 3
    for a in (u, u.value(), None):
        s, q, scale = kern.layernorm_fp8(x, a, norm)
        want_s, want_q, want_scale = layernorm_fp8(x, a, norm)
        # the kernel may fuse raw * row * col + bias into one FMA
        torch.testing.assert_close(s, want_s, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(scale, want_scale, rtol=2**-6, atol=0)
        _within_one_e4m3_step(q, want_q)


def test_layernorm_and_gelu_quantizers_compute_the_norm_and_the_activation() -> None:
    torch.manual_seed(2)
    norm = LayerNorm(96)
    torch.nn.init.normal_(norm.weight)
    torch.nn.init.normal_(norm.bias)
    x, a = torch.randn(11, 96), torch.randn(11, 96)
    s, q, scale = layernorm_fp8(x, a, norm)
    torch.testing.assert_close(s, x + a)
    _within_e4m3(q, scale, norm(x + a))
    s0, q0, scale0 = layernorm_fp8(x, None, norm)
    assert s0 is x
    _within_e4m3(q0, scale0, norm(x))
    u = torch.randn(11, 200) * 4
    g, g_scale = gelu_fp8(u, 256)
    assert g.shape == (11, 256) and bool((g[:, 200:].float() == 0).all())
    _within_e4m3(g[:, :200], g_scale, F.gelu(u, approximate="tanh"))


def test_fp8_tower_stays_close_to_the_exact_one_and_can_be_switched_off() -> None:
    enc = _small_encoder()
    crops = torch.randn(3, 3, 56, 56)
    with torch.inference_mode():
        exact = enc.encode(crops)
        enc.use_fp8()
        assert enc.fp8 is not None and enc.fp8.inner_padded == 256
        approx = enc.encode(crops)
        enc.use_fp8(False)
        again = enc.encode(crops)
    err = float((approx - exact).norm() / exact.norm())
    assert 0 < err < 0.03, err
    torch.testing.assert_close(again, exact, rtol=0, atol=0)


def test_fp8_tower_tracks_weight_changes_only_when_requantized() -> None:
    enc = _small_encoder()
    crops = torch.randn(2, 3, 56, 56)
    with torch.inference_mode():
        enc.use_fp8()
        before = enc.encode(crops)
        enc.blocks[0].mlp.fc1.weight.mul_(3)
        assert torch.equal(enc.encode(crops), before)  # quantized copies, not views
        enc.use_fp8()
        assert not torch.equal(enc.encode(crops), before)


def test_runtime_refuses_vision_fp8_without_fp8_units(tiny: LoadedModel) -> None:
    loaded = LoadedModel(copy.deepcopy(tiny.model), tiny.tokenizer, tiny.config, tiny.source)
    assert not fp8_supported(loaded.model.device)
    with pytest.raises(ValueError, match="vision_fp8 needs a CUDA device"):
        BatchedEngine(loaded, EngineConfig(vision_fp8=True, kv_budget_bytes=8 << 20))


def test_server_flag_reaches_the_engine_config() -> None:
    from vlm_server.options.command_line import load_config

    assert load_config([]).vision_fp8 == "auto"
    assert load_config([]).engine_config.vision_fp8 is None  # auto: the engine decides
    assert load_config(["--vision-fp8", "true"]).engine_config.vision_fp8 is True
    on = load_config([], environ={"VLM_VISION_FP8": "true"})
    assert on.vision_fp8 == "on" and on.engine_config.vision_fp8 is True
    assert load_config(["--vision-fp8", "off"]).engine_config.vision_fp8 is False


@pytest.mark.parametrize(
    ("asked", "experts", "units", "exact", "tower", "on", "why"),
    [
        (None, True, True, True, True, True, "auto: on, an FP8 build"),
        (None, False, True, True, True, False, "experts are not in FP8"),
        (None, True, False, True, True, False, "no FP8 matrix units"),
        (None, True, True, True, False, False, "no FP8 products"),
        (None, True, True, False, True, False, "--vision-weights quantizes"),
        (True, False, False, True, True, True, "as asked"),
        (False, True, True, True, True, False, "as asked"),
    ],
)
def test_vision_fp8_auto_is_on_for_an_fp8_build_on_a_chip_with_fp8_units(
    asked: bool | None, experts: bool, units: bool, exact: bool, tower: bool, on: bool, why: str
) -> None:
    got, reason = fp8_vision_choice(asked, experts, units, exact, tower)
    assert got is on and why in reason


def test_auto_keeps_the_exact_tower_where_it_cannot_be_fp8(tiny: LoadedModel, caplog) -> None:
    """A server's default (auto) on a model without FP8 experts, or without FP8 units, starts
    with the exact tower and says why; asking for it there is refused (above)."""
    loaded = LoadedModel(copy.deepcopy(tiny.model), tiny.tokenizer, tiny.config, tiny.source)
    with caplog.at_level(logging.INFO, logger="vlm_server.engine.device.runtime"):
        engine = BatchedEngine(loaded, EngineConfig(vision_fp8=None, kv_budget_bytes=8 << 20))
    assert "vision_fp8 auto: off, the experts are not in FP8" in caplog.text
    assert loaded.model.vision.fp8 is None
    del engine


# ---- GPU ---------------------------------------------------------------------------------


@pytest.mark.gpu
def test_triton_quantizers_equal_the_torch_ones() -> None:
    g = torch.Generator(device="cuda").manual_seed(3)
    norm = LayerNorm(1152).cuda().requires_grad_(False)
    norm.weight.data.normal_(generator=g)
    norm.bias.data.normal_(generator=g)
    x = torch.randn(6561, 1152, device="cuda", generator=g).bfloat16()
    a = torch.randn(6561, 1152, device="cuda", generator=g).bfloat16()
    norm = norm.bfloat16()
    for addend, warps in ((a, 4), (a, 8), (None, None)):
        s, q, scale = layernorm_fp8(x, addend, norm, warps)
        s_cpu, q_cpu, scale_cpu = layernorm_fp8(
            x.cpu(), None if addend is None else addend.cpu(), copy.deepcopy(norm).cpu()
        )
        torch.testing.assert_close(s.cpu(), s_cpu, rtol=0, atol=0)
        torch.testing.assert_close(scale.cpu(), scale_cpu, rtol=1e-5, atol=0)
        # the statistics' summation order differs: at most one e4m3 step apart
        diff = (q.float().cpu() - q_cpu.float()).abs()
        assert float((diff / q_cpu.float().abs().clamp_min(2**-6)).max()) <= 0.13
    u = (torch.randn(6561, 4304, device="cuda", generator=g) * 3).bfloat16()
    gq, gs = gelu_fp8(u, 4352)
    gq_cpu, gs_cpu = gelu_fp8(u.cpu(), 4352)
    _same_bits_in_every_gelu_launch(u, gq, gs)
    torch.testing.assert_close(gs.cpu(), gs_cpu, rtol=1e-5, atol=0)
    assert bool((gq[:, 4304:].float() == 0).all())
    diff = (gq.float().cpu() - gq_cpu.float()).abs()
    assert float((diff / gq_cpu.float().abs().clamp_min(2**-6)).max()) <= 0.13
    # `Unscaled` products (raw values of an FP8 GEMM's range) into both quantizers
    un, un_cpu = _random_unscaled(u * 1e4, g)
    gq, gs = gelu_fp8(un, 4352)
    _same_bits_in_every_gelu_launch(un, gq, gs)
    want_q, want_s = gelu_fp8(un_cpu, 4352)
    torch.testing.assert_close(gs.cpu(), want_s, rtol=1e-5, atol=0)
    _within_one_e4m3_step(gq.cpu(), want_q)
    un, un_cpu = _random_unscaled(a * 1e4, g)
    s, q, scale = layernorm_fp8(x, un, norm)
    want_sum, want_q, want_s = layernorm_fp8(x.cpu(), un_cpu, copy.deepcopy(norm).cpu())
    # the kernel may fuse raw * row * col + bias into one FMA: one bf16 step apart
    torch.testing.assert_close(s.cpu(), want_sum, rtol=2**-7, atol=0)
    torch.testing.assert_close(scale.cpu(), want_s, rtol=1e-5, atol=0)
    _within_one_e4m3_step(q.cpu(), want_q)


def _same_bits_in_every_gelu_launch(
    u: torch.Tensor | Unscaled, q: torch.Tensor, scale: torch.Tensor
) -> None:
    """The GELU quantizer's other launch forms give ``q`` and ``scale`` bit for bit."""
    for launch in ((False, 8), (True, 4)):
        other, other_scale = gelu_fp8(u, 4352, launch)
        assert torch.equal(other_scale, scale)
        assert torch.equal(other.view(torch.uint8), q.view(torch.uint8))


def _random_unscaled(raw: torch.Tensor, g: torch.Generator) -> tuple[Unscaled, Unscaled]:
    """``raw`` as an `Unscaled` product with random scales and bias, on the GPU and a copy
    on the CPU."""
    rows, cols = raw.shape
    row = torch.rand(rows, 1, device="cuda", generator=g) * 1e-4
    col = torch.rand(1, cols, device="cuda", generator=g) * 1e-2
    bias = torch.randn(cols, device="cuda", generator=g).bfloat16()
    un = Unscaled(raw.bfloat16(), row, col, bias)
    return un, Unscaled(*(t.cpu() for t in (un.raw, row, col, bias)))


@pytest.mark.gpu
def test_moondream2_size_fp8_tower_stays_close_and_graphs() -> None:
    from tests.support.towers import full_size_tower

    enc, crops = full_size_tower(seed=4)
    with torch.inference_mode():
        exact = enc.encode(crops).float()
        enc.use_fp8()
        approx = enc.encode(crops).float()
        err = float((approx - exact).norm() / exact.norm())
        cos = F.cosine_similarity(approx.flatten(0, 1), exact.flatten(0, 1), dim=-1)
        assert err < 0.05 and float(cos.min()) > 0.99, (err, float(cos.min()))
        static = crops.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            enc.encode(static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = enc.encode(static)
        graph.replay()
        torch.testing.assert_close(out.float(), approx, rtol=0, atol=0)


@pytest.mark.gpu
def test_engine_image_graphs_compute_what_the_reference_computes_with_fp8(
    tiny: LoadedModel,
    images: list[PreparedImage],  # noqa: F811
) -> None:
    """The engine's captured image path (uint8 crops to BOS + image embeddings) gives, bit
    for bit, what the one-request reference computes from the same FP8-enabled model."""
    model = copy.deepcopy(tiny.model).cuda()
    loaded = LoadedModel(model, tiny.tokenizer, tiny.config, tiny.source)
    engine = _engine(loaded, 2, vision_fp8=True)
    rt = engine.batched.runtime
    assert model.vision.fp8 is not None
    rt.capture_vision_graphs(progress=False)
    exact_model = copy.deepcopy(tiny.model).cuda()  # never switched: the graphs hold its weights
    with torch.inference_mode():
        for image in images:
            crops = rt.crops.on_device(rt.crops.crops_of(image))
            assert image.tiling in rt.prefill.image_graphs
            rt.prefill.image_inputs[crops.shape[0]].copy_(crops)
            got = rt.prefill.image_graphs.replay(image.tiling).clone()
            norm = image.normalized(model.dtype, model.device)
            want = model.prefix_embeddings(model.image_embeddings(norm, image.tiling))
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            exact = exact_model.prefix_embeddings(exact_model.image_embeddings(norm, image.tiling))
            assert not torch.equal(want, exact)  # the FP8 tower really ran


@pytest.mark.gpu
def test_cuda_engine_with_fp8_tower_equals_the_reference_on_the_same_model(
    images: list[PreparedImage],  # noqa: F811
) -> None:
    """Through the whole engine (batched prefixes, graphs, riding prompts) the answers equal
    the reference's on the same FP8-enabled model: moondream2-size random weights in fp32,
    where near-ties are vanishingly rare (the tiny fixtures are built around near-ties, which
    the engine's attention kernels may break differently once the image features move)."""

    def check(engine: InProcessEngine) -> None:
        assert (
            engine.batched.loaded.model.vision.fp8 is not None
            and engine.batched.runtime.prefill.image_graphs
        )

    loaded = _moondream2_fp32_equals_reference(images, check, vision_fp8=True)
    with torch.inference_mode():  # the reference above really ran the FP8 tower
        norm = images[0].normalized(torch.float32, "cuda")
        fp8 = loaded.model.image_embeddings(norm, images[0].tiling)
        loaded.model.vision.use_fp8(False)
        assert not torch.equal(fp8, loaded.model.image_embeddings(norm, images[0].tiling))
