"""Bounds on what compiling a client's constraint may cost, and the errors that enforce them.

Compiling runs on a thread that cannot be killed, so the time budget is cooperative: the
determinization, minimization and mask-compilation loops call `CompileBudget.check` and stop
with `CompileTimeout` once it has run out. Size caps are checked before any of that starts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


class ConstraintTooLarge(ValueError):
    """A constraint exceeds a size cap (a client error: INVALID_ARGUMENT)."""


class CompileTimeout(RuntimeError):
    """Compiling a constraint ran out of its time budget (RESOURCE_EXHAUSTED)."""


@dataclass(frozen=True)
class ConstraintLimits:
    """Caps on one request's choices / regex constraint; every one can be set per server."""

    max_choices: int = 1024  # number of choices
    max_choice_chars: int = 1024  # characters in one choice
    max_choices_total_chars: int = 16_384  # characters over all choices
    max_regex_chars: int = 1024  # characters in a regex
    max_constraint_states: int = 4096  # states of the determinized automaton
    max_mask_rows: int = 512  # distinct mask rows one constraint may occupy in the table
    constraint_compile_seconds: float = 2.0  # time budget of one compilation
    cache_entries: int = 256  # compiled constraints (and refusals) kept for reuse
    cache_bytes: int = 64 << 20  # and the memory they may take

    def __post_init__(self) -> None:
        for name in (
            "max_choices",
            "max_choice_chars",
            "max_choices_total_chars",
            "max_regex_chars",
            "max_constraint_states",
            "max_mask_rows",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.constraint_compile_seconds <= 0:
            raise ValueError("constraint_compile_seconds must be positive")
        if self.cache_entries < 0 or self.cache_bytes < 0:
            raise ValueError("cache_entries and cache_bytes must be >= 0")


class CompileBudget:
    """A deadline that long loops poll; `check` raises CompileTimeout once it has passed."""

    def __init__(self, seconds: float | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = seconds
        self._clock = clock
        self._deadline = None if seconds is None else clock() + seconds

    def check(self) -> None:
        """Raise CompileTimeout if the budget is spent."""
        if self._deadline is not None and self._clock() > self._deadline:
            raise CompileTimeout(
                f"compiling the constraint took longer than its {self.seconds:g} s budget "
                "(constraint_compile_seconds); simplify it or retry later"
            )


UNLIMITED = CompileBudget(None)
