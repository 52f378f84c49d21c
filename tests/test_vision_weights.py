"""``--vision-weights int8|int4`` (docs/quantization.md) on the CPU, on the tiny models of both
families: the vision tower's block linears quantized at load, whatever format the decoder is
in; the batched engine answers token for token (and box for box) as the reference over the
16-bit twin (the checkpoint with each quantized weight replaced by the values it stands for);
nothing 16-bit of a quantized tower weight stays; the refusals name their flag; the memory
plan counts the tower in its format.

Off CUDA the quantized layers widen each weight for the product (dequantize, then the plain
product), so the tower's features equal the twin's exactly and so do the answers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from image_pipeline import PreparedImage
from tests.support.quant_reference import dequantized_twin
from tests.support.threads import one_torch_thread  # noqa: F401  (autouse)
from tests.test_engine import _finish_all, _reference_text, images  # noqa: F401  (fixtures)
from vlm_server.cli import main as cli_main
from vlm_server.engine.api import GenerationRequest, Task
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.memory_plan import plan_memory
from vlm_server.models import capabilities
from vlm_server.models.capabilities import CapabilityError
from vlm_server.models.common import quant_gemm, quant_plan
from vlm_server.models.common.quant_linear import QuantLinear
from vlm_server.models.interface import Formats, LoadedModel
from vlm_server.models.quantized import quantize_checkpoint
from vlm_server.models.registry import (
    family,
    family_of,
    load_model,
    memory_shape,
    preset,
    random_model,
)
from vlm_server.options.table import ServerConfig
from vlm_server.reference import ReferenceGenerator

F32 = torch.float32
GROUP = 32  # the tiny models' widths (64) are below the kernels' 128
TOWER = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")

# case -> (preset, load arguments, engine depth)
CASES: dict[str, tuple[str, dict, int]] = {
    "md2-int8-tower": ("tiny", {"vision_weights": "int8"}, 2),
    "md2-int4-tower-int8-decoder": (
        "tiny",
        {"vision_weights": "int4", "weights": "int8", "group_size": GROUP},
        1,
    ),
    "md3-int8-tower": ("md3-tiny", {"vision_weights": "int8"}, 2),
    "md3-int4-tower": ("md3-tiny", {"vision_weights": "int4", "group_size": GROUP}, 2),
}


def _model(name: str, **kw: object) -> LoadedModel:
    return random_model(preset(name), seed=1, dtype=F32, progress=False, **kw)  # type: ignore[arg-type]


def _requests(images: list[PreparedImage]) -> list[GenerationRequest]:  # noqa: F811
    return [
        GenerationRequest(Task.CAPTION, images[0], request_id="c0", temperature=0, max_tokens=24),
        GenerationRequest(
            Task.QUERY, images[1], request_id="q0", question="what?", temperature=0, max_tokens=16
        ),
        GenerationRequest(Task.DETECT, images[2], object_name="car", max_objects=3),
    ]


@pytest.mark.parametrize("case", list(CASES))
def test_the_engine_answers_as_the_dequantized_tower(
    case: str,
    images: list[PreparedImage],  # noqa: F811
) -> None:
    name, kw, depth = CASES[case]
    loaded = _model(name, **kw)
    tower = loaded.model.capabilities.vision_quantized
    assert tower is not None and tower.format == kw["vision_weights"] and not tower.kept
    blocks = len(loaded.model.vision.blocks)  # type: ignore[attr-defined]
    assert len(tower.weights) == 4 * blocks
    plain = _model(name)
    twin = dequantized_twin(loaded, plain)
    weight = "vision.blocks.0.mlp.fc1.weight"
    original, served = plain.model.get_parameter(weight), twin.model.get_parameter(weight)  # type: ignore[attr-defined]
    assert not torch.equal(original, served)  # the format did round the tower
    crops, tiling = images[0].normalized(F32, torch.device("cpu")), images[0].tiling
    with torch.inference_mode():
        features = loaded.model.image_embeddings(crops, tiling)
        assert torch.equal(features, twin.model.image_embeddings(crops, tiling))
        assert not torch.equal(features, plain.model.image_embeddings(crops, tiling))
    reqs = _requests(images)
    done = _finish_all(loaded, reqs, depth, max_batch_size=4)
    ref = ReferenceGenerator(twin.model, twin.tokenizer)
    for req, fin in zip(reqs[:2], done[:2], strict=True):
        assert fin.text == _reference_text(ref, req), req.request_id
    want = ref.detect(reqs[2].image, "car", 3).boxes
    assert [vars(b) for b in done[2].boxes] == [vars(b) for b in want]


@pytest.mark.parametrize("case", ["md2-int8-tower", "md3-int4-tower"])
def test_no_16_bit_copy_of_a_quantized_tower_weight_stays(case: str) -> None:
    name, kw, _ = CASES[case]
    model = _model(name, **kw).model
    tower = model.capabilities.vision_quantized
    assert tower is not None
    state = model.state_dict()  # type: ignore[attr-defined]
    for weight in tower.weights:
        layer = weight.removesuffix(".weight")
        assert weight not in state
        assert isinstance(model.get_submodule(layer), QuantLinear)  # type: ignore[attr-defined]
        assert state[layer + ".qweight"].dtype in (torch.int8, torch.uint8)
        assert state[layer + ".scale"].dtype == torch.bfloat16
        members = sorted(k for k in state if k.startswith(layer + "."))
        assert members == [layer + s for s in (".bias", ".qweight", ".scale")]
    # The parameters are the 16-bit model's less exactly the quantized tower weights.
    shapes = family_of(preset(name)).expected_shapes(preset(name))
    gone = sum(math.prod(shapes[n]) for n in tower.weights)
    plain = _model(name).model
    count = sum(p.numel() for p in plain.parameters())  # type: ignore[attr-defined]
    assert sum(p.numel() for p in model.parameters()) == count - gone  # type: ignore[attr-defined]


def test_the_checkpoint_loads_with_its_tower_quantized(tiny_dir: Path) -> None:
    """Through load_model from a file (not only random weights); the text stays 16-bit."""
    loaded = load_model(tiny_dir, dtype=F32, progress=False, vision_weights="int8")
    caps = loaded.model.capabilities
    assert caps.quantized is None and caps.vision_quantized is not None
    assert caps.fused_products is not None  # the decoder's fused products are untouched
    assert all(n.startswith("vision.blocks.") for n in caps.vision_quantized.weights)


def test_an_int4_tower_keeps_what_its_groups_do_not_divide() -> None:
    # The tiny tower's width is 64, its MLP's 128: only fc2 takes groups of 128.
    loaded = _model("tiny", vision_weights="int4", group_size=128)
    tower = loaded.model.capabilities.vision_quantized
    assert tower is not None
    assert tower.weights == tuple(f"vision.blocks.{i}.mlp.fc2.weight" for i in range(2))
    kept = {f"vision.blocks.{i}.{p}.weight" for i in range(2) for p in TOWER[:3]}
    assert set(tower.kept) == kept
    assert all(why == "64 input columns are not a multiple of 128" for why in tower.kept.values())
    fc1 = loaded.model.get_submodule("vision.blocks.0.mlp.fc1")  # type: ignore[attr-defined]
    assert isinstance(fc1, torch.nn.Linear)  # kept: a 16-bit layer as loaded


# ---- refusals -------------------------------------------------------------------------------


def test_a_family_that_does_not_declare_it_is_refused() -> None:
    plain_only = Formats(weights=("bf16",), kv=("bf16",), quantized=("int8",))
    with pytest.raises(
        CapabilityError, match=r"^--vision-weights int8: the toy family serves its vision tower"
    ):
        quant_plan.vision_request("toy", plain_only, "int8", 128, "cpu", None)
    assert quant_plan.vision_request("toy", plain_only, "exact", 128, "cpu", None) is None
    md2 = family("moondream2").formats
    assert quant_plan.vision_request("moondream2", md2, "int4", 32, "cpu", None) is not None


def test_the_fp8_tower_is_refused_beside_it(tiny_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"^vision_weights int8: not with vision_fp8"):
        ServerConfig(vision_weights="int8", vision_fp8="on")
    with pytest.raises(ValueError, match=r"^vision_weights int4: not with vision_fp8"):
        EngineConfig(vision_weights="int4", vision_fp8=True)
    # The model says so too: its tower is no longer 16-bit, so it has no FP8 tower to offer.
    model = load_model(tiny_dir, dtype=F32, progress=False, vision_weights="int8").model
    assert model.capabilities.fp8_vision is None
    with pytest.raises(CapabilityError, match=r"^--vision-fp8: the model 'tiny' has no FP8"):
        capabilities.check(model, {"vision_fp8": True})


def test_a_tower_stored_quantized_is_not_quantized_again(tiny_dir: Path, tmp_path: Path) -> None:
    quantize_checkpoint(tiny_dir, tmp_path / "q", "int8", vision=True)
    with pytest.raises(
        CapabilityError, match=r"^--vision-weights int4: the checkpoint holds its vision tower"
    ):
        load_model(tmp_path / "q", dtype=F32, progress=False, vision_weights="int4")
    text_only = tmp_path / "text"
    quantize_checkpoint(tiny_dir, text_only, "int8", vision=False)
    loaded = load_model(text_only, dtype=F32, progress=False, vision_weights="int8")
    assert loaded.model.capabilities.vision_quantized is not None


def test_what_cuda_cannot_run_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    formats = family("moondream2").formats
    monkeypatch.setattr(quant_gemm, "AVAILABLE", False)
    with pytest.raises(CapabilityError, match=r"^--vision-weights int8: .* Triton is not"):
        quant_plan.vision_request("moondream2", formats, "int8", 128, "cuda", None)
    monkeypatch.setattr(quant_gemm, "AVAILABLE", True)
    with pytest.raises(CapabilityError, match=r"^--vision-weights int4: INT4 groups of 32"):
        quant_plan.vision_request("moondream2", formats, "int4", 32, "cuda", None)


def test_the_option_names_its_field() -> None:
    with pytest.raises(ValueError, match=r"^vision_weights must be one of exact, int8, int4"):
        ServerConfig(vision_weights="fp8")
    assert ServerConfig().vision_weights == "exact"
    assert ServerConfig(vision_weights="int4").engine_config.vision_weights == "int4"


def test_vlm_run_takes_the_flag(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["run", "caption", "sample", "--max-tokens", "6", "--json", "--model", str(tiny_dir)]
    assert cli_main([*base, "--vision-weights", "int8"]) == 0
    assert json.loads(capsys.readouterr().out)["finish_reason"]


# ---- the memory plan ------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["moondream2", "moondream3"])
def test_the_plan_holds_the_tower_linears_in_their_bits(model: str) -> None:
    config = preset(model)
    shape = memory_shape(config)
    shapes = family(model).expected_shapes(config)
    targets = [n for n in family(model).quant_targets(config, vision=True) if n.startswith("vis")]
    assert len(shape.vision_linears) == len(targets) == 4 * config.vision.enc_n_layers  # type: ignore[attr-defined]
    params = sum(math.prod(shapes[n]) for n in targets)
    rows = sum(shapes[n][0] for n in targets)
    # INT4 keeps the linears whose inputs are not a multiple of 128 (fc2's, 4304 columns).
    grouped = [n for n in targets if shapes[n][1] % 128 == 0]
    g_params = sum(math.prod(shapes[n]) for n in grouped)
    plans = {
        v: plan_memory(shape, EngineConfig(vision_weights=v), 80 << 30, "bf16")
        for v in ("exact", "int8", "int4")
    }
    exact, int8, int4 = (plans[v].weights for v in ("exact", "int8", "int4"))
    rest = exact["vision"] - 2 * params
    assert int8["vision"] == rest + params + 2 * rows  # a byte a weight, a bf16 scale a row
    assert int4["vision"] == rest + 2 * (params - g_params) + g_params // 2 + 2 * (g_params // 128)
    assert len(grouped) == 3 * config.vision.enc_n_layers  # type: ignore[attr-defined]
    for plan in (int8, int4):
        assert {k: v for k, v in plan.items() if k != "vision"} == {
            k: v for k, v in exact.items() if k != "vision"
        }
    assert plans["int8"].vision_weights == "int8"
    # With the decoder quantized too, each part takes its own format.
    both = plan_memory(shape, EngineConfig(vision_weights="int8"), 80 << 30, "int4").weights
    assert both["vision"] == int8["vision"]
    assert both["text"] == plan_memory(shape, EngineConfig(), 80 << 30, "int4").weights["text"]


def test_vlm_plan_takes_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "--gpu", "H100", "--model", "md2", "--json"]
    assert cli_main(base) == 0
    exact = json.loads(capsys.readouterr().out)
    assert cli_main([*base, "--vision-weights", "int8"]) == 0
    int8 = json.loads(capsys.readouterr().out)
    assert int8["vision_weights"] == "int8" and exact["vision_weights"] == "exact"
    saved = exact["weights"]["vision"] - int8["weights"]["vision"]
    assert saved > 0 and int8["weight_bytes"] == exact["weight_bytes"] - saved
    assert cli_main([*base[:-1], "--vision-weights", "int4"]) == 0
    assert "weights: vision" in (out := capsys.readouterr().out) and "int4 linears" in out
