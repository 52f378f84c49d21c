"""Loading a family's model with 4- or 8-bit weights (docs/quantization.md): the tensors to
load, from a 16-bit checkpoint quantized here or from a quantized checkpoint as it is, and
the model's linear layers swapped for `QuantLinear`s that take them.

A family's loader builds its model on the meta device, as for 16-bit weights, and calls
`quantized_state` then `install`; nothing 16-bit of a quantized weight reaches the device
but the one tensor being quantized.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from vlm_server.models.checkpoint_io import CheckpointError
from vlm_server.models.common.quant_linear import module_names, swap_linears
from vlm_server.models.interface import QuantizedWeights
from vlm_server.models.quant.files import QWEIGHT, SCALE, QuantizedFile
from vlm_server.models.quant.formats import QuantFormat, weight_format


@dataclass(frozen=True)
class QuantRequest:
    """What the registry asks of a family's loader: weights in ``fmt``, either quantized at
    load from the checkpoint (``stored`` None) or ``stored``: a quantized checkpoint's tensors,
    checked against the model, served as they are."""

    fmt: QuantFormat
    stored: QuantizedFile | None = None


def quantized_state(
    request: QuantRequest,
    state: Mapping[str, torch.Tensor] | None,
    targets: Sequence[str],
    device: torch.device | str,
    dtype: torch.dtype,
) -> tuple[dict[str, torch.Tensor], QuantizedWeights]:
    """The tensors to load (the file's names: ``<weight>.qweight`` and ``.scale`` for each
    quantized weight) on ``device``, everything not quantized in ``dtype``, and what was
    quantized. ``state``: the 16-bit checkpoint (ignored for a stored one); ``targets``: the
    weights the family serves quantized. An INT4 target whose input columns are not a multiple
    of the group stays 16-bit (in ``kept``, as ``vlm quantize`` keeps it)."""
    fmt, stored = request.fmt, request.stored
    if stored is not None:
        serves = set(targets)
        foreign = [name for name in stored.quantized if name not in serves]
        if foreign:
            raise CheckpointError(
                f"{', '.join(foreign[:4])}: stored {fmt.name}, which this family does not "
                "serve quantized yet; quantize its 16-bit checkpoint at load instead"
            )
        tensors = {name: _placed(name, v, device, dtype) for name, v in stored.tensors.items()}
        return tensors, QuantizedWeights(fmt.name, fmt.group_size, tuple(stored.quantized))
    assert state is not None
    chosen, kept, out = set(targets), {}, {}
    for name, value in state.items():
        columns = value.shape[-1]
        if name in chosen and fmt.group_size and columns % fmt.group_size:
            kept[name] = f"{columns} input columns are not a multiple of {fmt.group_size}"
        if name in chosen and name not in kept:
            q, s = fmt.quantize(name, value.to(device))
            out[name + QWEIGHT], out[name + SCALE] = q.contiguous(), s.contiguous()
        else:
            out[name] = value.to(device=device, dtype=dtype).contiguous()
    done = tuple(name for name in targets if name not in kept)
    return out, QuantizedWeights(fmt.name, fmt.group_size, done, kept)


def install(
    model: nn.Module, tensors: Mapping[str, torch.Tensor], quantized: QuantizedWeights
) -> dict[str, torch.Tensor]:
    """Swap the quantized weights' linear layers of ``model`` (built on the meta device) for
    empty `QuantLinear`s; returns ``tensors`` under the model's state names, for the family's
    ``load_state_dict(..., assign=True)``."""
    fmt = weight_format(quantized.format, quantized.group_size)
    swap_linears(model, quantized.weights, fmt)
    return module_names(tensors)


def _placed(
    name: str, value: torch.Tensor, device: torch.device | str, dtype: torch.dtype
) -> torch.Tensor:
    # Stored values and scales keep their dtypes; every other tensor takes the activations'.
    if name.endswith((QWEIGHT, SCALE)):
        return value.to(device)
    return value.to(device=device, dtype=dtype)
