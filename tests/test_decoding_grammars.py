"""Grammars under random weights: a tiny batched engine loop (masks -> sample -> commit) must
always finish within budget with an answer that parses."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decoding.batch_masks import apply_masks, fill_row_indices, table_tensor
from decoding.constraints import ConstraintCompiler
from decoding.detokenize import detokenize
from decoding.grammars import (
    Grammar,
    GrammarEnd,
    GrammarError,
    ObjectGrammar,
    PathRows,
    RegionRows,
    RegionTokens,
    SegmentGrammar,
    StepKind,
    TextGrammar,
    detect_grammar,
    point_grammar,
)
from decoding.mask_table import NO_MASK, MaskTable
from decoding.sampling import sample
from decoding.svg_path import PathLanguage, parse_path
from decoding.vocab import TokenVocab
from tests.support.threads import one_torch_thread  # noqa: F401  (autouse)
from tests.support.toy_tokenizers import byte_level_bpe

EOS = 0
COORD = 5  # stands in for the 2025-06 coord token
PAD = 16
GRID = 100
REGEXES = [
    r"\d{3}-\d{4}",
    r"(yes|no)[.!]?",
    r"[a-z]+( [a-z]+){0,3}\.",
    r"\$\d{1,3}(\.\d\d)?",
    r"(é|日本|ok)+",
    r"[A-Z][a-z]*( [a-z]+)*",
]
CHOICES = ["yes", "no", "maybe later", "Zürich", "日本"]


class Setup:
    def __init__(self) -> None:
        self.vocab = TokenVocab.from_tokenizer(byte_level_bpe())
        self.width = self.vocab.size + PAD
        self.table = MaskTable(self.width)
        self.compiler = ConstraintCompiler(self.vocab, self.table, EOS)
        self.gpt2 = RegionRows.register(self.table, RegionTokens(EOS))
        self.starmie = RegionRows.register(self.table, RegionTokens(EOS, COORD))
        self.path = self.compiler.segment_path(GRID)
        self.regexes = {p: self.compiler.regex(p) for p in REGEXES}
        self.choices = self.compiler.choices(CHOICES)
        self.suppress = self.table.allow_all_but([3, 7])
        self.device_table = table_tensor(self.table)


@pytest.fixture(scope="module")
def setup() -> Setup:
    return Setup()


def run_batch(setup: Setup, grammars: list, seed: int, max_steps: int = 400) -> None:
    """Drive all grammars to completion as an engine would, with random logits and values."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    b = len(grammars)
    index = np.zeros(b, dtype=np.int32)
    temperature = torch.rand(b, generator=gen) * 1.5
    temperature[::3] = 0.0
    top_p = torch.rand(b, generator=gen) * 0.9 + 0.1
    seeds = torch.randint(0, 2**62, (b,), generator=gen)
    for step in range(max_steps):
        live = [g for g in grammars if not g.finished]
        if not live:
            return
        token_rows = [g if g.next_kind is StepKind.TOKEN else None for g in grammars]
        fill_row_indices(token_rows, index)
        logits = torch.randn(b, setup.width, generator=gen) * 4
        masked = apply_masks(logits, torch.from_numpy(index), setup.device_table)
        ids = sample(masked, temperature, top_p, seeds, torch.full((b,), step)).tolist()
        for row, g in enumerate(grammars):
            if g.finished:
                continue
            kind = g.next_kind
            if kind is StepKind.TOKEN:
                assert setup.table.allowed(int(index[row]))[ids[row]]
                g.advance_token(ids[row])
                if g.next_kind is StepKind.COORD_X:
                    g.advance_value(rng.integers(0, 1024) / 1024)
            elif kind is StepKind.COORD_Y:
                g.advance_value(rng.integers(0, 1024) / 1024)
            elif kind is StepKind.SIZE:
                g.advance_value(tuple(2.0 ** (rng.integers(0, 1024, size=2) / 1023 * 10 - 10)))
    raise AssertionError("grammars did not finish")


# ---------------------------------------------------------------- text


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31), st.integers(0, 20))
def test_regex_text_always_fullmatches(setup: Setup, seed: int, extra: int) -> None:
    grammars, patterns = [], []
    for k, pattern in enumerate(REGEXES * 3):
        rows = setup.regexes[pattern]
        need = rows.dist(rows.dfa.start)
        grammars.append(TextGrammar(EOS, need + (extra + k) % 12, constraint=rows))
        patterns.append(pattern)
    run_batch(setup, grammars, seed)
    for g, pattern in zip(grammars, patterns, strict=True):
        text = detokenize(setup.vocab, g.token_ids)
        assert re.fullmatch(pattern, text, re.ASCII), (pattern, text)
        assert len(g.token_ids) <= g.max_positions
        assert g.finish_reason in (GrammarEnd.STOP, GrammarEnd.LENGTH)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31))
