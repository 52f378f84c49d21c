"""The quantized weight layouts of models/common/quant_gemm.py, written out plainly: random
quantized weights, their packing and the reference dequantizer the kernels are checked
against ("dequantize, then the plain product"); and a quantized model's 16-bit twin."""

from __future__ import annotations

import copy

import torch
from torch import nn

from vlm_server.engine.api import GenerationRequest, Task
from vlm_server.models.common.quant_linear import QuantLinear
from vlm_server.models.interface import LoadedModel
from vlm_server.models.moondream3.moe import ExpertBank

GROUP = 128
# The fp32 engines' steps: fp32 products over quantized weights run on the CUDA cores, where
# a mixed-step graph of the default 4096 tokens takes seconds to warm up and capture; the
# requests of these tests fit in far fewer.
FP32_STEP_TOKENS = 256


def random_scale(
    shape: tuple[int, ...], g: torch.Generator, dtype: torch.dtype, powers_of_two: bool
) -> torch.Tensor:
    """Positive scales about 1e-2; ``powers_of_two``: 2^-3 .. 2^-8, whose products with any
    quantized value are exact in bf16 (Triton's interpreter rounds fp32 to bf16 by
    truncating, where GPUs and torch round to nearest)."""
    if powers_of_two:
        return torch.exp2(-torch.randint(3, 9, shape, generator=g).float()).to(dtype)
    return (torch.rand(shape, generator=g) * 0.02 + 0.001).to(dtype)


def random_int8(
    n: int,
    k: int,
    g: torch.Generator,
    dtype: torch.dtype = torch.bfloat16,
    powers_of_two: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight int8 [n, k], scale [n]) of a random weight."""
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    return q, random_scale((n,), g, dtype, powers_of_two)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[n, k] values in [-8, 7] -> uint8 [n, k / 2]: column 2j low nibble, 2j + 1 high."""
    nibbles = (q.to(torch.int16) & 0xF).to(torch.uint8)
    return nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [n, k / 2] -> int8 [n, k], each nibble read as two's complement."""
    b = packed.to(torch.int16)
    lo, hi = b & 0xF, b >> 4
    q = torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1)
    return torch.where(q >= 8, q - 16, q).to(torch.int8)


def random_int4(
    n: int,
    k: int,
    g: torch.Generator,
    dtype: torch.dtype = torch.bfloat16,
    powers_of_two: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight uint8 [n, k / 2], scale [n, k / GROUP]) of a random weight."""
    q = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    return pack_int4(q), random_scale((n, k // GROUP), g, dtype, powers_of_two)


def dequantize(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The weight in the scale's dtype: int8 per channel, or packed uint8 INT4 in groups."""
    if qweight.dtype == torch.int8:
        return (qweight.float() * scale.float()[:, None]).to(scale.dtype)
    q = unpack_int4(qweight)
    return (q.float() * scale.float().repeat_interleave(GROUP, dim=1)).to(scale.dtype)


def reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize, then the product in x's dtype, summed in fp64 (before the output's
    rounding): the kernels must match it up to their fp32 sums' order and that rounding."""
    w = dequantize(qweight, scale).to(x.dtype)
    want = x.double() @ w.double().t()
    if bias is not None:
        want = want + bias.double()
    return want


def dequantized_twin(quantized: LoadedModel, plain: LoadedModel) -> LoadedModel:
    """``plain`` (the same checkpoint loaded with 16-bit weights, in the quantized model's
    dtype) with each weight ``quantized`` holds in 4 or 8 bits (its decoder's and its vision
    tower's) replaced by the values it stands for: the 16-bit model the quantized one must
    answer as."""
    caps = quantized.model.capabilities
    names = [n for held in (caps.quantized, caps.vision_quantized) if held for n in held.weights]
    assert names
    model = copy.deepcopy(plain.model)
    assert isinstance(model, nn.Module) and isinstance(quantized.model, nn.Module)
    with torch.no_grad():
        for name in names:
            layer = quantized.model.get_submodule(name.removesuffix(".weight"))
            weight = model.get_parameter(name)
            if isinstance(layer, ExpertBank):  # Moondream 3's experts [E, out, in]
                weight.copy_(layer.values(weight.dtype).to(weight.device))
                continue
            assert isinstance(layer, QuantLinear)
            weight.copy_(layer.dequantized(weight.dtype).to(weight.device))
    return LoadedModel(model, plain.tokenizer, plain.config, plain.source + ":dequantized")


