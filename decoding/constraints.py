"""One place that turns request constraints into registered automata (cached, deduplicated)."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .automaton import Dfa, choices_dfa
from .mask_table import AutomatonRows, MaskTable
from .regex_dfa import regex_dfa
from .region_grammars import PathRows
from .svg_path import DEFAULT_GRID, PathLanguage
from .token_masks import MaskCache, compile_masks
from .vocab import TokenVocab


@functools.lru_cache(maxsize=256)
def _regex_dfa(pattern: str) -> Dfa:
    # Repeated request patterns skip parsing and determinization (DFAs are never mutated).
    return regex_dfa(pattern)


@dataclass
class ConstraintCompiler:
    """Compiles regex / choices / path constraints for one vocabulary into one mask table.

    `blocked` ids are never allowed inside constrained text (e.g. ids a task suppresses).
    The default cache is memory only; pass `MaskCache()` to also keep compiled masks on disk
    (under the user cache directory) across restarts.
    Compiling is CPU work proportional to the automaton size (tens of ms to about a second
    for a 51,200-token vocabulary): do it off the scheduler thread, at request validation.
    """

    vocab: TokenVocab
    table: MaskTable
    eos_id: int
    cache: MaskCache = field(default_factory=lambda: MaskCache(use_disk=False))
    blocked: frozenset[int] = field(default_factory=frozenset)

    def automaton(self, dfa: Dfa) -> AutomatonRows:
        """Register any byte DFA."""
        compiled = compile_masks(
            dfa, self.vocab, self.eos_id, self.table.width, self.blocked, self.cache
        )
        return self.table.register(compiled, self.vocab.text_pieces())

    def regex(self, pattern: str) -> AutomatonRows:
        """Rows for a full-match regex (see regex_dfa.py for the supported subset)."""
        return self.automaton(_regex_dfa(pattern))

    def choices(self, choices: Iterable[str]) -> AutomatonRows:
        """Rows for "exactly one of these strings"."""
        return self.automaton(choices_dfa(choices))

    def segment_path(self, grid: int = DEFAULT_GRID) -> PathRows:
        """Rows for the segment path language on a `grid`."""
        pieces: Sequence[bytes | None] = self.vocab.text_pieces()
        language = PathLanguage.for_vocab(grid, pieces)
        return PathRows(language, self.automaton(language.dfa))
