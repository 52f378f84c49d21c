"""Moondream 3 finetune adapters as the cloud's finetunes store them: read a checkpoint, find
its tensors by name, check them against the model.

A checkpoint is a ``torch.save``d dict whose ``lora_state_dict`` holds the text decoder's MLP
LoRA in the author's engine's module tree (a flat dict of those tensors, or a safetensors
file of them, reads the same). The tree's top-level name is not fixed (that engine registers
the same text LoRA under two names and loads with ``strict=False``), so a tensor is known by
the end of its key, after any prefix:

* ``dense.<i>.{up_a, up_b, down_a, down_b}``, dense layer ``i``: ``[r, dim]``, ``[ff, r]``,
  ``[r, ff]``, ``[dim, r]``;
* ``moe.<j>.{...}``, expert layer ``j`` (decoder layer ``first_layer + j``), one pair per
  expert: ``[E, r/k, dim]``, ``[E, 2 x expert, r/k]``, ``[E, r/k, expert]``, ``[E, dim,
  r/k]``, where ``k`` is the experts per token: the rank is split evenly over them.

``up`` is fc1 (its delta added before the activation), ``down`` fc2; no scaling. The rank is
read from a dense ``up_a`` (or an expert ``up_a`` times ``k``); every tensor must agree with
it. Errors name the field ``adapter`` (through the caller), the tensor and the shapes.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from vlm_server.models.lora.files import MAX_FILE_BYTES, AdapterError
from vlm_server.models.lora.spec import AdapterWeights, LoraTargets, Pairs

STATE_KEY = "lora_state_dict"
KEY = re.compile(r"(?:.*\.)?(dense|moe)\.(\d+)\.(up|down)_(a|b)")
TARGET = {"up": "fc1", "down": "fc2"}


def read_state(path: Path, name: str) -> dict[str, torch.Tensor]:
    """The checkpoint's LoRA tensors by key: ``lora_state_dict`` of a ``.pt`` checkpoint, or
    the flat dict of a ``.pt`` or ``.safetensors`` file."""
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise AdapterError(f"adapter {name!r}: its file is {size} bytes, over {MAX_FILE_BYTES}")
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            loaded: object = load_file(str(path), device="cpu")
        else:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except AdapterError:
        raise
    except Exception as err:  # any unreadable file: pickle, zip, header, truncation
        raise AdapterError(f"adapter {name!r}: cannot read its file: {err}") from None
    if isinstance(loaded, dict) and STATE_KEY in loaded:
        loaded = loaded[STATE_KEY]  # a training checkpoint: the rest (step, ...) is not LoRA
    if not isinstance(loaded, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()
    ):
        raise AdapterError(
            f"adapter {name!r}: the file is neither a checkpoint with a {STATE_KEY!r} of named "
            "tensors nor a flat dict of them"
        )
    return loaded


def _collect(
    flat: dict[str, torch.Tensor], name: str
) -> dict[tuple[str, int, str, str], tuple[str, torch.Tensor]]:
    """(kind, layer, up|down, a|b) -> (key, tensor); the same tensor under two prefixes once."""
    found: dict[tuple[str, int, str, str], tuple[str, torch.Tensor]] = {}
    for key, t in flat.items():
        m = KEY.fullmatch(key)
        if m is None:
            raise AdapterError(
                f"adapter {name!r}: unexpected tensor {key!r} (a Moondream 3 finetune holds "
                "only the text MLP's dense.<i>.* and moe.<j>.* LoRA tensors)"
            )
        slot = (m[1], int(m[2]), m[3], m[4])
        if slot in found:
            seen, other = found[slot]
            if other.shape != t.shape or not torch.equal(other, t):
                raise AdapterError(
                    f"adapter {name!r}: tensors {seen!r} and {key!r} name the same weight "
                    "with different values"
                )
            continue
        if not t.is_floating_point():
            raise AdapterError(f"adapter {name!r}: tensor {key!r} must be a float tensor")
        found[slot] = (key, t)
    return found


def _rank(found: dict[tuple[str, int, str, str], tuple[str, torch.Tensor]], top_k: int) -> int:
    """The adapter's rank: a dense ``up_a``'s rows, else an expert ``up_a``'s times ``top_k``
    (0: no ``up_a`` to read it from)."""
    for kind in ("dense", "moe"):
        for where in sorted(found):
            t = found[where][1]
            if where[0] == kind and where[2:] == ("up", "a") and t.dim() >= 2:
                return t.shape[0] if kind == "dense" else t.shape[1] * top_k
    return 0


def validate(
    flat: dict[str, torch.Tensor], targets: LoraTargets, max_rank: int, name: str
) -> AdapterWeights:
    """Check every tensor against the model's targets; raise naming the first bad one."""
    ex = targets.experts
    if ex is None:
        raise AdapterError(f"adapter {name!r}: this model has no expert layers")
    found = _collect(flat, name)
    if not found:
        raise AdapterError(f"adapter {name!r}: the file holds no LoRA tensors")
    r = _rank(found, ex.top_k)
    if not r:
        raise AdapterError(f"adapter {name!r}: no dense or moe up_a tensor gives its rank")
    if r % ex.top_k:
        raise AdapterError(
            f"adapter {name!r}: rank {r} is not divisible by the {ex.top_k} experts per token "
            "(each expert takes rank / experts per token)"
        )
    if not 0 < r <= max_rank:
        raise AdapterError(f"adapter {name!r}: rank {r}; max_adapter_rank is {max_rank}")
    per_expert = r // ex.top_k
    dense: Pairs = [{} for _ in range(targets.n_layers)]
    experts: Pairs = [{} for _ in range(ex.n_layers)]
    for kind, layer, part, half in sorted(found):
        key, t = found[kind, layer, part, half]
        target = TARGET[part]
        is_dense = kind == "dense"
        count = targets.n_layers if is_dense else ex.n_layers
        if layer >= count:
            what = "dense" if is_dense else "expert"
            raise AdapterError(
                f"adapter {name!r}: tensor {key!r}: the model has {count} {what} layers"
            )
        n_in, n_out = (targets.targets if is_dense else ex.targets)[target]
        lead = () if is_dense else (ex.n_experts,)
        rank = r if is_dense else per_expert
        want = (*lead, rank, n_in) if half == "a" else (*lead, n_out, rank)
        if tuple(t.shape) != want:
            lead_name, rank_name = ("", "r") if is_dense else ("E, ", f"r/{ex.top_k}")
            a_form, b_form = f"[{lead_name}{rank_name}, in]", f"[{lead_name}out, {rank_name}]"
            form = a_form if half == "a" else b_form
            raise AdapterError(
                f"adapter {name!r}: tensor {key!r} has shape {tuple(t.shape)}; the model and "
                f"the adapter's rank {r} need {want} ({form})"
            )
        if not torch.isfinite(t).all():
            raise AdapterError(f"adapter {name!r}: tensor {key!r} holds inf or NaN")
        other = (kind, layer, part, "b" if half == "a" else "a")
        if other not in found:
            missing = f"{kind}.{layer}.{part}_{other[3]}"
            raise AdapterError(f"adapter {name!r}: tensor {missing} is missing (beside {key!r})")
        if half == "a":
            (dense if is_dense else experts)[layer][target] = (t, found[other][1])
    return AdapterWeights(name, r, dense, experts)


def load(path: Path, targets: LoraTargets, max_rank: int, name: str) -> AdapterWeights:
    """Read and check one finetune checkpoint (on the CPU, in its own dtype)."""
    return validate(read_state(path, name), targets, max_rank, name)
