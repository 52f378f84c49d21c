"""Caption / query text grammar: free text or text constrained by an automaton."""

from __future__ import annotations

from .grammar_base import BudgetedWalk, GrammarBase, GrammarEnd, GrammarError, StepKind
from .mask_table import NO_MASK, AutomatonRows

_TOKEN = StepKind.TOKEN  # a module constant: see grammar_base.py


class TextGrammar(GrammarBase):
    """Caption/query text: free (optionally with suppressed ids) or constrained by an automaton.

    Free text uses `row` (NO_MASK or a suppression row; `first_row` for the first token when
    it differs) and finishes with LENGTH after `max_tokens` tokens. Constrained text (regex,
    choices) uses the automaton's budget-aware rows and ends only in an accepted string.
    """

    def __init__(
        self,
        eos_id: int,
        max_tokens: int,
        row: int = NO_MASK,
        first_row: int | None = None,
        constraint: AutomatonRows | None = None,
    ) -> None:
        super().__init__()
        if max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        self._eos_id = eos_id
        self._row = row
        self._first_row = row if first_row is None else first_row
        self._remaining = max_tokens
        self._max_tokens = max_tokens
        self._walk = (
            BudgetedWalk(constraint, constraint.dfa.start, max_tokens) if constraint else None
        )
        self.token_ids: list[int] = []
        self._check_end()

    @property
    def mask_row(self) -> int:
        """Mask row of the next step (NO_MASK once finished)."""
        if self.finished:
            return NO_MASK
        if self._walk is not None:
            return self._walk.row()
        return self._row if self.token_ids else self._first_row

    @property
    def feeds_token(self) -> bool:
        """Text tokens are always fed back."""
        return True

    @property
    def max_positions(self) -> int:
        """Upper bound on positions this request feeds after its prompt."""
        return self._max_tokens

    def advance_token(self, token_id: int) -> None:
        """Commit a sampled token."""
        self._expect(_TOKEN)
        if token_id == self._eos_id:
            if self._walk is not None and not self._walk.automaton.accepting(self._walk.state):
                raise GrammarError("eos before the constraint is satisfied")
            self._finish(GrammarEnd.STOP)
            return
        if self._walk is not None:
            self._walk.step(token_id)
        self._remaining -= 1
        self.token_ids.append(token_id)
        self._check_end()

    def advance_value(self, value: object) -> None:
        """Text has no region values: always a GrammarError."""
        raise GrammarError("text requests have no region values")

    def _check_end(self) -> None:
        if self._walk is not None:
            if self._walk.only_eos():
                bound = self._walk.budget_bound()
                self._finish(GrammarEnd.LENGTH if bound else GrammarEnd.STOP)
        elif self._remaining <= 0:
            self._finish(GrammarEnd.LENGTH)
