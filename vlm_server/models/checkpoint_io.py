"""Reading checkpoint files, for every family: safetensors or torch files, keys and shapes
first, tensors one by one; one error that names every mismatched tensor with its shapes.
`CheckpointError` is the one error of finding, reading and matching a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

_LIST_LIMIT = 12


class CheckpointError(ValueError):
    """A checkpoint could not be found, read, or matched to the model configuration."""


def indexed_files(index: Path) -> list[Path]:
    """The weights files a sharded checkpoint's index (``*.index.json``) names, beside it."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"cannot read {index}: {err}") from err
    return [index.parent / name for name in sorted(set(weight_map.values()))]


def _fmt(items: list[str]) -> str:
    shown = ", ".join(items[:_LIST_LIMIT])
    return shown + (f", ... ({len(items)} in all)" if len(items) > _LIST_LIMIT else "")


def check_shapes(
    found: dict[str, tuple[int, ...]],
    unknown: list[str],
    expected: dict[str, tuple[int, ...]],
    source: str,
) -> None:
    """Raise one `CheckpointError` naming every missing, unexpected and mis-shaped tensor."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected)) + sorted(unknown)
    misshaped = sorted(
        f"{k} {list(found[k])} (expected {list(expected[k])})"
        for k in set(found) & set(expected)
        if found[k] != expected[k]
    )
    problems = []
    if missing:
        problems.append(f"missing {len(missing)}: {_fmt(missing)}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)}: {_fmt(unexpected)}")
    if misshaped:
        problems.append(f"wrong shape {len(misshaped)}: {_fmt(misshaped)}")
    if problems:
        raise CheckpointError(
            f"checkpoint {source} does not match the model: " + "; ".join(problems)
        )


class CheckpointReader:
    """Uniform access to a safetensors or torch file: keys, shapes, then tensors one by one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._pt: dict[str, torch.Tensor] | None = None
        try:
            if path.suffix == ".safetensors":
                self._st = safe_open(str(path), framework="pt", device="cpu")
                self.keys = list(self._st.keys())
            else:
                state = torch.load(str(path), map_location="cpu", weights_only=True)
                if not isinstance(state, dict):
                    raise CheckpointError(f"{path} does not hold a state dict")
                self._pt = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
                self.keys = list(self._pt)
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(f"cannot read {path}: {err}") from err

    def shape(self, key: str) -> tuple[int, ...]:
        if self._pt is not None:
            return tuple(self._pt[key].shape)
        return tuple(self._st.get_slice(key).get_shape())

    def tensor(self, key: str) -> torch.Tensor:
        if self._pt is not None:
            return self._pt[key]
        return self._st.get_tensor(key)
