"""Adapter files: find one in the adapter folder, read it, rename its keys, check it against
the model.

Formats: the reference's ``.pt`` (``torch.load(weights_only=True)``, training key names that
`rename` maps, as the reference's ``variant_state_dict`` does), at ``<dir>/<id>/final.pt``
(where the reference caches a download) or ``<dir>/<id>.pt``; and safetensors, at
``<dir>/<id>.safetensors`` or ``<dir>/<id>/adapter.safetensors``, with the same names. After
renaming, keys are ``text.blocks.<layer>.<attn|mlp>.<target>.<A|B>``.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from vlm_server.models.lora.spec import AdapterWeights, LoraTargets

# The reference's renames (moondream/torch/lora.py), applied in this order to every key.
RENAMES = (
    ("text_model.transformer.h", "text.blocks"),
    (".mixer", ".attn"),
    (".out_proj", ".proj"),
    (".Wqkv", ".qkv"),
    (".parametrizations.weight.0", ""),
)
# Which block part holds each target.
PARTS = {"qkv": "attn", "proj": "attn", "fc1": "mlp", "fc2": "mlp"}
KEY = re.compile(r"text\.blocks\.(\d+)\.(attn|mlp)\.(\w+)\.(A|B)")
# An adapter id: a name, optionally ``@<step>`` (a finetune's checkpoint).
ADAPTER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}(@[0-9]{1,12})?")
MAX_FILE_BYTES = 4 << 30  # no adapter of a 2B decoder comes near this


class AdapterError(ValueError):
    """An adapter that cannot be used; the message names the adapter and what is wrong.
    ``retryable``: the file could not be fetched (network), not a bad request or file."""

    def __init__(self, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


def check_id(adapter: str) -> str:
    """``adapter`` if it is a well-formed id (it becomes a path and a URL part), else raise."""
    if not ADAPTER_ID.fullmatch(adapter) or ".." in adapter:
        raise AdapterError(
            f"adapter id {adapter[:64]!r} is not a name of letters, digits, '_', '.', '-' "
            "(at most 128), optionally followed by @<step>"
        )
    return adapter


def candidates(folder: Path, adapter: str) -> list[Path]:
    """Where ``adapter``'s file may be in ``folder``, in the order they are tried."""
    return [
        folder / adapter / "final.pt",
        folder / f"{adapter}.pt",
        folder / f"{adapter}.safetensors",
        folder / adapter / "adapter.safetensors",
    ]


def find(folder: Path, adapter: str) -> Path | None:
    for path in candidates(folder, check_id(adapter)):
        if path.is_file():
            return path
    return None


def rename(key: str) -> str:
    for old, new in RENAMES:
        if old in key:
            key = key.replace(old, new)
    return key


def read_tensors(path: Path, name: str) -> dict[str, torch.Tensor]:
    """The file's tensors under their renamed keys."""
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise AdapterError(f"adapter {name!r}: its file is {size} bytes, over {MAX_FILE_BYTES}")
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            flat = load_file(str(path), device="cpu")
        else:
            flat = torch.load(path, map_location="cpu", weights_only=True)
    except AdapterError:
        raise
    except Exception as err:  # any unreadable file: pickle, zip, header, truncation
        raise AdapterError(f"adapter {name!r}: cannot read its file: {err}") from None
    if not isinstance(flat, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in flat.items()
    ):
        raise AdapterError(f"adapter {name!r}: the file is not a flat dict of named tensors")
    return {rename(k): v for k, v in flat.items()}


def validate(
    flat: dict[str, torch.Tensor], targets: LoraTargets, max_rank: int, name: str
) -> AdapterWeights:
    """Check every tensor against the model's targets; raise naming the first bad one."""
    halves: list[dict[str, dict[str, torch.Tensor]]] = [{} for _ in range(targets.n_layers)]
    for key, t in flat.items():
        m = KEY.fullmatch(key)
        if m is None:
            raise AdapterError(f"adapter {name!r}: unexpected tensor {key!r}")
        layer, part, target, half = int(m[1]), m[2], m[3], m[4]
        if target not in targets.targets or PARTS.get(target) != part:
            raise AdapterError(f"adapter {name!r}: tensor {key!r}: {part}.{target} is no target")
        if layer >= targets.n_layers:
            raise AdapterError(
                f"adapter {name!r}: tensor {key!r}: the model has {targets.n_layers} layers"
            )
        if not t.is_floating_point() or t.dim() != 2:
            raise AdapterError(f"adapter {name!r}: tensor {key!r} must be a 2-d float tensor")
        halves[layer].setdefault(target, {})[half] = t
    pairs: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
    rank = 0
    for layer, found in enumerate(halves):
        pairs.append({})
        for target, ab in found.items():
            key = f"text.blocks.{layer}.{PARTS[target]}.{target}"
            if set(ab) != {"A", "B"}:
                missing = ({"A", "B"} - set(ab)).pop()
                raise AdapterError(f"adapter {name!r}: tensor {key}.{missing} is missing")
            a, b = ab["A"], ab["B"]
            n_in, n_out = targets.targets[target]
            r = a.shape[0]
            if a.shape != (r, n_in) or b.shape != (n_out, r):
                raise AdapterError(
                    f"adapter {name!r}: tensors {key}.A {tuple(a.shape)} and .B "
                    f"{tuple(b.shape)} must be [r, {n_in}] and [{n_out}, r]"
                )
            if not 0 < r <= max_rank:
                raise AdapterError(
                    f"adapter {name!r}: tensor {key}.A has rank {r}; max_adapter_rank is {max_rank}"
                )
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise AdapterError(f"adapter {name!r}: tensor {key} holds inf or NaN")
            rank = max(rank, r)
            pairs[layer][target] = (a, b)
    if not rank:
        raise AdapterError(f"adapter {name!r}: the file holds no LoRA tensors")
    return AdapterWeights(name, rank, pairs)


def load(path: Path, targets: LoraTargets, max_rank: int, name: str) -> AdapterWeights:
    """Read and check one adapter file (on the CPU, in its own dtype)."""
    return validate(read_tensors(path, name), targets, max_rank, name)
