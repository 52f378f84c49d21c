"""Every grammar path ends within its budget, whatever the model samples.

The engine launches at most `max_positions` decode steps after the prefill, so a grammar that
is not finished after `max_positions + 1` sampled steps would leave its request running until
its deadline. Hypothesis drives each kind of grammar with arbitrary allowed tokens and values.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decoding.constraints import ConstraintCompiler
from decoding.grammars import (
    Grammar,
    RegionRows,
    RegionTokens,
    SegmentGrammar,
    StepKind,
    TextGrammar,
    detect_grammar,
    point_grammar,
)
from decoding.mask_table import MaskTable
from decoding.token_masks import EOS_ONLY
from decoding.vocab import TokenVocab
from tests.support.toy_tokenizers import byte_level_bpe

EOS = 0
COORD = 5
PATTERNS = ["", "()", "a{0}", "a?", r"\d{1,3}", "[a-z]+( [a-z]+)*", "(yes|no)!*", "x{0,40}"]
CHOICES = [("yes", "no"), ("a", "a longer answer with words"), ("日本", "é")]


class Setup:
    def __init__(self) -> None:
        self.vocab = TokenVocab.from_tokenizer(byte_level_bpe())
        self.table = MaskTable(self.vocab.size + 16)
        self.compiler = ConstraintCompiler(self.vocab, self.table, EOS)
        self.regions = RegionRows.register(self.table, RegionTokens(EOS, COORD))
        self.path = self.compiler.segment_path(40)


@pytest.fixture(scope="module")
def setup() -> Setup:
    return Setup()


def _drive(setup: Setup, g: Grammar, rng: np.random.Generator, eos_p: float) -> int:
    """Run `g` to the end with random allowed choices; returns the sampled steps taken."""
    steps = 0
    while not g.finished:
        assert steps <= g.max_positions, "grammar still running past its position budget"
        steps += 1
        kind = g.next_kind
        if kind is StepKind.TOKEN:
            row = g.mask_row
            assert row != EOS_ONLY
            allowed = np.flatnonzero(setup.table.allowed(row))
            if EOS in allowed and (rng.random() < eos_p or allowed.size == 1):
                token = EOS
            else:
                token = int(rng.choice(allowed[allowed != EOS]))
            g.advance_token(token)
            if g.next_kind is StepKind.COORD_X:
                g.advance_value(float(rng.random()))
        elif kind is StepKind.COORD_Y:
            g.advance_value(float(rng.random()))
        else:
            g.advance_value((float(rng.random()) / 4, float(rng.random()) / 4))
    return steps


@settings(max_examples=120, deadline=None)
@given(
    kind=st.sampled_from(["free", "regex", "choices", "point", "detect", "segment"]),
    which=st.integers(0, 100),
    budget=st.integers(1, 24),
    seed=st.integers(0, 2**32 - 1),
    eos_p=st.sampled_from([0.0, 0.1, 0.9]),
)
def test_every_grammar_ends_within_its_budget(
    setup: Setup, kind: str, which: int, budget: int, seed: int, eos_p: float
) -> None:
    rng = np.random.default_rng(seed)
    rows = None
    if kind == "free":
        g: Grammar = TextGrammar(EOS, budget)
    elif kind in ("regex", "choices"):
        try:
            if kind == "regex":
                rows = setup.compiler.regex(PATTERNS[which % len(PATTERNS)], budget)
            else:
                rows = setup.compiler.choices(CHOICES[which % len(CHOICES)], budget)
        except ValueError:
            return  # refused up front: the budget cannot hold the shortest answer
        g = TextGrammar(EOS, budget, constraint=rows)
    elif kind == "segment":
        try:
            g = SegmentGrammar(setup.regions, setup.path, max_points=8, max_tokens=budget)
        except ValueError:
            return  # refused up front: no closed path fits the budget

    else:
        make = point_grammar if kind == "point" else detect_grammar
        g = make(setup.regions, max_objects=budget)
    try:
        steps = _drive(setup, g, rng, eos_p)
    finally:
        if rows is not None:
            setup.compiler.release(rows)
    assert steps <= g.max_positions + 1
    if isinstance(g, TextGrammar):
        assert len(g.token_ids) <= budget and g.max_positions == budget


@pytest.mark.parametrize("pattern", ["", "()", "a{0}"])
def test_an_empty_string_language_needs_no_step(setup: Setup, pattern: str) -> None:
    rows = setup.compiler.regex(pattern, 5)
    try:
        g = TextGrammar(EOS, 5, constraint=rows)
        assert g.finished and g.token_ids == []
    finally:
        setup.compiler.release(rows)
