"""A family's `MemoryShape` from its parameter shapes (the model built on the meta device:
nothing allocated) and its widths."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from vlm_server.models.interface import FamilyConfig, KVShape, MemoryShape
from vlm_server.models.quant.targets import VISION_LINEARS


def parameter_parts(shapes: Mapping[str, tuple[int, ...]]) -> tuple[dict[str, int], int]:
    """Parameters by part (the first name component; the decoder's expert stacks, its only
    three-dimensional weights [experts, rows, columns], apart as "experts") and the expert
    stacks' output rows."""
    params: dict[str, int] = {}
    expert_rows = 0
    for name, shape in shapes.items():
        part = name.split(".", 1)[0]
        if part == "text" and len(shape) == 3:
            part = "experts"
            expert_rows += shape[0] * shape[1]
        params[part] = params.get(part, 0) + math.prod(shape)
    return params, expert_rows


def memory_shape(
    config: FamilyConfig,
    shapes: Mapping[str, tuple[int, ...]],
    kv: KVShape,
    *,
    qkv_dim: int,
    ff_dim: int,
    enc_dim: int,
    enc_ff_dim: int,
    proj_inner_dim: int,
    rotary_dim: int,
    enc_layers: int,
    top_k: int = 0,
    expert_dim: int = 0,
    linears: Sequence[str] = (),
    fused_elements: int = 0,
) -> MemoryShape:
    """``linears``: the decoder's weights ``--weights int8|int4`` quantizes (2-D, [out, in])."""
    params, expert_rows = parameter_parts(shapes)
    vision = config.vision
    return MemoryShape(
        params=params,
        expert_rows=expert_rows,
        kv=kv,
        dim=config.text.dim,
        qkv_dim=qkv_dim,
        ff_dim=ff_dim,
        vocab_size=config.text.vocab_size,
        max_context=config.text.max_context,
        prefix_len=config.image_prefix_len,
        enc_dim=enc_dim,
        enc_ff_dim=enc_ff_dim,
        n_patches=(vision.crop_size // vision.patch_size) ** 2,
        max_crops=vision.max_crops,
        proj_inner_dim=proj_inner_dim,
        rotary_dim=rotary_dim,
        enc_layers=enc_layers,
        top_k=top_k,
        expert_dim=expert_dim,
        linear_params=sum(math.prod(shapes[name]) for name in linears),
        linear_rows=sum(shapes[name][0] for name in linears),
        fused_elements=fused_elements,
        vision_linears=tuple(
            (shape[0], shape[1]) for name, shape in shapes.items() if VISION_LINEARS.fullmatch(name)
        ),
    )
