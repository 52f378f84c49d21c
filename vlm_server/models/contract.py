"""The tokenizer contract a model family speaks: special ids, prompt templates, value scales.

Families describe their token era with these; the request builder (prompts, grammars) and the
device code (region value decoding) read them and never hard-code an id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from decoding.reasoning_grammar import ReasoningTokens

SizeScale = Literal["log", "linear"]
# The language of a segment answer's path: "grid", byte-level SVG text on a 100-unit grid
# (decoding/svg_path.py); "svg_tokens", one SVG item per token in a 960-unit box (Moondream 3,
# decoding/svg_tokens.py).
SegmentLanguage = Literal["grid", "svg_tokens"]
# Which tokens compete at a point/detect object boundary after the first object: the whole
# vocabulary ("vocabulary", Moondream 2's reference: eos ends the answer, any other token
# starts an object) or only the coordinate token and eos ("coord_or_eos", Moondream 3's
# published code). The first boundary always weighs the whole vocabulary.
ObjectBoundary = Literal["vocabulary", "coord_or_eos"]


@dataclass(frozen=True)
class PromptTemplates:
    """Token-id templates for each task; the variable text is encoded between prefix and suffix."""

    caption_short: tuple[int, ...]
    caption_normal: tuple[int, ...]
    caption_long: tuple[int, ...]
    query_prefix: tuple[int, ...]
    query_suffix: tuple[int, ...]
    detect_prefix: tuple[int, ...]
    detect_suffix: tuple[int, ...]
    point_prefix: tuple[int, ...]
    point_suffix: tuple[int, ...]
    segment_prefix: tuple[int, ...] | None = None
    segment_suffix: tuple[int, ...] | None = None
    # After the question of a query with reasoning (the answer marker, then the thinking
    # marker); None: the era cannot reason.
    reasoning_suffix: tuple[int, ...] | None = None
    # GPT-2-era templates put a space before the question / object; the 2025-06 code does not
    # for the question but does for the object (point, detect). Segment says on its own:
    # Moondream 3 puts none before its object.
    question_leading_space: bool = False
    object_leading_space: bool = True
    segment_object_leading_space: bool = True

    def caption(self, length: str) -> tuple[int, ...]:
        """The caption template for ``short``, ``normal`` or ``long``."""
        try:
            return {
                "short": self.caption_short,
                "normal": self.caption_normal,
                "long": self.caption_long,
            }[length]
        except KeyError:
            raise ValueError(
                f"caption length must be short, normal or long, not {length!r}"
            ) from None


@dataclass(frozen=True)
class TokenContract:
    """Special ids, templates and value scales of one tokenizer era."""

    name: str
    bos_id: int
    eos_id: int
    templates: PromptTemplates
    size_scale: SizeScale
    coord_id: int | None = None
    size_id: int | None = None
    answer_id: int | None = None
    # Ids set to -inf on text decode steps after the first (HEAD suppresses answer_id).
    decode_suppressed_ids: tuple[int, ...] = ()
    # A coordinate bin b decodes to b / coord_divisor: 1024 in Moondream 2's code, 1023 in
    # Moondream 3's own engine (bin 1023 -> exactly 1.0).
    coord_divisor: int = 1024
    # Grounded reasoning: reasoning ends when answer_id is sampled; start_ground_points_id and
    # end_ground_id open a new span of the reasoning text.
    thinking_id: int | None = None
    start_ground_points_id: int | None = None
    end_ground_id: int | None = None
    # Ids set to -inf on reasoning steps after the first; None: eos and the size token, as
    # both families' published code does.
    reasoning_suppressed_ids: tuple[int, ...] | None = None
    # How a segment answer writes its path (see SegmentLanguage).
    segment_language: SegmentLanguage = "grid"
    # What competes at a point/detect object boundary after the first (see ObjectBoundary).
    object_boundary: ObjectBoundary = "vocabulary"

    @property
    def reasoning_suppressed(self) -> tuple[int, ...]:
        """The ids masked out of reasoning steps after the first."""
        if self.reasoning_suppressed_ids is not None:
            return self.reasoning_suppressed_ids
        return tuple(i for i in (self.eos_id, self.size_id) if i is not None)

    @property
    def reasons(self) -> bool:
        """Whether this era has grounded reasoning."""
        return self.reasoning_tokens is not None

    @property
    def reasoning_tokens(self) -> ReasoningTokens | None:
        """The ids the reasoning grammar reads, or None: the era cannot reason."""
        answer, coord, size = self.answer_id, self.coord_id, self.size_id
        start, end = self.start_ground_points_id, self.end_ground_id
        if (
            self.templates.reasoning_suffix is None
            or answer is None
            or coord is None
            or size is None
            or start is None
            or end is None
        ):
            return None
        return ReasoningTokens(
            self.eos_id, answer, coord, size, start, end, self.reasoning_suppressed
        )

    def __post_init__(self) -> None:
        if self.size_scale not in ("log", "linear"):
            raise ValueError(f"size_scale must be 'log' or 'linear', not {self.size_scale!r}")
        if self.coord_divisor not in (1023, 1024):
            raise ValueError(f"coord_divisor must be 1023 or 1024, not {self.coord_divisor!r}")
        if self.object_boundary not in ("vocabulary", "coord_or_eos"):
            raise ValueError(
                "object_boundary must be 'vocabulary' or 'coord_or_eos', "
                f"not {self.object_boundary!r}"
            )
        if self.object_boundary == "coord_or_eos" and self.coord_id is None:
            raise ValueError("object_boundary 'coord_or_eos' needs a coord_id")
        if self.segment_language not in ("grid", "svg_tokens"):
            raise ValueError(
                f"segment_language must be 'grid' or 'svg_tokens', not {self.segment_language!r}"
            )
