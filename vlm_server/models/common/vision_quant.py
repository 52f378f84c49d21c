"""The vision tower's block linears quantized at load (``--vision-weights int8|int4``,
docs/quantization.md): each `nn.Linear` of a block (attention qkv and proj, MLP fc1 and fc2)
replaced by a `QuantLinear` holding its weight in the format, one layer at a time, so that
no 16-bit copy of a quantized weight stays. The patch embedding, the norms and the
projection into the decoder's width stay as they are.

It runs after the family built its model with 16-bit weights, whatever format its decoder
was loaded in: the tower's format is independent of ``--weights``.
"""

from __future__ import annotations

import torch
from torch import nn

from vlm_server.models.common.quant_linear import QuantLinear
from vlm_server.models.interface import QuantizedWeights
from vlm_server.models.quant.formats import QuantFormat

# A tower's block linears, by their names under a block (the checkpoint's names).
BLOCK_LINEARS = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")


@torch.no_grad()
def quantize_tower(blocks: nn.ModuleList, fmt: QuantFormat, prefix: str) -> QuantizedWeights:
    """Swap every block linear of ``blocks`` for a `QuantLinear` in ``fmt``, quantized from
    its current weight on its device; ``prefix``: the blocks' state name (``vision.blocks``),
    for the names returned. An INT4 linear whose input columns are not a multiple of the
    group stays 16-bit (in ``kept``, as ``vlm quantize`` keeps it)."""
    done: list[str] = []
    kept: dict[str, str] = {}
    for i, block in enumerate(blocks):
        for path in BLOCK_LINEARS:
            name = f"{prefix}.{i}.{path}.weight"
            linear = block.get_submodule(path)
            if not isinstance(linear, nn.Linear):
                raise ValueError(f"{name}: a {type(linear).__name__}, not a 16-bit linear layer")
            if fmt.group_size and linear.in_features % fmt.group_size:
                kept[name] = (
                    f"{linear.in_features} input columns are not a multiple of {fmt.group_size}"
                )
                continue
            block.set_submodule(path, _quantized(linear, fmt, name))
            done.append(name)
    return QuantizedWeights(fmt.name, fmt.group_size, tuple(done), kept)


def _quantized(linear: nn.Linear, fmt: QuantFormat, name: str) -> QuantLinear:
    layer = QuantLinear.like(linear, fmt)
    qweight, scale = fmt.quantize(name, linear.weight)
    layer.qweight, layer.scale = qweight.contiguous(), scale.contiguous()
    if linear.bias is not None:
        assert layer.bias is not None
        layer.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
    return layer
