"""What every grammar shares: step kinds, finish reasons, value checks, the budgeted walk."""

from __future__ import annotations

import enum
import numbers

from .mask_table import AutomatonRows
from .token_masks import EOS_ONLY


class StepKind(enum.IntEnum):
    """What the next step of a request produces."""

    TOKEN = 0
    COORD_X = 1
    COORD_Y = 2
    SIZE = 3
    DONE = 4
    # Reasoning text: sample a token; the coordinate token also takes x decoded from the same
    # hidden state (advance_token, then advance_value), and x's embedding is the next input.
    REASON = 5


class GrammarEnd(enum.Enum):
    """How a grammar closed its answer (the engine maps it to the API's FinishReason)."""

    STOP = "stop"  # eos, or the constraint allows nothing else
    LENGTH = "length"  # a token, object or point budget closed the answer


# Hot paths compare with module constants: looking up an enum member on its class costs
# several times the comparison, and a grammar commits once per row of every step.
_TOKEN, _DONE = StepKind.TOKEN, StepKind.DONE


class GrammarError(ValueError):
    """A commit that the grammar's mask would never have allowed (an engine bug)."""


def coordinate_value(value: object) -> float:
    """A committed coordinate as a float (GrammarError if it is not a number)."""
    if not isinstance(value, numbers.Real):
        raise GrammarError(f"expected a coordinate (float), got {value!r}")
    return float(value)


def size_value(value: object) -> tuple[float, float]:
    """A committed size as (w, h) (GrammarError if it is not a pair)."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise GrammarError(f"expected a size (w, h), got {value!r}")
    return float(value[0]), float(value[1])


class GrammarBase:
    """Shared bookkeeping of every grammar: the next step kind and the finish state."""

    def __init__(self) -> None:
        self.next_kind = _TOKEN
        self.finish_reason: GrammarEnd | None = None

    @property
    def finished(self) -> bool:
        """No further step is needed."""
        return self.next_kind is _DONE

    def _finish(self, reason: GrammarEnd) -> None:
        self.next_kind = _DONE
        self.finish_reason = reason

    def _expect(self, kind: StepKind) -> None:
        if self.next_kind is not kind:
            raise GrammarError(f"expected a {self.next_kind.name} commit, got {kind.name}")


class BudgetedWalk:
    """A walk of an automaton over tokens with a token budget (text constraints and paths)."""

    def __init__(self, automaton: AutomatonRows, state: int, max_tokens: int) -> None:
        if automaton.dist(state) > max_tokens:
            raise ValueError(
                f"max_tokens={max_tokens} is too small: the constraint needs at least "
                f"{automaton.dist(state)} tokens"
            )
        self.automaton = automaton
        self.state = state
        self.remaining = max_tokens

    def row(self) -> int:
        """Global mask row for the next token (EOS_ONLY: only eos is left)."""
        return self.automaton.row(self.state, self.remaining)

    def only_eos(self) -> bool:
        """Whether nothing but eos can follow."""
        return self.row() == EOS_ONLY

    def budget_bound(self) -> bool:
        """Whether the budget (not the language) is what leaves only eos."""
        return self.automaton.row(self.state, 1 << 30) != EOS_ONLY

    def step(self, token_id: int) -> None:
        """Take one token (GrammarError if the mask would not have allowed it)."""
        try:
            self.state = self.automaton.step(self.state, token_id, self.remaining)
        except ValueError as exc:
            raise GrammarError(str(exc)) from None
        self.remaining -= 1
