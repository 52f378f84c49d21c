"""One definition of each task: prompt, grammar and limits of a request.

The batched engine and the reference generation both build requests here, so a caption,
query (free or constrained by choices / regex), point, detect or segment means the same
prompt tokens, the same grammar and the same masks on both paths.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from decoding.constraints import CompileCancelled, ConstraintCompiler
from decoding.grammars import (
    Grammar,
    PathRows,
    ReasoningGrammar,
    ReasoningRows,
    RegionRows,
    RegionTokens,
    SegmentGrammar,
    SvgTokenRows,
    SvgTokenSegmentGrammar,
    TextGrammar,
    detect_grammar,
    point_grammar,
)
from decoding.limits import CompileTimeout, ConstraintLimits
from decoding.mask_table import NO_MASK, AutomatonRows, MaskTable, MaskTableFull
from decoding.svg_tokens import token_items
from decoding.vocab import TokenVocab
from vlm_server.engine.api import EngineError, ErrorCode, GenerationRequest, Task
from vlm_server.engine.requests import spatial
from vlm_server.models import prompts
from vlm_server.models.interface import FamilyConfig

SEGMENT_MAX_POINTS = 64
SEGMENT_MAX_PATH_TOKENS = 256


@dataclass
class BuiltRequest:
    prompt: list[int]  # includes BOS when there is no image
    grammar: Grammar
    prefix_len: int  # positions before the prompt: BOS + image patches, or 0
    # Mask-table rows of a choices / regex constraint, held until `release`.
    constraint: AutomatonRows | None = None
    table: MaskTable | None = None
    # What the prompt's spatial-reference placeholders encode (requests/spatial.py).
    ref_values: np.ndarray | None = None

    @property
    def total_positions(self) -> int:
        return self.prefix_len + len(self.prompt) + self.grammar.max_positions

    def release(self) -> None:
        """Give back the constraint's mask rows (idempotent). The engine calls this once no
        in-flight step can read them any more."""
        if self.constraint is not None and self.table is not None:
            self.table.release(self.constraint)
        self.constraint = None


class TaskCompiler:
    """Builds requests for one model; owns the mask table every grammar indexes into.

    Compiling a regex or choices constraint costs CPU time proportional to the vocabulary
    (milliseconds to a fraction of a second at 51,200 tokens), bounded by `limits`; compiled
    constraints are cached by the compiler. The rows of the built-in tasks (suppression,
    region, segment path) are pinned here, at start, so clients can never crowd them out.
    """

    def __init__(
        self,
        config: FamilyConfig,
        tokenizer: Tokenizer,
        mask_rows: int = 1024,
        limits: ConstraintLimits | None = None,
        compile_in_child: bool = False,
        max_spatial_refs: int = 8,
    ) -> None:
        contract = config.tokens
        self.config = config
        self.contract = contract
        self.max_spatial_refs = max_spatial_refs
        self.tokenizer = tokenizer
        self.encode = prompts.CachedEncoder(tokenizer)
        self.table = MaskTable(config.text.vocab_size, max_rows=mask_rows)
        self.vocab = TokenVocab.from_tokenizer(tokenizer)
        suppressed = list(contract.decode_suppressed_ids)
        self.suppress_row = self.table.allow_all_but(suppressed) if suppressed else NO_MASK
        self.constraints = ConstraintCompiler(
            self.vocab,
            self.table,
            contract.eos_id,
            blocked=frozenset(suppressed),
            limits=limits or ConstraintLimits(),
            in_child=compile_in_child,  # a server's: off its GIL (decoding/compile_pool.py)
        )
        later = contract.object_boundary == "coord_or_eos"
        self.region_rows = RegionRows.register(
            self.table, RegionTokens(contract.eos_id, contract.coord_id, later)
        )
        # Compiled (and pinned) here, not on the first Segment request: once clients hold
        # the table's rows, segment could otherwise find no room.
        self.reasoning_rows: ReasoningRows | None = None
        reasoning = contract.reasoning_tokens
        if reasoning is not None:
            self.reasoning_rows = ReasoningRows.register(self.table, reasoning)
        # The segment path's language, as the contract names it: one of these is set.
        self.path_rows: PathRows | None = None
        self.svg_rows: SvgTokenRows | None = None
        self._no_path = ""
        try:
            if contract.segment_language == "svg_tokens":
                items = token_items(tokenizer, self.vocab.special_ids)
                self.svg_rows = self.constraints.svg_token_path(items)
            else:
                self.path_rows = self.constraints.segment_path()
        except ValueError as err:  # a vocabulary that cannot spell SVG paths
            self._no_path = f"this tokenizer cannot write segment paths: {err}"

    def build(self, req: GenerationRequest) -> BuiltRequest:
        """Prompt, grammar and prefix of one request; EngineError naming the bad field.

        The result may hold mask-table rows: call its `release` when the request is done."""
        _check_settings(req, self.config.text.max_context)
        self._check_features(req)
        constraint = self._constraint(req) if req.task is Task.QUERY else None
        try:
            built = self._build(req, constraint)
        except BaseException:
            if constraint is not None:
                self.constraints.release(constraint)
            raise
        built.constraint, built.table = constraint, self.table
        return built

    def _build(self, req: GenerationRequest, constraint: AutomatonRows | None) -> BuiltRequest:
        c, tok, mc = self.contract, self.encode, self.config
        refs = spatial.placeholders(req.spatial_refs, mc.text.vocab_size)
        try:
            if req.task is Task.CAPTION:
                prompt = prompts.caption_prompt(c, req.caption_length)
                grammar: Grammar = TextGrammar(
                    c.eos_id, req.max_tokens, row=self.suppress_row, first_row=NO_MASK
                )
            elif req.task is Task.QUERY:
                prompt = prompts.query_prompt(
                    c, tok, req.question, refs, req.reasoning, req.history
                )
                used = len(prompt) + (1 if req.image is None else mc.image_prefix_len)
                grammar = self._query_grammar(req, constraint, mc.text.max_context - used)
            elif req.task in (Task.POINT, Task.DETECT):
                point = req.task is Task.POINT
                build = prompts.point_prompt if point else prompts.detect_prompt
                prompt = build(c, tok, req.object_name, refs)
                make = point_grammar if point else detect_grammar
                grammar = make(self.region_rows, req.max_objects)
            else:
                prompt = prompts.segment_prompt(c, tok, req.object_name, refs)
                grammar = self._segment_grammar(req)
        except EngineError:
            raise
        except prompts.TemplateMissing as err:
            field = "reasoning" if req.reasoning else "task"
            raise EngineError(ErrorCode.UNIMPLEMENTED, str(err), field) from err
        except ValueError as err:
            field = "caption_length" if req.task is Task.CAPTION else "task"
            raise EngineError(ErrorCode.INVALID_ARGUMENT, str(err), field) from err
        if req.image is None:
            built = BuiltRequest([c.bos_id, *prompt], grammar, 0)
        else:
            built = BuiltRequest(prompt, grammar, mc.image_prefix_len)
        if req.spatial_refs:
            built.ref_values = spatial.ref_values(req.spatial_refs)
        if built.total_positions > mc.text.max_context:
            field = "max_objects" if req.task in (Task.POINT, Task.DETECT) else "max_tokens"
            raise _too_long(field, built.prefix_len + len(built.prompt), grammar.max_positions, mc)
        return built

    def _segment_grammar(self, req: GenerationRequest) -> Grammar:
        """The box and path of a segment request, in the contract's path language; the
        path's tokens are bounded by ``max_tokens`` (Moondream 2's grid path also by
        SEGMENT_MAX_PATH_TOKENS and SEGMENT_MAX_POINTS)."""
        if self.path_rows is None and self.svg_rows is None:
            raise EngineError(ErrorCode.UNIMPLEMENTED, self._no_path, "task")
        try:
            if self.svg_rows is not None:
                return SvgTokenSegmentGrammar(self.region_rows, self.svg_rows, req.max_tokens)
            assert self.path_rows is not None
            return SegmentGrammar(
                self.region_rows,
                self.path_rows,
                SEGMENT_MAX_POINTS,
                min(req.max_tokens, SEGMENT_MAX_PATH_TOKENS),
            )
        except ValueError as err:  # no complete path fits the token budget
            raise EngineError(
                ErrorCode.INVALID_ARGUMENT, f"max_tokens: {err}", "max_tokens"
            ) from err

    def _query_grammar(
        self, req: GenerationRequest, constraint: AutomatonRows | None, room: int
    ) -> TextGrammar | ReasoningGrammar:
        """The answer's grammar; with reasoning, the reasoning's first. Each phase gets
        ``max_tokens`` (as the reference gives them), both within the context's ``room``."""
        eos, suppress = self.contract.eos_id, self.suppress_row

        def answer(max_tokens: int) -> TextGrammar:
            return TextGrammar(
                eos, max_tokens, row=suppress, first_row=NO_MASK, constraint=constraint
            )

        if not req.reasoning:
            return answer(req.max_tokens)
        assert self.reasoning_rows is not None  # `_check_features` refused it otherwise
        # The answer may end at the context, but one phase's budget and the marker must fit.
        if room < req.max_tokens + 1:
            used = self.config.text.max_context - room
            raise _too_long("max_tokens", used, req.max_tokens + 1, self.config)
        reserve = constraint.dist(constraint.dfa.start) if constraint is not None else 0
        try:
            return ReasoningGrammar(self.reasoning_rows, req.max_tokens, answer, reserve, room)
        except ValueError as err:
            raise EngineError(
                ErrorCode.INVALID_ARGUMENT, f"max_tokens: {err}", "max_tokens"
            ) from err

    def _check_features(self, req: GenerationRequest) -> None:
        """Reasoning and spatial references: whether the task and the model have them."""
        c = self.contract
        if req.reasoning:
            if req.task is not Task.QUERY:
                raise EngineError(
                    ErrorCode.INVALID_ARGUMENT, "reasoning: only a query reasons", "reasoning"
                )
            if self.reasoning_rows is None:
                raise EngineError(
                    ErrorCode.UNIMPLEMENTED,
                    f"reasoning: token contract {c.name!r} has no reasoning mode",
                    "reasoning",
                )
        if not req.spatial_refs:
            return
        if req.image is None:
            raise EngineError(
                ErrorCode.INVALID_ARGUMENT,
                "spatial_refs: spatial references need an image",
                "spatial_refs",
            )
        if req.task is Task.CAPTION:
            raise EngineError(
                ErrorCode.INVALID_ARGUMENT,
                "spatial_refs: a caption takes no spatial references",
                "spatial_refs",
            )
        if c.coord_id is None or c.size_id is None:
            raise EngineError(
                ErrorCode.UNIMPLEMENTED,
                f"spatial_refs: token contract {c.name!r} takes no spatial references",
                "spatial_refs",
            )
        if len(req.spatial_refs) > self.max_spatial_refs:
            raise EngineError(
                ErrorCode.INVALID_ARGUMENT,
                f"spatial_refs: {len(req.spatial_refs)} references; at most "
                f"{self.max_spatial_refs} (the server's --max-spatial-refs)",
                "spatial_refs",
            )

    def _constraint(self, req: GenerationRequest) -> AutomatonRows | None:
        """The request's choices / regex rows (held: `BuiltRequest.release` gives them back);
        errors name the field: INVALID_ARGUMENT for a bad or too large constraint,
        RESOURCE_EXHAUSTED when compiling runs out of time or the mask table is full."""
        if req.choices and req.regex is not None:  # an empty regex is still a regex
            raise EngineError(
                ErrorCode.INVALID_ARGUMENT, "choices: give choices or regex, not both", "choices"
            )
        if not req.choices and req.regex is None:
            return None
        field = "choices" if req.choices else "regex"
        try:
            if req.choices:
                return self.constraints.choices(req.choices, req.max_tokens)
            return self.constraints.regex(req.regex or "", req.max_tokens)
        except CompileTimeout as err:
            raise EngineError(ErrorCode.RESOURCE_EXHAUSTED, f"{field}: {err}", field) from err
        except CompileCancelled as err:
            raise EngineError(ErrorCode.CANCELLED, f"{field}: {err}", field) from err
        except MaskTableFull as err:
            raise EngineError(
                ErrorCode.RESOURCE_EXHAUSTED,
                f"{field}: {err}; retry when running constrained requests finish",
                field,
            ) from err
        except ValueError as err:
            raise EngineError(ErrorCode.INVALID_ARGUMENT, f"{field}: {err}", field) from err


def _too_long(field: str, used: int, needed: int, config: FamilyConfig) -> EngineError:
    """OUT_OF_RANGE: the prompt's ``used`` positions plus ``needed`` exceed the context."""
    return EngineError(
        ErrorCode.OUT_OF_RANGE,
        f"{field}: the prompt ({used} positions) plus the output budget ({needed} positions) "
        f"exceeds the model context of {config.text.max_context}",
        field,
    )


def _check_settings(req: GenerationRequest, max_context: int) -> None:
    """The checks that need the task definitions or the model; value ranges that need
    neither (temperature, top_p, max_objects >= 1, ...) are the service's."""
    if req.task is not Task.QUERY and req.image is None:
        raise EngineError(
            ErrorCode.INVALID_ARGUMENT,
            f"{req.task} needs an image: set image_bytes or image_id",
            "image",
        )
    if req.max_tokens > max_context:
        # Well formed, but beyond this model: OUT_OF_RANGE, as a prompt plus a budget that
        # together exceed the context are.
        raise EngineError(
            ErrorCode.OUT_OF_RANGE,
            f"max_tokens: must be at most {max_context} (the model's context), "
            f"got {req.max_tokens}",
            "max_tokens",
        )
