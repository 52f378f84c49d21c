"""Checkpoint writing and loading: layouts, validation, dtypes, offline hub resolution."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.hub_cache import hub_snapshot, run_offline
from vlm_server.models.checkpoint_io import CheckpointError
from vlm_server.models.common.legacy_layout import native_to_legacy
from vlm_server.models.interface import LoadedModel
from vlm_server.models.moondream2.layout import expected_shapes
from vlm_server.models.registry import load_model, preset, write_checkpoint


def _same_weights(a: LoadedModel, b: LoadedModel) -> bool:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_written_checkpoint_has_native_keys_with_prefix(tiny_dir: Path) -> None:
    state = load_file(str(tiny_dir / "model.safetensors"))
    expected = expected_shapes(preset("tiny"))
    assert {k.removeprefix("model.") for k in state} == set(expected)
    assert all(k.startswith("model.") for k in state)
    assert all(v.dtype == torch.bfloat16 for v in state.values())
    assert all(tuple(state["model." + k].shape) == s for k, s in expected.items())


def test_writer_is_deterministic_per_seed(tmp_path: Path) -> None:
    a = load_file(
        str(
            write_checkpoint(preset("tiny"), tmp_path / "a", seed=3, progress=False)
            / "model.safetensors"
        )
    )
    b = load_file(
        str(
            write_checkpoint(preset("tiny"), tmp_path / "b", seed=3, progress=False)
            / "model.safetensors"
        )
    )
    c = load_file(
        str(
            write_checkpoint(preset("tiny"), tmp_path / "c", seed=4, progress=False)
            / "model.safetensors"
        )
    )
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.text.wte"], c["model.text.wte"])


@pytest.mark.parametrize(("layout", "prefix"), [("native", False), ("legacy", True)])
def test_layouts_round_trip_to_the_same_model(
    tmp_path: Path, tiny: LoadedModel, layout: str, prefix: bool
) -> None:
    out = write_checkpoint(
        preset("tiny"), tmp_path, seed=0, layout=layout, prefix=prefix, progress=False
    )
    other = load_model(out, dtype=torch.float32, progress=False)
    assert _same_weights(tiny, other)


def test_legacy_layout_transposes_fourier_features(tmp_path: Path) -> None:
    out = write_checkpoint(preset("tiny"), tmp_path, layout="legacy", progress=False)
    state = load_file(str(out / "model.safetensors"))
    cfg = preset("tiny").region
    assert state["region_model.coordinate_features.weight"].shape == (cfg.coord_feat_dim // 2, 1)
    assert state["region_model.size_features.weight"].shape == (cfg.size_feat_dim // 2, 2)
    assert "text_model.transformer.h.0.mixer.Wqkv.weight" in state


def test_legacy_torch_file_with_orig_mod_names(tmp_path: Path, tiny: LoadedModel) -> None:
    native = tiny.model.state_dict()
    legacy = {}
    for key, value in native.items():
        name = native_to_legacy(key).replace("text_model.", "text_model._orig_mod.")
        legacy[name] = value.T if key.endswith("_features") else value
    (tmp_path / "ckpt").mkdir()
    torch.save(legacy, tmp_path / "ckpt" / "model.pt")
    with pytest.raises(CheckpointError, match="no tokenizer"):
        load_model(tmp_path / "ckpt" / "model.pt", preset_name="tiny", progress=False)
    (tmp_path / "ckpt" / "tokenizer.json").write_bytes(
        (Path(tiny.source) / "tokenizer.json").read_bytes()
    )
    other = load_model(
        tmp_path / "ckpt" / "model.pt", preset_name="tiny", dtype=torch.float32, progress=False
    )
    assert _same_weights(tiny, other)


def test_single_safetensors_file_needs_a_preset(tmp_path: Path, tiny_dir: Path) -> None:
    weights = tmp_path / "weights.safetensors"
    weights.write_bytes((tiny_dir / "model.safetensors").read_bytes())
    (tmp_path / "tokenizer.json").write_bytes((tiny_dir / "tokenizer.json").read_bytes())
    with pytest.raises(CheckpointError, match="preset"):
        load_model(weights, progress=False)
    loaded = load_model(weights, preset_name="tiny", progress=False)
    assert loaded.model.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_loads_into_each_dtype(tiny_dir: Path, dtype: torch.dtype) -> None:
    loaded = load_model(tiny_dir, dtype=dtype, progress=False)
    assert all(p.dtype == dtype for p in loaded.model.parameters())
    assert loaded.model.text.rope_cos.dtype == torch.float32  # rotary math stays in fp32
    assert not any(p.requires_grad for p in loaded.model.parameters())


def _rewrite(tiny_dir: Path, out: Path, edit) -> Path:
    out.mkdir()
    state = load_file(str(tiny_dir / "model.safetensors"))
    edit(state)
    save_file(state, str(out / "model.safetensors"))
    for name in ("tokenizer.json", "config.json"):
        (out / name).write_bytes((tiny_dir / name).read_bytes())
    return out


def test_missing_extra_and_misshaped_tensors_are_all_named(tmp_path: Path, tiny_dir: Path) -> None:
    def edit(state: dict) -> None:
        del state["model.text.blocks.1.attn.qkv.bias"]
        del state["model.region.size_features"]
        state["model.text.blocks.9.ln.weight"] = torch.zeros(3)
        state["model.text.lm_head.bias"] = torch.zeros(7)

    out = _rewrite(tiny_dir, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError) as info:
        load_model(out, progress=False)
    msg = str(info.value)
    for name in (
        "text.blocks.1.attn.qkv.bias",
        "region.size_features",
        "text.blocks.9.ln.weight",
        "text.lm_head.bias [7]",
    ):
        assert name in msg
    assert "missing 2" in msg and "unexpected 1" in msg and "wrong shape 1" in msg


def test_finetune_cache_tensors_are_ignored(tmp_path: Path, tiny_dir: Path) -> None:
    def edit(state: dict) -> None:
        state["model.text.blocks.0.kv_cache.k_cache"] = torch.zeros(1, 2)

    load_model(_rewrite(tiny_dir, tmp_path / "ft", edit), progress=False)


def test_unreadable_inputs_give_checkpoint_errors(tmp_path: Path, tiny_dir: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    (broken / "tokenizer.json").write_bytes((tiny_dir / "tokenizer.json").read_bytes())
    (broken / "config.json").write_bytes((tiny_dir / "config.json").read_bytes())
    with pytest.raises(CheckpointError, match="cannot read"):
        load_model(broken, progress=False)
    with pytest.raises(CheckpointError, match="neither an existing path"):
        load_model(str(tmp_path / "does" / "not" / "exist"), progress=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_bytes((tiny_dir / "config.json").read_bytes())
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        load_model(empty, progress=False)


def test_config_mismatch_with_requested_preset(tiny_dir: Path) -> None:
    with pytest.raises(CheckpointError, match="differs"):
        load_model(tiny_dir, preset_name="tiny-gpt2", progress=False)


def test_hf_snapshot_config_selects_the_preset(tmp_path: Path, tiny_dir: Path) -> None:
    snap = tmp_path / "snap"
    snap.mkdir()
    for name in ("model.safetensors", "tokenizer.json"):
        (snap / name).write_bytes((tiny_dir / name).read_bytes())
    (snap / "config.json").write_text(json.dumps({"model_type": "moondream1", "config": {}}))
    # A moondream snapshot's config carries no shapes: the preset decides (here: wrong size).
    with pytest.raises(CheckpointError, match="wrong shape"):
        load_model(snap, progress=False)
    assert load_model(snap, preset_name="tiny", progress=False).config.name == "tiny"


def test_hub_repo_id_resolves_offline_from_a_local_snapshot(tmp_path: Path, tiny_dir: Path) -> None:
    pytest.importorskip("huggingface_hub")
    snap = hub_snapshot(tmp_path / "hub", "someone/tiny-moondream")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        (snap / name).write_bytes((tiny_dir / name).read_bytes())
    code = (
        "from vlm_server.models.moondream2.loader import load_model\n"
        "from vlm_server.models.checkpoint_io import CheckpointError\n"
        "m = load_model('someone/tiny-moondream', progress=False)\n"
        "print('loaded', m.config.name)\n"
        "try:\n"
        "    load_model('someone/not-cached', progress=False)\n"
        "except CheckpointError as e:\n"
        "    print('error', e)\n"
    )
    out = run_offline(code, tmp_path / "hub")
    assert out.returncode == 0, out.stderr
    assert "loaded tiny" in out.stdout
    assert "error could not fetch 'someone/not-cached'" in out.stdout
    assert "offline" in out.stdout.lower()


@pytest.mark.slow
def test_full_size_checkpoint_writes_and_loads(tmp_path: Path) -> None:
    """The moondream2 preset: 592 tensors, 1,927,237,104 parameters, through the real files."""
    out = write_checkpoint(preset("moondream2"), tmp_path, seed=0, progress=False)
    loaded = load_model(out, dtype=torch.bfloat16, progress=False)
    state = loaded.model.state_dict()
    assert len(state) == 592
    assert sum(t.numel() for t in state.values()) == 1_927_237_104
    assert loaded.tokenizer.get_vocab_size() == 51200