def twin_requests(images: list, tokens: tuple[int, int, int] = (30, 20, 16)) -> list:
    """A greedy caption, a greedy query, a sampled caption (its seed fixed) and a detect, on
    three pictures: what a quantized engine and its twin's reference must answer alike."""
    caption, query, sampled = tokens
    return [
        GenerationRequest(
            Task.CAPTION, images[0], request_id="c0", temperature=0, max_tokens=caption
        ),
        GenerationRequest(
            Task.QUERY,
            images[1],
            request_id="q0",
            question="what?",
            temperature=0,
            max_tokens=query,
        ),
        GenerationRequest(
            Task.CAPTION, images[2], request_id="s0", temperature=0.8, seed=3, max_tokens=sampled
        ),
        GenerationRequest(Task.DETECT, images[0], object_name="car", max_objects=3),
    ]


def md2_size_requests(images: list) -> list:
    """A caption, a query and a detect for a full-size random model in fp32 (ties vanishingly
    rare), answered by the engine and by the reference alike."""
    return [
        GenerationRequest(Task.CAPTION, images[0], temperature=0, max_tokens=12),
        GenerationRequest(
            Task.QUERY, images[1], question="what is it?", temperature=0, max_tokens=9
        ),
        GenerationRequest(Task.DETECT, images[2], object_name="car", max_objects=3),
    ]


def fp32_engine_answers(loaded: LoadedModel, reqs: list, check: object, kv_bytes: int) -> list:
    """Each request's `Finished`, in order, from an fp32 engine over ``loaded`` (depth 2,
    four rows, steps of at most `FP32_STEP_TOKENS`); ``check`` looks at it once started."""
    from tests.test_engine import _finish_all

    return _finish_all(
        loaded,
        reqs,
        2,
        check,  # type: ignore[arg-type]
        max_batch_size=4,
        kv_budget_bytes=kv_bytes,
        max_step_tokens=FP32_STEP_TOKENS,
    )


def assert_answers_as(twin: LoadedModel, reqs: list, done: list) -> None:
    """Each finished request answers as the reference on ``twin`` (text, or a detect's
    boxes)."""
    from tests.test_engine import _reference_text
    from vlm_server.reference import ReferenceGenerator

    ref = ReferenceGenerator(twin.model, twin.tokenizer)
    for req, fin in zip(reqs, done, strict=True):
        if req.task is Task.DETECT:
            want = ref.detect(req.image, req.object_name, req.max_objects).boxes
            assert [vars(b) for b in fin.boxes] == [vars(b) for b in want]
        else:
            assert fin.text == _reference_text(ref, req), req.request_id


def block_outputs(
    prod: object, h: torch.Tensor, x: torch.Tensor, attn: torch.Tensor, norm: nn.Module
) -> list:
    """Every output of a block's fused products (models/common/fused_products.py) on these
    inputs, in one order: the quantized and the 16-bit stacks are compared with them."""
    qkv, hidden = prod.qkv_and_hidden(h)  # type: ignore[attr-defined]
    pending = prod.start_mlp(h)  # type: ignore[attr-defined]
    return [
        qkv,
        hidden,
        prod.qkv(h),  # type: ignore[attr-defined]
        prod.branch(attn, hidden),  # type: ignore[attr-defined]
        *prod.add_branch_and_norm(x, attn, hidden, norm),  # type: ignore[attr-defined]
        *prod.add_branch_and_norm_after(x, attn, pending, norm),  # type: ignore[attr-defined]
    ]
