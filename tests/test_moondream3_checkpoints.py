"""Moondream 3 checkpoints: both layouts load to the same model, FP8 experts dequantize
exactly, every mismatch is named with its shapes, and the full-size layouts have the counts
docs/moondream3.md gives (built on the meta device: no memory)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vlm_server.models import registry
from vlm_server.models.checkpoint_io import CheckpointError
from vlm_server.models.moondream3 import fp8_experts
from vlm_server.models.moondream3.config import ModelConfig, MoeConfig
from vlm_server.models.moondream3.layout import (
    HF_PREFIX,
    expected_shapes,
    md3_to_native,
    native_to_md3,
)
from vlm_server.models.moondream3.writer import INDEX_FILE, PT_FILE, WEIGHTS_FILE


def _tiny() -> ModelConfig:
    return registry.preset("md3-tiny")  # type: ignore[return-value]


def _state(path: Path) -> dict[str, torch.Tensor]:
    return registry.load_model(path, dtype=torch.float32, progress=False).model.state_dict()


@pytest.fixture(scope="module")
def reference_state() -> dict[str, torch.Tensor]:
    loaded = registry.random_model(_tiny(), seed=3, dtype=torch.float32, progress=False)
    return loaded.model.state_dict()


def test_the_sharded_hf_layout_loads_to_the_random_model(
    tmp_path: Path, reference_state: dict[str, torch.Tensor]
) -> None:
    out = registry.write_checkpoint(_tiny(), tmp_path, seed=3, layout="hf", shards=3)
    assert (out / INDEX_FILE).exists() and len(list(out.glob("model-*.safetensors"))) == 3
    state = _state(out)
    assert state.keys() == reference_state.keys()
    assert all(torch.equal(state[k], reference_state[k]) for k in state)


@pytest.mark.parametrize(
    ("file_format", "fuse_tau"), [("safetensors", False), ("pt", True), ("pt", False)]
)
def test_the_md3_layout_loads_to_the_random_model_up_to_fp8_experts(
    tmp_path: Path, reference_state: dict[str, torch.Tensor], file_format: str, fuse_tau: bool
) -> None:
    out = registry.write_checkpoint(
        _tiny(), tmp_path, seed=3, layout="md3", file_format=file_format, fuse_tau=fuse_tau
    )
    weights = out / (PT_FILE if file_format == "pt" else WEIGHTS_FILE)
    raw = torch.load(weights) if file_format == "pt" else load_file(weights)
    assert any(k.endswith(".tau_wqwv") for k in raw) is fuse_tau
    state = _state(out)
    assert state.keys() == reference_state.keys()
    for key, want in reference_state.items():
        if want.dim() == 3 and ".mlp.fc" in key:
            layer, up = key.split(".")[2], key.endswith("fc1.weight")
            prefix = f"text_model.transformer.h.{layer}."
            q = raw[prefix + ("mlp.experts.weight" if up else "mlp.output_experts.weight")]
            s = raw[prefix + ("moe_quant.up_scale" if up else "moe_quant.down_scale")]
            assert q.dtype == torch.float8_e4m3fn and s.shape == q.shape[:2]
            assert torch.equal(state[key], q.float() * s[..., None])  # exactly q * s
            assert (state[key] - want).abs().max() <= want.abs().max() / 8  # FP8 is close
        else:
            assert torch.equal(state[key], want), key


def test_fp8_round_trip_is_exact_on_representable_values() -> None:
    w = torch.randn(4, 6, 16)
    q, s = fp8_experts.quantize(w)
    again = fp8_experts.dequantize(q, s, torch.float32)
    q2, s2 = fp8_experts.quantize(again)
    assert torch.equal(fp8_experts.dequantize(q2, s2, torch.float32), again)


def test_md3_and_hf_key_maps_are_inverse_except_for_the_expert_tensors() -> None:
    for key in expected_shapes(_tiny()):
        if ".mlp.fc" in key and key.split(".")[2] in ("2", "3"):
            continue  # expert matrices are renamed with their scales (writer, loader)
        assert md3_to_native(native_to_md3(key)) == key, key


def test_a_mismatched_tensor_is_refused_with_its_name_and_shapes(tmp_path: Path) -> None:
    out = registry.write_checkpoint(_tiny(), tmp_path, layout="md3")
    tensors = load_file(out / WEIGHTS_FILE)
    key = "text_model.transformer.h.2.mlp.experts.weight"
    tensors[key] = tensors[key][:, :-2].contiguous()
    del tensors["text_model.transformer.h.3.moe_quant.down_scale"]
    tensors["text_model.transformer.h.9.bogus"] = torch.zeros(1)
    save_file(tensors, str(out / WEIGHTS_FILE))
    with pytest.raises(CheckpointError) as err:
        registry.load_model(out, progress=False)
    text = str(err.value)
    assert "wrong shape 1: text.blocks.2.mlp.fc1.weight [8, 62, 64] (expected [8, 64, 64])" in text
    assert "missing 1: text_model.transformer.h.3.moe_quant.down_scale" in text
    assert "unexpected 1: text_model.transformer.h.9.bogus" in text


def test_a_config_unlike_the_named_preset_is_refused(tmp_path: Path) -> None:
    other = dataclasses.replace(_tiny().text, n_layers=5)
    out = registry.write_checkpoint(dataclasses.replace(_tiny(), text=other), tmp_path)
    with pytest.raises(CheckpointError, match="differs from the requested preset 'md3-tiny'"):
        registry.load_model(out, preset_name="md3-tiny", progress=False)


def test_a_dense_checkpoint_for_an_expert_layer_is_refused(tmp_path: Path) -> None:
    dense = dataclasses.replace(
        _tiny().text, moe=MoeConfig(start_layer=3, n_experts=8, top_k=3, expert_dim=32)
    )
    out = registry.write_checkpoint(dataclasses.replace(_tiny(), text=dense), tmp_path)
    (out / "config.json").unlink()  # a bare snapshot: the preset says what to expect
    with pytest.raises(CheckpointError, match=r"text.blocks.2.mlp.fc1.weight \[256, 64\]"):
        registry.load_model(out, preset_name="md3-tiny", progress=False)


def test_a_hub_snapshot_without_region_ln_needs_the_choice_that_has_none(tmp_path: Path) -> None:
    out = registry.write_checkpoint(_tiny(), tmp_path, layout="hf", shards=1)
    shard = next(out.glob("model-*.safetensors"))
    tensors = {k: v for k, v in load_file(shard).items() if ".region.ln." not in k}
    save_file(tensors, str(shard))
    with pytest.raises(CheckpointError, match=r"missing 2: region.ln.bias, region.ln.weight"):
        registry.load_model(out, progress=False)


def test_full_size_layouts_have_the_specified_counts() -> None:
    for name in ("moondream3-preview", "moondream3.1"):
        shapes = expected_shapes(registry.preset(name))  # type: ignore[arg-type]
        assert len(shapes) == 662
        assert sum(torch.Size(s).numel() for s in shapes.values()) == 9_268_626_928
        experts = {k for k, shape in shapes.items() if ".mlp.fc" in k and len(shape) == 3}
        md3_keys = {native_to_md3(k) for k in set(shapes) - experts}
        # Expert matrices (2 per expert layer) come with 2 scales each: 702 in all.
        assert len(md3_keys) + 4 * 20 == 702
        assert shapes["text.blocks.4.mlp.fc1.weight"] == (64, 2048, 2048)
        assert shapes["text.blocks.23.mlp.fc2.weight"] == (64, 2048, 1024)
        assert shapes["text.blocks.3.mlp.fc1.weight"] == (8192, 2048)
        assert all(k.startswith(("vision.", "text.", "region.")) for k in shapes)
    assert HF_PREFIX == "model."


def test_the_command_line_writes_both_layouts(tmp_path: Path) -> None:
    from vlm_server.cli import main as cli_main

    for layout in ("native", "legacy"):
        out = tmp_path / layout
        assert (
            cli_main(["make-checkpoint", str(out), "--preset", "md3-tiny", "--layout", layout]) == 0
        )
        assert (out / (INDEX_FILE if layout == "native" else WEIGHTS_FILE)).exists()
        assert type(registry.load_model(out, progress=False).model).__name__ == "Moondream3Model"


def test_fp8_experts_stay_fp8_where_the_fused_kernels_read_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vlm_server.models.moondream3 import loader

    out = registry.write_checkpoint(_tiny(), tmp_path, layout="md3")
    plain = registry.load_model(out, dtype=torch.float32, progress=False).model
    monkeypatch.setattr(loader, "fused_fp8", lambda device: True)
    kept = registry.load_model(out, dtype=torch.float32, progress=False).model
    bank = kept.text.blocks[2].mlp.fc1
    assert bank.weight.dtype == torch.float8_e4m3fn and bank.scale is not None
    assert torch.equal(bank.values(torch.float32), plain.text.blocks[2].mlp.fc1.weight)
    x = torch.randn(1, 5, 64)
    assert torch.equal(kept.text.blocks[3].mlp(x), plain.text.blocks[3].mlp(x))


def test_a_hub_snapshot_is_read_as_moondream3_and_loaded_with_its_preset(tmp_path: Path) -> None:
    import json

    from vlm_server.models.moondream3.family import FAMILY as MOONDREAM3

    out = registry.write_checkpoint(_tiny(), tmp_path, layout="hf")
    hub = {"model_type": "moondream3", "config": {"text": {"moe": {"n_experts": 64}}}}
    (out / "config.json").write_text(json.dumps(hub))
    assert MOONDREAM3.reads(hub) and MOONDREAM3.reads({"text": {"moe": {}}})
    assert not MOONDREAM3.reads({"format": "moondream-serve/1", "family": "moondream2"})
    assert not MOONDREAM3.reads({"model_type": "moondream1"})
    loaded = registry.load_model(out, preset_name="md3-tiny", progress=False)
    assert loaded.config.name == "md3-tiny"
    # Without a preset the full-size preview is assumed, and the tiny weights do not fit it.
    with pytest.raises(CheckpointError, match=r"missing \d+: .*attn.tau.alpha"):
        registry.load_model(out, progress=False)
