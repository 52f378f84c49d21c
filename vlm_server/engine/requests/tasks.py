"""One definition of each task: prompt, grammar and limits of a request.

The batched engine and the reference generation both build requests here, so a caption,
query (free or constrained by choices / regex), point, detect or segment means the same
prompt tokens, the same grammar and the same masks on both paths.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from tokenizers import Tokenizer

from decoding.constraints import ConstraintCompiler
from decoding.grammars import (
    Grammar,
    PathRows,
    RegionRows,
    RegionTokens,
    SegmentGrammar,
    TextGrammar,
    detect_grammar,
    point_grammar,
)
from decoding.mask_table import NO_MASK, AutomatonRows, MaskTable
from decoding.vocab import TokenVocab
from vlm_server.config import ModelConfig
from vlm_server.engine.api import EngineError, ErrorCode, GenerationRequest, Task
from vlm_server.engine.requests import prompts

SEGMENT_MAX_POINTS = 64
SEGMENT_MAX_PATH_TOKENS = 256


@dataclass
class BuiltRequest:
    prompt: list[int]  # includes BOS when there is no image
    grammar: Grammar
    prefix_len: int  # positions before the prompt: BOS + image patches, or 0

    @property
    def total_positions(self) -> int:
        return self.prefix_len + len(self.prompt) + self.grammar.max_positions


class TaskCompiler:
    """Builds requests for one model; owns the mask table every grammar indexes into.

    Compiling a regex or choices constraint costs CPU time proportional to the vocabulary
    (milliseconds to a fraction of a second at 51,200 tokens); the lock makes concurrent
    builders safe, and compiled constraints are cached by the compiler.
    """

    def __init__(self, config: ModelConfig, tokenizer: Tokenizer, mask_rows: int = 1024) -> None:
        contract = config.tokens
        assert contract is not None
        self.config = config
        self.contract = contract
        self.tokenizer = tokenizer
        self.table = MaskTable(config.text.vocab_size, max_rows=mask_rows)
        self.vocab = TokenVocab.from_tokenizer(tokenizer)
        suppressed = list(contract.decode_suppressed_ids)
        self.suppress_row = self.table.allow_all_but(suppressed) if suppressed else NO_MASK
        self.constraints = ConstraintCompiler(
            self.vocab, self.table, contract.eos_id, blocked=frozenset(suppressed)
        )
        coord = contract.coord_id if contract.boundary_rule == "coord_or_eos" else None
        self.region_rows = RegionRows.register(self.table, RegionTokens(contract.eos_id, coord))
        self._path_rows: PathRows | None = None
        self._lock = threading.Lock()

    def build(self, req: GenerationRequest) -> BuiltRequest:
        """Prompt, grammar and prefix of one request; EngineError naming the bad field."""
        c, tok, mc = self.contract, self.tokenizer, self.config
        _check_settings(req, mc.text.max_context)
        try:
            if req.task is Task.CAPTION:
                prompt = prompts.caption_prompt(c, req.caption_length)
                grammar: Grammar = TextGrammar(
                    c.eos_id, req.max_tokens, row=self.suppress_row, first_row=NO_MASK
                )
            elif req.task is Task.QUERY:
                prompt = prompts.query_prompt(c, tok, req.question)
                grammar = TextGrammar(
                    c.eos_id,
                    req.max_tokens,
                    row=self.suppress_row,
                    first_row=NO_MASK,
                    constraint=self._constraint(req),
                )
            elif req.task in (Task.POINT, Task.DETECT):
                point = req.task is Task.POINT
                build = prompts.point_prompt if point else prompts.detect_prompt
                prompt = build(c, tok, req.object_name)
                make = point_grammar if point else detect_grammar
                grammar = make(self.region_rows, req.max_objects)
            else:
                prompt = prompts.segment_prompt(c, tok, req.object_name)
                grammar = SegmentGrammar(
                    self.region_rows,
                    self._segment_rows(),
                    SEGMENT_MAX_POINTS,
                    min(req.max_tokens, SEGMENT_MAX_PATH_TOKENS),
                )
        except EngineError:
            raise
        except ValueError as err:
            field = "caption_length" if req.task is Task.CAPTION else "task"
            code = (
                ErrorCode.UNIMPLEMENTED
                if "defines no segment" in str(err)
                else ErrorCode.INVALID_ARGUMENT
            )
            raise EngineError(code, str(err), field) from err
        if req.image is None:
            built = BuiltRequest([c.bos_id, *prompt], grammar, 0)
        else:
            built = BuiltRequest(prompt, grammar, mc.image_prefix_len)
        if built.total_positions > mc.text.max_context:
            field = "max_objects" if req.task in (Task.POINT, Task.DETECT) else "max_tokens"
            raise EngineError(
                ErrorCode.OUT_OF_RANGE,
                f"{field}: the prompt ({built.prefix_len + len(built.prompt)} positions) plus "
                f"the output budget ({grammar.max_positions} positions) exceeds the model "
                f"context of {mc.text.max_context}",
                field,
            )
        return built

    def _constraint(self, req: GenerationRequest) -> AutomatonRows | None:
        if req.choices and req.regex:
            raise EngineError(
                ErrorCode.INVALID_ARGUMENT, "choices: give choices or regex, not both", "choices"
            )
        field = "choices" if req.choices else "regex"
        try:
            with self._lock:
                if req.choices:
                    if any(not ch for ch in req.choices):
                        raise ValueError("choices must be non-empty strings")
                    return self.constraints.choices(req.choices)
                if req.regex is not None:
                    return self.constraints.regex(req.regex)
        except (ValueError, RuntimeError) as err:
            raise EngineError(ErrorCode.INVALID_ARGUMENT, f"{field}: {err}", field) from err
        return None

    def _segment_rows(self) -> PathRows:
        with self._lock:
            if self._path_rows is None:
                self._path_rows = self.constraints.segment_path()
            return self._path_rows


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
        raise EngineError(
            ErrorCode.INVALID_ARGUMENT,
            f"max_tokens must be at most {max_context} (the model's context), got {req.max_tokens}",
            "max_tokens",
        )
