"""Quantized checkpoints (docs/quantization.md): ``vlm quantize`` on the tiny checkpoints of
both families, the file layout, reading them back, and the refusal of mismatched files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from vlm_server.cli import main
from vlm_server.models.checkpoint_io import CheckpointError
from vlm_server.models.quant.files import dequantize_state
from vlm_server.models.quant.formats import dequantize_int4
from vlm_server.models.quantized import load_quantized, quantize_checkpoint
from vlm_server.models.registry import family, preset, write_checkpoint


@pytest.fixture(scope="module")
def md3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Moondream 3's tiny model in the md3 layout: FP8 experts with row scales."""
    out = tmp_path_factory.mktemp("md3")
    return write_checkpoint(preset("moondream3-tiny"), out, layout="md3", progress=False)


def _metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return f.metadata()


def test_vlm_quantize_int8_writes_the_layout_and_reads_back(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dst = tmp_path / "int8"
    assert main(["quantize", str(tiny_dir), str(dst), "--weights", "int8"]) == 0
    printed = capsys.readouterr().out
    assert "moondream2: 8 weights in int8" in printed and "text.blocks.1.mlp.fc2.weight" in printed
    assert sorted(p.name for p in dst.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert (dst / "config.json").read_text() == (tiny_dir / "config.json").read_text()
    meta = _metadata(dst)
    assert (meta["quantization"], meta["format_version"], meta["family"]) == (
        "int8",
        "1",
        "moondream2",
    )
    assert json.loads(meta["config"]) == json.loads((tiny_dir / "config.json").read_text())
    tensors = load_file(str(dst / "model.safetensors"))
    q, s = (
        tensors["text.blocks.0.attn.qkv.weight.qweight"],
        tensors["text.blocks.0.attn.qkv.weight.scale"],
    )
    assert (q.dtype, tuple(q.shape), s.dtype, tuple(s.shape)) == (
        torch.int8,
        (192, 64),
        torch.bfloat16,
        (192,),
    )
    assert "text.blocks.0.attn.qkv.weight" not in tensors
    assert tensors["text.blocks.0.attn.qkv.bias"].dtype == torch.bfloat16  # biases stay
    assert "text.wte" in tensors and "vision.blocks.0.attn.qkv.weight" in tensors  # not asked

    source = load_file(str(tiny_dir / "model.safetensors"))
    want = family("moondream2").expected_shapes(preset("tiny"))
    state = dequantize_state(load_quantized(dst), torch.float32)
    assert {k: tuple(v.shape) for k, v in state.items()} == want
    err = (
        state["text.blocks.0.attn.qkv.weight"].float()
        - source["model.text.blocks.0.attn.qkv.weight"].float()
    ).abs()
    assert (err <= s.float()[:, None] / 2 * 1.01).all()
    assert torch.equal(state["text.wte"], source["model.text.wte"])


def test_int4_keeps_weights_off_the_group_in_bf16_and_says_so(
    tiny_dir: Path, tmp_path: Path
) -> None:
    report = quantize_checkpoint(tiny_dir, tmp_path / "int4", "int4", vision=True)
    # The tiny model's width is 64: only the MLPs' fc2 (256 and 128 columns) take groups of 128.
    assert report.quantized == [
        "vision.blocks.0.mlp.fc2.weight",
        "vision.blocks.1.mlp.fc2.weight",
        "text.blocks.0.mlp.fc2.weight",
        "text.blocks.1.mlp.fc2.weight",
    ]
    assert report.kept["text.blocks.0.attn.qkv.weight"] == (
        "64 input columns are not a multiple of 128"
    )
    file = load_quantized(tmp_path / "int4")
    assert file.fmt.group_size == 128 and file.metadata["quantized"].count(",") == 3
    assert tuple(file.tensors["text.blocks.0.mlp.fc2.weight.scale"].shape) == (64, 2)


def test_md3_fp8_experts_quantize_to_int4(md3_dir: Path, tmp_path: Path) -> None:
    dst = tmp_path / "md3-int4"
    report = quantize_checkpoint(md3_dir, dst, "int4", group_size=32)
    assert report.family == "moondream3" and len(report.quantized) == 16
    assert not report.kept and report.bytes_after < report.bytes_before
    file = load_quantized(dst)
    q = file.tensors["text.blocks.2.mlp.fc1.weight.qweight"]  # 8 experts [64, 64]
    s = file.tensors["text.blocks.2.mlp.fc1.weight.scale"]
    assert (q.dtype, tuple(q.shape), tuple(s.shape)) == (torch.uint8, (8, 64, 32), (8, 64, 2))
    assert "text.blocks.2.mlp.router.weight" in file.tensors  # routers stay bf16
    cfg = preset("moondream3-tiny")
    fam = family("moondream3")
    _, source = fam.read_state(md3_dir, None)  # the FP8 experts, widened to bf16
    state = dequantize_state(file)
    assert {k: tuple(v.shape) for k, v in state.items()} == fam.expected_shapes(cfg)
    back = dequantize_int4(q, s, 32, torch.float32)
    bound = s.float().repeat_interleave(32, dim=-1) / 2
    assert ((back - source["text.blocks.2.mlp.fc1.weight"].float()).abs() <= bound * 1.01).all()


def _rewrite(dst: Path, change: dict[str, torch.Tensor]) -> None:
    path = dst / "model.safetensors"
    meta = _metadata(dst)
    tensors = load_file(str(path)) | change
    save_file(tensors, str(path), metadata=meta)


def test_mismatched_files_are_refused_naming_the_tensor_and_shapes(
    tiny_dir: Path, tmp_path: Path
) -> None:
    dst = tmp_path / "bad"
    quantize_checkpoint(tiny_dir, dst, "int8")
    name = "text.blocks.1.attn.proj.weight"
    _rewrite(dst, {name + ".scale": torch.ones(32, dtype=torch.bfloat16)})
    with pytest.raises(CheckpointError, match=rf"{name}\.scale: shape \[32\].*implies \[64\]"):
        load_quantized(dst)
    _rewrite(
        dst,
        {
            name + ".scale": torch.ones(48, dtype=torch.bfloat16),
            name + ".qweight": torch.zeros(48, 64, dtype=torch.int8),
        },
    )
    with pytest.raises(
        CheckpointError, match=rf"{name}\.qweight: shape \[48, 64\] .*, the model's is \[64, 64\]"
    ):
        load_quantized(dst)


def test_unknown_versions_and_missing_scales_are_refused(tiny_dir: Path, tmp_path: Path) -> None:
    dst = tmp_path / "v2"
    quantize_checkpoint(tiny_dir, dst, "int8")
    path = dst / "model.safetensors"
    tensors = load_file(str(path))
    save_file(tensors, str(path), metadata=_metadata(dst) | {"format_version": "2"})
    with pytest.raises(CheckpointError, match="format_version '2'"):
        load_quantized(dst)
    tensors.pop("text.blocks.0.mlp.fc1.weight.scale")
    save_file(tensors, str(path), metadata=_metadata(dst) | {"format_version": "1"})
    with pytest.raises(
        CheckpointError, match=r"text\.blocks\.0\.mlp\.fc1\.weight: \.scale is missing"
    ):
        load_quantized(dst)


def test_vlm_quantize_refuses_bad_sources_and_destinations(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(["quantize", str(tmp_path / "none"), str(tmp_path / "out"), "--weights", "int8"]) == 1
    )
    assert "is not a checkpoint directory" in capsys.readouterr().err
    assert main(["quantize", str(tiny_dir), str(tiny_dir), "--weights", "int4"]) == 1
    assert "is not an empty directory" in capsys.readouterr().err


def test_large_outputs_are_sharded_with_an_index(tiny_dir: Path, tmp_path: Path) -> None:
    dst = tmp_path / "shards"
    report = quantize_checkpoint(tiny_dir, dst, "int8", shard_bytes=400_000)
    assert len(report.files) > 1 and (dst / "model.safetensors.index.json").exists()
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert index["metadata"]["quantization"] == "int8"
    assert set(index["weight_map"].values()) == {p.name for p in report.files}
    file = load_quantized(dst)
    assert file.quantized == sorted(report.quantized)
