"""Serving 8- and 4-bit weights (docs/quantization.md) on the CPU, on the tiny models: the
batched engine over a quantized model answers token for token as the reference over its
16-bit twin (the checkpoint with each quantized weight replaced by the values it stands
for), whether quantized at load or read from a ``vlm quantize`` directory; nothing 16-bit of
a quantized weight stays in the model; the refusals name their flag.

Off CUDA the quantized layers widen each weight for the product (dequantize, then the plain
product), so the products equal the twin's exactly and so do the answers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from image_pipeline import PreparedImage
from tests.support.quant_reference import assert_answers_as, dequantized_twin, twin_requests
from tests.support.threads import one_torch_thread  # noqa: F401  (autouse)
from tests.test_engine import _finish_all, _reference_text, images  # noqa: F401  (fixtures)
from vlm_server.cli import main as cli_main
from vlm_server.engine.api import GenerationRequest, Task
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.memory_plan import WEIGHT_FORMATS, plan_memory
from vlm_server.models import capabilities
from vlm_server.models.capabilities import CapabilityError
from vlm_server.models.checkpoint_io import CheckpointError
from vlm_server.models.common import quant_gemm, quant_plan
from vlm_server.models.common.quant_linear import QuantLinear
from vlm_server.models.interface import Formats, LoadedModel
from vlm_server.models.lora.writer import write_random
from vlm_server.models.quantized import quantize_checkpoint
from vlm_server.models.registry import (
    family,
    load_model,
    memory_shape,
    preset,
)
from vlm_server.options.table import ServerConfig
from vlm_server.reference import ReferenceGenerator

F32 = torch.float32
# How each case's quantized model is made: quantized at load (``weights``, INT4 in groups of
# 32: the tiny model's widths are 64), or a vlm quantize directory (``file``).
CASES: dict[str, dict] = {
    "int8-at-load": {"weights": "int8"},
    "int4-at-load": {"weights": "int4", "group_size": 32},
    "int8-file": {"file": ("int8", 128, False)},
    "int4-file": {"file": ("int4", 32, False)},
    "int8-file-vision": {"file": ("int8", 128, True)},
}


@pytest.fixture(scope="module")
def files(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple, Path]:
    """The tiny checkpoint written by vlm quantize in each format a case reads."""
    out = {}
    for case in CASES.values():
        if "file" in case:
            weights, group, vision = key = case["file"]
            dst = tmp_path_factory.mktemp(f"{weights}-{group}-{vision}")
            quantize_checkpoint(tiny_dir, dst, weights, vision=vision, group_size=group)
            out[key] = dst
    return out


def _load(case: str, tiny_dir: Path, files: dict[tuple, Path]) -> LoadedModel:
    how = CASES[case]
    if "file" in how:
        return load_model(files[how["file"]], dtype=F32, progress=False)
    return load_model(tiny_dir, dtype=F32, progress=False, **how)


def _requests(images: list[PreparedImage]) -> list[GenerationRequest]:  # noqa: F811
    return twin_requests(images)


_assert_answers_as = assert_answers_as


@pytest.mark.parametrize("case", list(CASES))
def test_the_engine_answers_as_the_dequantized_model(
    case: str,
    tiny: LoadedModel,
    tiny_dir: Path,
    files: dict[tuple, Path],
    images: list[PreparedImage],  # noqa: F811
) -> None:
    loaded = _load(case, tiny_dir, files)
    held = loaded.model.capabilities.quantized
    assert held is not None and held.format == case[:4] and not held.kept
    assert len(held.weights) == (16 if "vision" in case else 8)  # every decoder block linear
    twin = dequantized_twin(loaded, tiny)
    name = "text.blocks.1.mlp.fc1.weight"
    original, served = tiny.model.get_parameter(name), twin.model.get_parameter(name)
    assert not torch.equal(original, served)  # the format did round the weights
    reqs = _requests(images)
    budget = "chunked" if case == "int4-file" else "default"
    depth = 1 if case == "int8-at-load" else 2
    done = _finish_all(loaded, reqs, depth, budget=budget, max_batch_size=4)
    _assert_answers_as(twin, reqs, done)


def test_a_file_holds_what_quantizing_at_load_gives(
    tiny_dir: Path, files: dict[tuple, Path]
) -> None:
    at_load = _load("int4-at-load", tiny_dir, files).model.state_dict()
    stored = _load("int4-file", tiny_dir, files).model.state_dict()
    assert at_load.keys() == stored.keys()
    assert all(torch.equal(at_load[k], stored[k]) for k in at_load)


@pytest.mark.parametrize("case", ["int8-at-load", "int4-file", "int8-file-vision"])
def test_no_16_bit_copy_of_a_quantized_weight_stays(
    case: str, tiny_dir: Path, files: dict[tuple, Path]
) -> None:
    model = _load(case, tiny_dir, files).model
    held = model.capabilities.quantized
    assert held is not None
    state = model.state_dict()
    shapes = family("moondream2").expected_shapes(preset("tiny"))
    for name in held.weights:
        layer = name.removesuffix(".weight")
        assert name not in state
        assert isinstance(model.get_submodule(layer), QuantLinear)
        assert state[layer + ".qweight"].dtype in (torch.int8, torch.uint8)
        assert state[layer + ".scale"].dtype == torch.bfloat16
        members = [k for k in state if k.startswith(layer + ".")]
        assert sorted(members) == [layer + s for s in (".bias", ".qweight", ".scale")]
    # The parameters are exactly the tensors left unquantized; the buffers are the stored
    # values and scales and the rotary tables (not part of the state).
    left = sum(math.prod(s) for n, s in shapes.items() if n not in held.weights)
    assert sum(p.numel() for p in model.parameters()) == left
    buffers = {n.rpartition(".")[2] for n, _ in model.named_buffers()}
    assert buffers == {"qweight", "scale", "rope_cos", "rope_sin"}


def test_capabilities_of_quantized_weights(tiny_dir: Path, files: dict[tuple, Path]) -> None:
    """The fused decode products stack quantized weights too (CUDA only: off here); the FP8
    tower quantizes 16-bit weights: refused when the tower is quantized."""
    text_only = _load("int8-at-load", tiny_dir, files)
    caps = text_only.model.capabilities
    assert caps.fused_products is not None and caps.fp8_vision is not None
    assert not caps.fused_products.use_fused_products(True)
    capabilities.check(text_only.model, {"vision_fp8": True, "fused_decode": True})
    vision = _load("int8-file-vision", tiny_dir, files)
    with pytest.raises(CapabilityError, match="--vision-fp8: the model 'tiny' has no FP8"):
        capabilities.check(vision.model, {"vision_fp8": True})


def test_an_adapter_on_quantized_weights(
    tiny: LoadedModel,
    tiny_dir: Path,
    files: dict[tuple, Path],
    images: list[PreparedImage],  # noqa: F811
    tmp_path: Path,
) -> None:
    """Adapters keep working on quantized layers (their deltas are 16-bit)."""
    from vlm_server.models.lora import files as lora_files

    loaded = _load("int4-at-load", tiny_dir, files)
    targets = loaded.model.text.lora_targets
    write_random(tmp_path, "alpha", targets, rank=4, seed=10, scale=0.3)
    reqs = [
        GenerationRequest(
            Task.QUERY, images[0], question="what?", temperature=0, max_tokens=16, adapter=a
        )
        for a in ("alpha", None)
    ]
    done = _finish_all(
        loaded, reqs, 2, max_batch_size=4, adapters_dir=str(tmp_path), max_adapter_rank=4
    )
    twin = dequantized_twin(loaded, tiny)
    path = lora_files.find(tmp_path, "alpha")
    assert path is not None
    adapter = lora_files.load(path, targets, 4, "alpha")
    with_adapter = ReferenceGenerator(twin.model, twin.tokenizer, adapter)
    plain = ReferenceGenerator(twin.model, twin.tokenizer)
    assert done[0].text == _reference_text(with_adapter, reqs[0])
    assert done[1].text == _reference_text(plain, reqs[1])
    assert done[0].text != done[1].text  # the adapter changed the answer


# ---- refusals -------------------------------------------------------------------------------


def test_a_file_is_served_as_it_is(files: dict[tuple, Path]) -> None:
    int4 = files[("int4", 32, False)]
    for asked in ("int8", "bf16"):
        with pytest.raises(CapabilityError, match=f"--weights {asked}: .* holds int4 weights"):
            load_model(int4, dtype=F32, progress=False, weights=asked)


def test_formats_a_family_does_not_serve(files: dict[tuple, Path]) -> None:
    plain_only = Formats(weights=("bf16",), kv=("bf16",))
    with pytest.raises(
        CapabilityError, match=r"^--weights int4: the toy family serves bf16 weights"
    ):
        quant_plan.request("toy", plain_only, None, "int4", 128, "cpu")
    stored = files[("int8", 128, False)]
    with pytest.raises(CapabilityError, match=r"^--model .*: it holds int8 weights, which the toy"):
        quant_plan.request("toy", plain_only, stored, None, 128, "cpu")
    assert quant_plan.request("toy", plain_only, None, "bf16", 128, "cpu") is None


def test_what_cuda_cannot_run_is_refused(
    files: dict[tuple, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    formats = family("moondream2").formats
    monkeypatch.setattr(quant_gemm, "AVAILABLE", False)
    with pytest.raises(CapabilityError, match=r"^--weights int8: .* Triton is not installed"):
        quant_plan.request("moondream2", formats, None, "int8", 128, "cuda")
    monkeypatch.setattr(quant_gemm, "AVAILABLE", True)
    with pytest.raises(CapabilityError, match=r"^--weights int4: INT4 groups of 32 columns"):
        quant_plan.request("moondream2", formats, None, "int4", 32, "cuda")
    with pytest.raises(CapabilityError, match=r"^--model: INT4 groups of 32 columns; the CUDA"):
        quant_plan.request("moondream2", formats, files[("int4", 32, False)], None, 128, "cuda")


def test_a_mismatched_file_names_the_tensor(files: dict[tuple, Path], tmp_path: Path) -> None:
    src = files[("int8", 128, False)]
    for item in src.iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    name = "text.blocks.1.attn.proj.weight.scale"
    tensors[name] = tensors[name][:32].contiguous()
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(CheckpointError, match=f"{name}: shape \\[32\\], the format implies"):
        load_model(tmp_path, dtype=F32, progress=False)


def test_the_option_names_its_field() -> None:
    with pytest.raises(ValueError, match=r"^weights must be one of auto, bf16, int8, int4, fp8"):
        ServerConfig(weights="int3")


def test_vlm_run_takes_the_flag(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["run", "caption", "sample", "--max-tokens", "6", "--json", "--model", str(tiny_dir)]
    assert cli_main([*base, "--weights", "int4"]) == 0  # groups of 128: the tiny fc2s only
    assert json.loads(capsys.readouterr().out)["finish_reason"]
    with pytest.raises(SystemExit):
        cli_main([*base, "--weights", "int2"])
    assert "--weights must be one of auto, bf16, int8, int4, fp8" in capsys.readouterr().err


# ---- the memory plan ------------------------------------------------------------------------


def test_the_plan_holds_the_decoder_linears_in_their_bits() -> None:
    config = preset("moondream2")
    shape = memory_shape(config)
    shapes = family("moondream2").expected_shapes(config)
    targets = family("moondream2").quant_targets(config, vision=False)
    params = sum(math.prod(shapes[n]) for n in targets)
    rows = sum(shapes[n][0] for n in targets)
    assert (shape.linear_params, shape.linear_rows) == (params, rows)
    cfg = EngineConfig()
    bf16 = plan_memory(shape, cfg, 24 << 30, "bf16").weights
    rest = 2 * (shape.params["text"] - params)
    int8 = plan_memory(shape, cfg, 24 << 30, "int8").weights
    int4 = plan_memory(shape, cfg, 24 << 30, "int4").weights
    assert int8["text"] == rest + params + 2 * rows  # a byte a weight, a bf16 scale a row
    assert int4["text"] == rest + params // 2 + 2 * (params // 128)  # a scale per group
    for plan in (int8, int4):
        assert {k: v for k, v in plan.items() if k != "text"} == {
            k: v for k, v in bf16.items() if k != "text"
        }
    # moondream2's decoder: 24 blocks of 50.3M weights, 0.516 bytes each in INT4.
    assert params == 24 * 2048 * (3 * 2048 + 2048 + 2 * 8192)
    assert WEIGHT_FORMATS["int4"].group_size == quant_gemm.GROUP


def test_vlm_plan_takes_int4(
    files: dict[tuple, Path], tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["plan", "--gpu", "H100", "--model", "md2", "--weights", "int4"]) == 0
    out = capsys.readouterr().out
    assert "weights: text" in out and "int4 linears, the rest bf16" in out
    # A vlm quantize directory is planned in its own format, any other in bf16.
    for model, want in ((files[("int8", 128, False)], "int8"), (tiny_dir, "bf16")):
        assert cli_main(["plan", "--gpu", "H100", "--model", str(model), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["weights_format"] == want
