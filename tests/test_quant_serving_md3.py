"""Moondream 3 served with 8- and 4-bit weights (docs/quantization.md) on the CPU, on the tiny
model: every block linear, the expert stacks included, held quantized; the batched engine
answers token for token as the reference over the 16-bit twin (the same checkpoint with each
quantized weight replaced by the values it stands for), quantized at load from the 16-bit
layout or from the FP8-expert layout, or read from a ``vlm quantize`` directory; no 16-bit
copy of a quantized expert stays; the memory plan counts the experts at their bits.

Off CUDA the experts run the plain path (dequantize, then the products), so the answers equal
the twin's exactly; the fused kernels over the stored values are checked against that path in
tests/test_moondream3_moe_quant.py (interpreter) and tests/test_moondream3_moe_quant_gpu.py."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from image_pipeline import PreparedImage
from tests.support.quant_reference import assert_answers_as, dequantized_twin, twin_requests
from tests.test_engine import _finish_all, _reference_text, images  # noqa: F401  (fixtures)
from vlm_server.engine.api import GenerationRequest
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.memory_plan import plan_memory
from vlm_server.models.moondream3.moe import ExpertBank
from vlm_server.models.quantized import quantize_checkpoint
from vlm_server.models.registry import (
    family,
    load_model,
    memory_shape,
    preset,
    random_model,
    write_checkpoint,
)

F32 = torch.float32
CONFIG = "md3-tiny"
GROUP = 32  # the tiny model's widths (64, experts 32) are below the kernels' 128


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model in the 16-bit layout, in the FP8-expert one, and vlm quantize's int8."""
    root = tmp_path_factory.mktemp("md3q")
    config = preset(CONFIG)
    hf = write_checkpoint(config, root / "hf", seed=1, progress=False)
    md3 = write_checkpoint(config, root / "md3", seed=1, progress=False, layout="md3")
    quantize_checkpoint(md3, root / "int8", "int8")
    return {"hf": hf, "md3": md3, "int8-file": root / "int8"}


# case -> (source, load_model's arguments, engine depth)
CASES: dict[str, tuple[str, dict, int]] = {
    "int8-at-load": ("hf", {"weights": "int8"}, 1),
    "int4-from-fp8-layout": ("md3", {"weights": "int4", "group_size": GROUP}, 2),
    "int8-file": ("int8-file", {}, 2),
}


def _requests(images: list[PreparedImage]) -> list[GenerationRequest]:  # noqa: F811
    return twin_requests(images, (24, 16, 12))


def _experts(config_name: str = CONFIG) -> list[str]:
    shapes = family("moondream3").expected_shapes(preset(config_name))
    return [n for n, s in shapes.items() if len(s) == 3 and n.startswith("text.")]


@pytest.mark.parametrize("case", list(CASES))
def test_the_engine_answers_as_the_dequantized_model(
    case: str,
    sources: dict[str, Path],
    images: list[PreparedImage],  # noqa: F811
) -> None:
    source, how, depth = CASES[case]
    loaded = load_model(sources[source], dtype=F32, progress=False, **how)
    held = loaded.model.capabilities.quantized
    assert held is not None and held.format == case[:4] and not held.kept
    assert set(_experts()) <= set(held.weights)  # the experts too
    plain = load_model(sources["md3" if source != "hf" else "hf"], dtype=F32, progress=False)
    twin = dequantized_twin(loaded, plain)
    name = _experts()[0]
    original, served = plain.model.get_parameter(name), twin.model.get_parameter(name)
    assert not torch.equal(original, served)  # the format did round the experts
    reqs = _requests(images)
    done = _finish_all(loaded, reqs, depth, max_batch_size=4)
    assert_answers_as(twin, reqs, done)


def test_no_16_bit_copy_of_a_quantized_expert_stays() -> None:
    loaded = random_model(
        preset(CONFIG), seed=1, dtype=F32, progress=False, weights="int4", group_size=GROUP
    )
    model = loaded.model
    held = model.capabilities.quantized
    assert held is not None
    state = model.state_dict()
    for name in _experts():
        bank = model.get_submodule(name.removesuffix(".weight"))
        assert isinstance(bank, ExpertBank) and bank.format == "int4"
        assert name not in state and not list(bank.parameters())
        assert state[name.replace(".weight", ".qweight")].dtype == torch.uint8
        assert state[name.replace(".weight", ".scale")].dtype == torch.bfloat16
    shapes = family("moondream3").expected_shapes(preset(CONFIG))
    left = sum(math.prod(s) for n, s in shapes.items() if n not in held.weights)
    assert sum(p.numel() for p in model.parameters()) == left


def test_a_file_holds_what_quantizing_at_load_gives(sources: dict[str, Path]) -> None:
    """A vlm quantize directory (from the FP8-expert layout) is served as it is: the same
    stored values as quantizing that checkpoint at load."""
    at_load = load_model(sources["md3"], dtype=F32, progress=False, weights="int8")
    stored = load_model(sources["int8-file"], dtype=F32, progress=False)
    a, b = at_load.model.state_dict(), stored.model.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_fp8_experts_are_refused_over_quantized_ones() -> None:
    loaded = random_model(preset(CONFIG), seed=1, dtype=F32, progress=False, weights="int8")
    with pytest.raises(ValueError, match="held in int8, not 16-bit"):
        loaded.model.use_fp8_experts()
    with pytest.raises(ValueError, match="experts_fp8_activations needs the experts in FP8"):
        loaded.model.use_fp8_activations()


def test_the_plan_holds_the_experts_in_their_bits() -> None:
    config = preset("moondream3")
    shape = memory_shape(config)
    shapes = family("moondream3").expected_shapes(config)
    experts = [n for n, s in shapes.items() if len(s) == 3 and n.startswith("text.")]
    params = sum(math.prod(shapes[n]) for n in experts)
    rows = sum(shapes[n][0] * shapes[n][1] for n in experts)
    assert (shape.params["experts"], shape.expert_rows) == (params, rows)
    cfg = EngineConfig()
    bf16 = plan_memory(shape, cfg, 80 << 30, "bf16").weights["experts"]
    int8 = plan_memory(shape, cfg, 80 << 30, "int8").weights["experts"]
    int4 = plan_memory(shape, cfg, 80 << 30, "int4").weights["experts"]
    assert bf16 == 2 * params
    assert int8 == params + 2 * rows  # a byte a weight, a bf16 scale a row
    assert int4 == params // 2 + 2 * (params // 128)  # half a byte, a bf16 scale per 128
    # Moondream 3's experts: 20 mixture layers (of 24) of 64 x 3 x 2048 x 1024 weights.
    assert params == 20 * 64 * 3 * 2048 * 1024
