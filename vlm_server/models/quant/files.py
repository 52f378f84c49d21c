"""Quantized safetensors files (docs/quantization.md): ``<name>.qweight`` and ``<name>.scale``
in place of each quantized weight ``<name>``, every other tensor as it was, and the format in
the file's metadata. One ``model.safetensors``, or shards with ``model.safetensors.index.json``.

Reading checks the metadata, that every ``.qweight`` has its ``.scale``, the shapes the format
implies, and the weight shapes the model expects: one error naming each tensor and both shapes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vlm_server.models.checkpoint_io import CheckpointError, check_shapes, indexed_files
from vlm_server.models.quant.formats import QuantError, QuantFormat, weight_format

FORMAT_VERSION = "1"
QWEIGHT, SCALE = ".qweight", ".scale"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_BYTES = 4 << 30  # one file up to this size, then shards


@dataclass
class QuantizedFile:
    """A quantized checkpoint's tensors (file names) and its format."""

    fmt: QuantFormat
    metadata: dict[str, str]
    tensors: dict[str, torch.Tensor]

    @property
    def quantized(self) -> list[str]:
        """The weights stored quantized (their names without the suffix)."""
        return sorted(k.removesuffix(QWEIGHT) for k in self.tensors if k.endswith(QWEIGHT))


def quantize_state(
    state: Mapping[str, torch.Tensor], targets: Iterable[str], fmt: QuantFormat
) -> dict[str, torch.Tensor]:
    """``state`` with each weight of ``targets`` replaced by its ``.qweight`` and ``.scale``."""
    chosen = set(targets)
    unknown = sorted(chosen - set(state))
    if unknown:
        raise QuantError(f"no such tensors to quantize: {unknown[:8]}")
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if name in chosen:
            q, s = fmt.quantize(name, value)
            out[name + QWEIGHT], out[name + SCALE] = q.contiguous(), s.contiguous()
        else:
            out[name] = value.contiguous()
    return out


def metadata_for(fmt: QuantFormat, quantized: list[str], extra: Mapping[str, str]) -> dict:
    """The safetensors metadata of a quantized file (every value a string)."""
    return {
        **extra,
        "quantization": fmt.name,
        "group_size": str(fmt.group_size),
        "format_version": FORMAT_VERSION,
        "quantized": ",".join(sorted(quantized)),
    }


