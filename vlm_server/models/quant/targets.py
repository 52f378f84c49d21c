"""Which weights a family quantizes: the transformer blocks' linear weights (attention qkv and
proj, MLP fc1 and fc2, stacked experts included), of the decoder and, when asked, of the
vision tower. Embeddings, the LM head, norms, biases, routers, tau and the region heads stay
as they are. Families declare theirs through `ModelFamily.quant_targets`, built from this."""

from __future__ import annotations

import re
from collections.abc import Mapping

# The block linears both Moondream families name the same way.
TEXT_LINEARS = re.compile(r"text\.blocks\.\d+\.(attn\.(qkv|proj)|mlp\.(fc1|fc2))\.weight")
VISION_LINEARS = re.compile(r"vision\.blocks\.\d+\.(attn\.(qkv|proj)|mlp\.(fc1|fc2))\.weight")


def block_linears(
    shapes: Mapping[str, tuple[int, ...]],
    vision: bool,
    text: re.Pattern[str] = TEXT_LINEARS,
    tower: re.Pattern[str] = VISION_LINEARS,
) -> list[str]:
    """The names among ``shapes`` (a model's weight shapes) that ``text`` matches, and those
    ``tower`` matches when ``vision``; in the model's order."""
    return [name for name in shapes if text.fullmatch(name) or (vision and tower.fullmatch(name))]
