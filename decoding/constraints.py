"""One place that turns request constraints into registered automata: bounded, cached, shared.

A request's choices or regex is checked against `ConstraintLimits` before anything is built,
then against the request's token budget with a cheap lower bound (shortest answer in bytes /
longest token in bytes), then compiled under a cooperative time budget. Compiled constraints
(and refusals) are cached by the constraint itself, so a repeated one costs a dictionary look-up
and a row registration. Every `choices` / `regex` result holds references on mask-table rows
until `release`.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .automaton import Dfa, choices_dfa
from .compile_pool import CompileCancelled, CompileJob, CompilePool
from .limits import UNLIMITED, CompileBudget, CompileTimeout, ConstraintLimits, ConstraintTooLarge
from .mask_table import AutomatonRows, MaskTable
from .regex_dfa import parse_regex, regex_dfa, shortest_match_bytes
from .region_grammars import PathRows
from .svg_path import DEFAULT_GRID, PathLanguage
from .svg_segment_grammar import SvgTokenRows
from .svg_token_dfa import kind_vocab, path_dfa
from .token_masks import MAX_ROWS, CompiledMasks, MaskCache, compile_masks
from .vocab import TokenVocab

_Key = tuple[str, str | tuple[str, ...]]
_Refusal = tuple[type[Exception], str]


class BudgetTooSmall(ValueError):
    """The token budget (max_tokens) cannot hold the shortest answer of the constraint."""


@dataclass
class ConstraintCompiler:
    """Compiles regex / choices / path constraints for one vocabulary into one mask table.

    `blocked` ids are never allowed inside constrained text (e.g. ids a task suppresses).
    The default mask cache is memory only; pass `MaskCache()` to also keep compiled masks on
    disk (under the user cache directory) across restarts. Compiling is CPU work proportional
    to the automaton size times the vocabulary: call it off the scheduler thread. With
    ``in_child``, client constraints (choices, regex) compile in a child process
    (compile_pool.py), so they never hold this process's GIL, and `cancel` can stop one.
    """

    vocab: TokenVocab
    table: MaskTable
    eos_id: int
    cache: MaskCache = field(default_factory=lambda: MaskCache(use_disk=False))
    blocked: frozenset[int] = field(default_factory=frozenset)
    limits: ConstraintLimits = field(default_factory=ConstraintLimits)
    in_child: bool = False

    def __post_init__(self) -> None:
        self.pool: CompilePool | None = None
        if self.in_child:
            job = CompileJob(
                self.vocab,
                self.eos_id,
                self.table.width,
                frozenset(self.blocked),
                self.limits.max_constraint_states,
                min(self.limits.max_mask_rows, MAX_ROWS),
            )
            self.pool = CompilePool(job)
        pieces = [p for p in self.vocab.text_pieces() if p]
        self._longest_piece = max((len(p) for p in pieces), default=1)
        self._compiled: OrderedDict[_Key, CompiledMasks | _Refusal] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()

    # ---- request constraints (reference-counted rows) ------------------------------------

    def choices(self, choices: Sequence[str], max_tokens: int | None = None) -> AutomatonRows:
        """Rows for "exactly one of these strings"; `release` them when the request ends."""
        lim = self.limits
        if not choices:
            raise ValueError("must not be empty")
        if len(choices) > lim.max_choices:
            raise ConstraintTooLarge(
                f"at most {lim.max_choices} choices (max_choices), got {len(choices)}"
            )
        if any(not c for c in choices):
            raise ValueError("choices must be non-empty strings")
        longest = max(len(c) for c in choices)
        if longest > lim.max_choice_chars:
            raise ConstraintTooLarge(
                f"a choice is {longest} characters long; the limit is {lim.max_choice_chars} "
                "(max_choice_chars)"
            )
        total = sum(len(c) for c in choices)
        if total > lim.max_choices_total_chars:
            raise ConstraintTooLarge(
                f"the choices hold {total} characters; the limit is "
                f"{lim.max_choices_total_chars} (max_choices_total_chars)"
            )
        self._check_fits(min(len(c.encode("utf-8")) for c in choices), max_tokens)
        key: _Key = ("choices", tuple(choices))
        return self._register(key, lambda budget: choices_dfa(choices, budget), max_tokens)

    def regex(self, pattern: str, max_tokens: int | None = None) -> AutomatonRows:
        """Rows for a full-match regex (see regex_dfa.py for the supported subset)."""
        lim = self.limits
        if len(pattern) > lim.max_regex_chars:
            raise ConstraintTooLarge(
                f"the regex is {len(pattern)} characters long; the limit is {lim.max_regex_chars} "
                "(max_regex_chars)"
            )
        tree = parse_regex(pattern)  # linear in the pattern: syntax errors before any cost
        shortest = shortest_match_bytes(tree)
        if shortest is None:
            raise ValueError("the regex matches nothing")
        self._check_fits(shortest, max_tokens)
        key: _Key = ("regex", pattern)

        def build(budget: CompileBudget) -> Dfa:
            return regex_dfa(tree, lim.max_constraint_states, budget)

        return self._register(key, build, max_tokens)

    def release(self, rows: AutomatonRows) -> None:
        """Give back the rows a `choices` / `regex` call took."""
        self.table.release(rows)

    def cancel(self, choices: Sequence[str], regex: str | None) -> None:
        """Stop compiling this constraint, if a child is doing so now (its requester went
        away): the `choices` / `regex` call waiting for it raises CompileCancelled."""
        if self.pool is not None:
            self.pool.cancel(("choices", tuple(choices)) if choices else ("regex", regex or ""))

    def warm(self) -> None:
        """Start the compiling child now (blocks for its start-up; a no-op in process)."""
        if self.pool is not None:
            self.pool.warm()

    def close(self) -> None:
        """Stop the compiling child, if any."""
        if self.pool is not None:
            self.pool.close()

    # ---- built-in languages (pinned rows) ---------------------------------------------------

    def automaton(self, dfa: Dfa, vocab: TokenVocab | None = None) -> AutomatonRows:
        """Register any byte DFA for good (built-in languages; no limits apply), over this
        vocabulary's pieces or a stand-in ``vocab`` of the same ids."""
        vocab = vocab or self.vocab
        compiled = compile_masks(
            dfa, vocab, self.eos_id, self.table.width, self.blocked, self.cache
        )
        rows = self.table.register(compiled, vocab.text_pieces())
        self.table.pin(rows)
        return rows

    def segment_path(self, grid: int = DEFAULT_GRID) -> PathRows:
        """Rows for the segment path language on a `grid`, pinned."""
        pieces: Sequence[bytes | None] = self.vocab.text_pieces()
        language = PathLanguage.for_vocab(grid, pieces)
        return PathRows(language, self.automaton(language.dfa))

    def svg_token_path(self, items: Sequence[str | None]) -> SvgTokenRows:
        """Rows for Moondream 3's segment path (svg_tokens.py), pinned; ``items`` is each id's
        item (`svg_tokens.token_items`), seen as a vocabulary of item kinds."""
        return SvgTokenRows(self.automaton(path_dfa(), kind_vocab(items)), tuple(items))

    # ---- internals --------------------------------------------------------------------------

    def _check_fits(self, shortest_bytes: int, max_tokens: int | None) -> None:
        # No token carries more than the longest piece, so this many tokens at least.
        need = math.ceil(shortest_bytes / self._longest_piece)
        if max_tokens is not None and need > max_tokens:
            raise BudgetTooSmall(
                f"max_tokens={max_tokens} cannot hold the shortest answer (at least {need} tokens)"
            )

    def _register(
        self, key: _Key, build: Callable[[CompileBudget], Dfa], max_tokens: int | None
    ) -> AutomatonRows:
        compiled = self._compile(key, build)
        rows = self.table.register(compiled, self.vocab.text_pieces())
        need = rows.dist(rows.dfa.start)
        if max_tokens is not None and need > max_tokens:
            self.table.release(rows)
            raise BudgetTooSmall(
                f"max_tokens={max_tokens} cannot hold the shortest answer ({need} tokens)"
            )
        return rows

    def _compile(self, key: _Key, build: Callable[[CompileBudget], Dfa]) -> CompiledMasks:
        with self._lock:
            hit = self._compiled.get(key)
            if hit is None:
                hit = self._compile_uncached(key, build)
                self._remember(key, hit)
            else:
                self._compiled.move_to_end(key)
        if isinstance(hit, tuple):
            kind, message = hit
            raise kind(message)
        return hit

    def _remember(self, key: _Key, entry: CompiledMasks | _Refusal) -> None:
        # Bounded by entries and by bytes: at 51,200 tokens one mask row is 6.4 KB.
        size = _nbytes(entry)
        if not self.limits.cache_entries or size > self.limits.cache_bytes:
            return
        self._compiled[key] = entry
        self._cached_bytes += size
        while (
            len(self._compiled) > self.limits.cache_entries
            or self._cached_bytes > self.limits.cache_bytes
        ):
            _, dropped = self._compiled.popitem(last=False)
            self._cached_bytes -= _nbytes(dropped)

    def _compile_uncached(
        self, key: _Key, build: Callable[[CompileBudget], Dfa]
    ) -> CompiledMasks | _Refusal:
        # Refusals are cached too: a client repeating a costly constraint gets its answer
        # at once instead of another full budget of compile time. A cancelled compilation
        # (CompileCancelled) is neither.
        budget = CompileBudget(self.limits.constraint_compile_seconds)
        try:
            if self.pool is not None:
                return self.pool.compile(key, self.limits.constraint_compile_seconds)
            return compile_masks(
                build(budget),
                self.vocab,
                self.eos_id,
                self.table.width,
                self.blocked,
                self.cache,
                max_rows=min(self.limits.max_mask_rows, MAX_ROWS),
                budget=budget,
            )
        except (CompileTimeout, ValueError) as err:
            return type(err), str(err)


def _nbytes(entry: CompiledMasks | _Refusal) -> int:
    if isinstance(entry, tuple):
        return len(entry[1])
    arrays = (entry.rows, entry.dist, entry.level_base, entry.level_ptr, entry.level_rows)
    return sum(a.nbytes for a in arrays) + entry.dfa.trans.nbytes


__all__ = [
    "UNLIMITED",
    "BudgetTooSmall",
    "CompileCancelled",
    "CompileTimeout",
    "ConstraintCompiler",
    "ConstraintLimits",
    "ConstraintTooLarge",
]
