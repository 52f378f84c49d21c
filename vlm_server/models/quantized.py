"""Quantized checkpoints of any family (docs/quantization.md): `quantize_checkpoint` writes
one ahead from any checkpoint the families read (``vlm quantize``), `load_quantized` reads
one back, checked against the model its config describes."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vlm_server.models.checkpoint_io import CheckpointError
from vlm_server.models.quant.files import (
    SHARD_BYTES,
    QuantizedFile,
    check_quantized,
    metadata_for,
    quantize_state,
    read_quantized,
    write_quantized,
)
from vlm_server.models.quant.formats import GROUP_SIZE, weight_format
from vlm_server.models.registry import CONFIG_FILE, checkpoint_config, family_of

# Files of a source checkpoint that hold weights (everything else, config and tokenizer
# included, is copied as it is).
_WEIGHT_SUFFIXES = (".safetensors", ".pt", ".bin")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


@dataclass
class QuantizeReport:
    """What `quantize_checkpoint` did."""

    family: str
    weights: str
    quantized: list[str]
    kept: dict[str, str] = field(default_factory=dict)  # target left in bf16 -> why
    bytes_before: int = 0  # every tensor in bf16
    bytes_after: int = 0
    files: list[Path] = field(default_factory=list)


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def quantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    weights: str,
    *,
    vision: bool = False,
    group_size: int = GROUP_SIZE,
    preset_name: str | None = None,
    shard_bytes: int = SHARD_BYTES,
) -> QuantizeReport:
    """Quantize the checkpoint directory ``src`` into the new directory ``dst``: the family's
    targets (the vision tower's too when ``vision``) in ``weights`` (int8 or int4), the
    other tensors in bf16, the non-weight files copied. An INT4 target whose input columns
    are not a multiple of the group stays bf16 (listed in the report's ``kept``)."""
    source, out = Path(src), Path(dst)
    fmt = weight_format(weights, group_size)
    if not source.is_dir():
        raise CheckpointError(f"{source} is not a checkpoint directory")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} exists and is not an empty directory")
    fam = family_of(checkpoint_config(source, preset_name))
    config, state = fam.read_state(source, preset_name)
    targets, kept = [], {}
    for name in fam.quant_targets(config, vision):
        columns = state[name].shape[-1]
        if fmt.group_size and columns % fmt.group_size:
            kept[name] = f"{columns} input columns are not a multiple of {fmt.group_size}"
        else:
            targets.append(name)
    tensors = quantize_state(state, targets, fmt)
    extra = {"family": fam.name}
    config_file = source / CONFIG_FILE
    if config_file.exists():
        extra["config"] = json.dumps(json.loads(config_file.read_text()), separators=(",", ":"))
    out.mkdir(parents=True, exist_ok=True)
    for item in sorted(source.iterdir()):
        if item.is_file() and not (item.suffix in _WEIGHT_SUFFIXES or item.name in _WEIGHT_INDEXES):
            shutil.copy2(item, out / item.name)
    files = write_quantized(tensors, out, metadata_for(fmt, targets, extra), shard_bytes)
    return QuantizeReport(
        family=fam.name,
        weights=fmt.name,
        quantized=targets,
        kept=kept,
        bytes_before=_nbytes(state),
        bytes_after=_nbytes(tensors),
        files=files,
    )


def load_quantized(path: str | Path, preset_name: str | None = None) -> QuantizedFile:
    """The tensors of a quantized checkpoint directory (its file names: ``.qweight`` and
    ``.scale`` for the quantized weights), checked against its format and the model its
    config.json describes; any mismatch is one `CheckpointError` naming tensors and shapes."""
    directory = Path(path)
    config = checkpoint_config(directory, preset_name)
    file = read_quantized(directory)
    check_quantized(file, family_of(config).expected_shapes(config), str(directory))
    return file