def write_quantized(
    tensors: Mapping[str, torch.Tensor],
    out_dir: Path,
    metadata: Mapping[str, str],
    shard_bytes: int = SHARD_BYTES,
) -> list[Path]:
    """Write ``tensors`` as one ``model.safetensors``, or shards and their index when they
    pass ``shard_bytes``; every file carries ``metadata``. Returns the files written."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, value in tensors.items():
        nbytes = value.numel() * value.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    if len(shards) == 1:
        path = out_dir / WEIGHTS_FILE
        save_file(dict(tensors), str(path), metadata=dict(metadata))
        return [path]
    paths, weight_map = [], {}
    for i, names in enumerate(shards):
        path = out_dir / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(path), metadata=dict(metadata))
        weight_map |= dict.fromkeys(names, path.name)
        paths.append(path)
    index = {"metadata": dict(metadata), "weight_map": weight_map}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=1) + "\n")
    return paths


def quantized_files(path: Path) -> list[Path]:
    """The weights files of a quantized checkpoint directory (or the one file given)."""
    if path.is_file():
        return [path]
    index = path / INDEX_FILE
    if index.exists():
        return indexed_files(index)
    if (path / WEIGHTS_FILE).exists():
        return [path / WEIGHTS_FILE]
    raise CheckpointError(f"{path} holds no {INDEX_FILE} or {WEIGHTS_FILE}")


def _format_of(metadata: Mapping[str, str], source: Path) -> QuantFormat:
    version = metadata.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{source}: format_version {version!r} is not a known quantized layout "
            f"(this server reads {FORMAT_VERSION!r})"
        )
    name = metadata.get("quantization")
    try:
        return weight_format(str(name), int(metadata.get("group_size", "0") or 0))
    except (QuantError, ValueError) as err:
        raise CheckpointError(f"{source}: quantization {name!r}: {err}") from err


def stored_format(path: Path) -> QuantFormat | None:
    """The format of a quantized checkpoint (a directory, or one file) from its metadata alone,
    nothing read but the header; None: not a quantized checkpoint (or no safetensors)."""
    try:
        files = quantized_files(path)
    except CheckpointError:
        return None
    if files[0].suffix != ".safetensors" or not files[0].exists():
        return None
    try:
        with safe_open(str(files[0]), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
    except Exception as err:
        raise CheckpointError(f"cannot read {files[0]}: {err}") from err
    return _format_of(meta, files[0]) if "quantization" in meta else None


def read_quantized(path: Path) -> QuantizedFile:
    """Every tensor of a quantized checkpoint (no shape checks: `check_quantized`)."""
    files = quantized_files(path)
    metadata: dict[str, str] | None = None
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                meta = f.metadata() or {}
                keys = f.keys()  # the handle is not iterable
                tensors |= {k: f.get_tensor(k) for k in keys}
        except Exception as err:
            raise CheckpointError(f"cannot read {file}: {err}") from err
        if "quantization" not in meta:
            raise CheckpointError(f"{file} is not a quantized checkpoint (no quantization)")
        if metadata is not None and meta != metadata:
            raise CheckpointError(f"{file}: its metadata differs from {files[0].name}'s")
        metadata = meta
    assert metadata is not None
    return QuantizedFile(_format_of(metadata, files[0]), metadata, tensors)


def check_quantized(
    file: QuantizedFile, expected: Mapping[str, tuple[int, ...]], source: str
) -> None:
    """Raise one `CheckpointError` naming every tensor whose stored or implied shape differs
    from what the format and ``expected`` (the model's weight shapes) give."""
    fmt, found, problems = file.fmt, {}, []
    names = {k.removesuffix(QWEIGHT) for k in file.tensors if k.endswith(QWEIGHT)}
    names |= {k.removesuffix(SCALE) for k in file.tensors if k.endswith(SCALE)}
    for name, value in file.tensors.items():
        if name.endswith((QWEIGHT, SCALE)):
            continue
        found[name] = tuple(value.shape)
    for name in sorted(names):
        q, s = file.tensors.get(name + QWEIGHT), file.tensors.get(name + SCALE)
        if q is None or s is None:
            problems.append(f"{name}: {QWEIGHT if q is None else SCALE} is missing")
            continue
        want_q = torch.int8 if fmt.bits == 8 else torch.uint8
        if q.dtype != want_q or s.dtype != torch.bfloat16:
            problems.append(
                f"{name}: dtypes {q.dtype}/{s.dtype}, expected {want_q}/{torch.bfloat16}"
            )
            continue
        try:
            shape = fmt.weight_shape(name + QWEIGHT, tuple(q.shape))
            model = expected.get(name, shape)
            if shape != model:
                problems.append(
                    f"{name}{QWEIGHT}: shape {list(q.shape)} holds a weight {list(shape)}, "
                    f"the model's is {list(model)}"
                )
                continue
            want = fmt.scale_shape(name, shape)
        except QuantError as err:
            problems.append(str(err))
            continue
        if tuple(s.shape) != want:
            problems.append(
                f"{name}{SCALE}: shape {list(s.shape)}, the format implies {list(want)} "
                f"for {name}{QWEIGHT} {list(q.shape)}"
            )
        found[name] = shape
    if problems:
        raise CheckpointError(f"checkpoint {source}: " + "; ".join(problems))
    check_shapes(found, [], expected, source)


def dequantize_state(
    file: QuantizedFile, dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """The state dict the file stands for: every quantized weight rebuilt in ``dtype``."""
    out: dict[str, torch.Tensor] = {}
    for name, value in file.tensors.items():
        if name.endswith(SCALE):
            continue
        if name.endswith(QWEIGHT):
            base = name.removesuffix(QWEIGHT)
            out[base] = file.fmt.dequantize(value, file.tensors[base + SCALE], dtype)
        else:
            out[name] = value
    return out