def test_choices_text_is_one_of_the_choices(setup: Setup, seed: int) -> None:
    grammars = [TextGrammar(EOS, 3 + k % 6, constraint=setup.choices) for k in range(16)]
    run_batch(setup, grammars, seed)
    for g in grammars:
        assert detokenize(setup.vocab, g.token_ids) in CHOICES


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**31))
def test_free_text_respects_budget_and_suppression(setup: Setup, seed: int) -> None:
    first = setup.table.allow_all_but([EOS])
    grammars = [TextGrammar(EOS, k % 9, row=setup.suppress, first_row=first) for k in range(16)]
    run_batch(setup, grammars, seed)
    for k, g in enumerate(grammars):
        assert len(g.token_ids) <= k % 9
        assert not {3, 7} & set(g.token_ids[1:])
        if len(g.token_ids) == k % 9:
            assert g.finish_reason is GrammarEnd.LENGTH


def test_text_grammar_rows_and_errors(setup: Setup) -> None:
    g = TextGrammar(EOS, 4)
    assert g.mask_row == NO_MASK and g.feeds_token and g.next_kind is StepKind.TOKEN
    g.advance_token(10)
    g.advance_token(EOS)
    assert g.finished and g.finish_reason is GrammarEnd.STOP
    with pytest.raises(GrammarError):
        g.advance_token(10)
    assert TextGrammar(EOS, 0).finished

    rows = setup.regexes[r"\d{3}-\d{4}"]
    with pytest.raises(ValueError, match="too small"):
        TextGrammar(EOS, rows.dist(rows.dfa.start) - 1, constraint=rows)
    g = TextGrammar(EOS, 20, constraint=rows)
    with pytest.raises(GrammarError):
        g.advance_token(EOS)  # not accepting yet
    letter = next(i for i, p in enumerate(setup.vocab.text_pieces()) if p == b"a")
    with pytest.raises(GrammarError):
        g.advance_token(letter)


def test_choice_finishes_without_an_eos_step(setup: Setup) -> None:
    g = TextGrammar(EOS, 10, constraint=setup.compiler.choices(["no"]))
    for piece in (b"n", b"o"):
        g.advance_token(setup.vocab.text_pieces().index(piece))
    assert g.finished and g.finish_reason is GrammarEnd.STOP


# ---------------------------------------------------------------- point / detect


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**31))
def test_point_and_detect_under_both_contracts(setup: Setup, seed: int) -> None:
    grammars: list[ObjectGrammar] = []
    for k in range(16):
        rows = setup.gpt2 if k % 2 else setup.starmie
        make = point_grammar if k % 4 < 2 else detect_grammar
        grammars.append(make(rows, max_objects=k % 5))
    run_batch(setup, grammars, seed)
    for k, g in enumerate(grammars):
        assert len(g.objects) <= k % 5
        for obj in g.objects:
            if len(obj) == 2:
                assert all(0 <= v < 1 for v in obj)
            else:
                x0, y0, x1, y1 = obj
                assert x0 <= x1 and y0 <= y1 and x1 - x0 <= 1 and y1 - y0 <= 1
        if len(g.objects) == k % 5:
            assert g.finish_reason is GrammarEnd.LENGTH


def test_detect_protocol_step_by_step(setup: Setup) -> None:
    g = detect_grammar(setup.starmie, max_objects=2)
    # The reference's boundary: the whole vocabulary; eos stops, any other token continues.
    assert g.mask_row == NO_MASK and not g.feeds_token
    g.advance_token(COORD)
    assert g.next_kind is StepKind.COORD_X
    with pytest.raises(GrammarError):
        g.advance_token(COORD)
    g.advance_value(0.5)
    assert g.next_kind is StepKind.COORD_Y
    g.advance_value(0.25)
    assert g.next_kind is StepKind.SIZE
    g.advance_value((0.5, 0.25))
    assert g.objects == [(0.25, 0.125, 0.75, 0.375)]
    assert g.next_kind is StepKind.TOKEN
    g.advance_token(EOS)
    assert g.finished and g.finish_reason is GrammarEnd.STOP
    assert point_grammar(setup.gpt2, max_objects=0).finished


@pytest.mark.parametrize("contract", ["gpt2", "starmie"])
def test_boundary_is_unmasked_under_both_contracts(setup: Setup, contract: str) -> None:
    g = point_grammar(getattr(setup, contract), max_objects=3)
    assert g.mask_row == NO_MASK
    g.advance_token(COORD + 7)  # neither coord nor eos: still "next object", as the reference
    assert g.next_kind is StepKind.COORD_X
    assert g.max_positions == 6


# ---------------------------------------------------------------- segment


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**31))
def test_segment_always_parses(setup: Setup, seed: int) -> None:
    rng = np.random.default_rng(seed)
    grammars, limits = [], []
    for k in range(12):
        rows = setup.gpt2 if k % 2 else setup.starmie
        max_points = int(rng.integers(1, 12))
        max_tokens = int(rng.integers(8, 60))
        grammars.append(SegmentGrammar(rows, setup.path, max_points, max_tokens))
        limits.append((max_points, max_tokens))
    run_batch(setup, grammars, seed)
    for g, (max_points, _) in zip(grammars, limits, strict=True):
        subpaths = parse_path(g.path_text, GRID)
        assert sum(len(c.points) for sub in subpaths for c in sub) <= max_points
        result = g.result((40, 30))
        assert sum(result.mask_counts) == 40 * 30
        x0, y0, x1, y1 = result.box
        for polygon in result.polygons:
            for x, y in polygon:
                assert x0 - 1e-9 <= x <= x1 + 1e-9 and y0 - 1e-9 <= y <= y1 + 1e-9


def test_segment_protocol(setup: Setup) -> None:
    g = SegmentGrammar(setup.starmie, setup.path, max_points=4, max_tokens=40)
    assert np.flatnonzero(setup.table.allowed(g.mask_row)).tolist() == [COORD]
    assert not g.feeds_token
    with pytest.raises(GrammarError):
        g.advance_token(EOS)
    g.advance_token(COORD)
    g.advance_value(0.5)
    g.advance_value(0.5)
    g.advance_value((0.5, 0.5))
    assert g.feeds_token and g.next_kind is StepKind.TOKEN
    assert not setup.table.allowed(g.mask_row)[EOS]
    gpt2 = SegmentGrammar(setup.gpt2, setup.path)
    allowed = setup.table.allowed(gpt2.mask_row)
    assert not allowed[EOS] and allowed.sum() == setup.width - 1


def test_segment_saturated_count_matches_exact_count(setup: Setup) -> None:
    """Rows of the saturating path automaton equal those of an exact-count one, step by step."""
    exact_lang = PathLanguage(GRID, 40)
    exact = PathRows(exact_lang, setup.compiler.automaton(exact_lang.dfa))
    rng = np.random.default_rng(0)
    for trial in range(30):
        max_points = int(rng.integers(1, 30))
        a = SegmentGrammar(setup.gpt2, setup.path, max_points, 80)
        b = SegmentGrammar(setup.gpt2, exact, max_points, 80)
        for g in (a, b):
            g.advance_token(1)
            g.advance_value(0.5)
            g.advance_value(0.5)
            g.advance_value((0.5, 0.5))
        while not a.finished:
            allowed = setup.table.allowed(a.mask_row)
            assert np.array_equal(allowed, setup.table.allowed(b.mask_row)), trial
            token = int(rng.choice(np.flatnonzero(allowed)))
            a.advance_token(token)
            b.advance_token(token)
        assert b.finished and a.path_text == b.path_text


def test_values_are_validated(setup: Setup) -> None:
    g = point_grammar(setup.starmie, max_objects=1)
    g.advance_token(COORD)
    with pytest.raises(GrammarError):
        g.advance_value((0.1, 0.2))  # a size where a coordinate is due
    g.advance_value(np.float32(0.5))
    g.advance_value(0.25)
    assert g.objects == [(0.5, 0.25)] and g.finished
    assert g.finish_reason is GrammarEnd.LENGTH and g.mask_row == NO_MASK
    d = detect_grammar(setup.starmie, max_objects=1)
    d.advance_token(COORD)
    d.advance_value(0.5)
    assert d.mask_row == NO_MASK  # no token is sampled on a coordinate step
    d.advance_value(0.5)
    with pytest.raises(GrammarError):
        d.advance_value(0.5)


def test_every_grammar_conforms_to_the_protocol(setup: Setup) -> None:
    members = {n for n in vars(Grammar) if not n.startswith("_")} | set(Grammar.__annotations__)
    assert {"mask_row", "advance_token", "advance_value", "next_kind", "finished"} <= members
    grammars = [
        TextGrammar(EOS, 3),
        point_grammar(setup.gpt2),
        detect_grammar(setup.starmie),
        SegmentGrammar(setup.gpt2, setup.path),
    ]
    for g in grammars:
        for name in members:
            assert hasattr(g, name), (type(g).__name__, name)
