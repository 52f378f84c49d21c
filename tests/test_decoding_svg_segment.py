"""Moondream 3's segment grammar over a real vocabulary: its masks (precomputed rows: eos only
where the path may end, the budget always leaves a way to finish), its commits, and answers
that always parse under random weights, equal to the path read back from the token ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decoding.batch_masks import apply_masks, fill_row_indices, table_tensor
from decoding.constraints import ConstraintCompiler
from decoding.grammars import (
    GrammarEnd,
    GrammarError,
    RegionRows,
    RegionTokens,
    StepKind,
    SvgTokenSegmentGrammar,
)
from decoding.mask_table import NO_MASK, MaskTable
from decoding.sampling import sample
from decoding.svg_tokens import decode_items, item_kind, parse_items, path_text, token_items
from decoding.vocab import TokenVocab
from vlm_server.models.common.tokenizer_build import build_tokenizer
from vlm_server.models.registry import preset

EOS, COORD = 0, 5


class Setup:
    """The tiny Moondream 3 vocabulary's tokenizer, table and rows, as the engine builds them."""

    def __init__(self) -> None:
        self.tokenizer = build_tokenizer(preset("tiny"), seed=1)  # seed 1 spells "22" too
        self.vocab = TokenVocab.from_tokenizer(self.tokenizer)
        self.width = 1024
        self.table = MaskTable(self.width)
        compiler = ConstraintCompiler(self.vocab, self.table, EOS)
        self.region = RegionRows.register(self.table, RegionTokens(EOS, COORD))
        self.items = token_items(self.tokenizer, self.vocab.special_ids)
        before = len(self.table)
        self.rows = compiler.svg_token_path(self.items)
        self.path_rows = len(self.table) - before
        self.device_table = table_tensor(self.table)

    def ids(self, *items: str) -> list[int]:
        """The first id of each item ("" for a whitespace token)."""
        return [self.items.index(item) for item in items]

    def allowed(self, row: int) -> set[int]:
        return set(np.flatnonzero(self.table.allowed(row)).tolist())

    def kinds(self, row: int) -> set[str | None]:
        return {
            item_kind(self.items[i]) if self.items[i] is not None else i for i in self.allowed(row)
        }  # type: ignore[misc]


@pytest.fixture(scope="module")
def setup() -> Setup:
    return Setup()


def _boxed(setup: Setup, max_tokens: int) -> SvgTokenSegmentGrammar:
    g = SvgTokenSegmentGrammar(setup.region, setup.rows, max_tokens)
    assert g.mask_row == setup.region.segment_start and not g.feeds_token
    g.advance_token(COORD)
    for value in (0.5, 0.25, (0.5, 0.2)):
        assert g.mask_row == NO_MASK
        g.advance_value(value)
    assert g.in_path and g.feeds_token and g.next_kind is StepKind.TOKEN
    return g


def test_the_path_rows_are_few_and_pinned(setup: Setup) -> None:
    assert 0 < setup.path_rows < 200
    assert setup.table.live_rows == len(setup.table)


def test_masks_allow_a_path_start_then_eos_only_where_it_may_end(setup: Setup) -> None:
    g = _boxed(setup, 40)
    assert setup.kinds(g.mask_row) == {"M", "m", " "}  # no eos: the path is empty
    for text in ("M", "3", "", "7"):
        assert EOS not in setup.allowed(g.mask_row)
        g.advance_token(setup.ids(text)[0])
    assert EOS in setup.allowed(g.mask_row)
    assert g.chunks == ["M 0.003 0.007"]
    assert setup.kinds(g.mask_row) >= {"L", "A", "z", "-", "0", "#", " "}
    g.advance_token(setup.ids("A")[0])
    for text in ("4", "5", "-", "2"):  # rx, ry, then a negative angle
        g.advance_token(setup.ids(text)[0])
    assert setup.kinds(g.mask_row) == {"0", " "}  # a flag: 0 or 1 only
    for text in ("1", "0", "9", "22"):
        g.advance_token(setup.ids(text)[0])
    g.advance_token(EOS)
    assert g.finished and g.finish_reason is GrammarEnd.STOP
    assert "".join(g.chunks) == "M 0.003 0.007 A 0.004 0.005 -2 1 0 0.009 0.023"
    assert g.box == (0.25, 0.15, 0.75, 0.35)


def test_the_budget_always_leaves_a_way_to_finish(setup: Setup) -> None:
    g = _boxed(setup, 3)
    assert setup.kinds(g.mask_row) == {"M", "m"}  # no whitespace: M x y takes all three
    g.advance_token(setup.ids("m")[0])
    assert setup.kinds(g.mask_row) == {"0", "#"}  # a minus would need a fourth token
    g.advance_token(setup.ids("22")[0])
    g.advance_token(setup.ids("0")[0])
    assert g.finished and g.finish_reason is GrammarEnd.LENGTH
    assert "".join(g.chunks) == "m 0.023 0"
    with pytest.raises(ValueError, match="too small"):
        SvgTokenSegmentGrammar(setup.region, setup.rows, 2)


def test_commits_the_masks_forbid_are_errors(setup: Setup) -> None:
    g = SvgTokenSegmentGrammar(setup.region, setup.rows, 10)
    with pytest.raises(GrammarError):
        g.advance_token(EOS)  # no box yet
    with pytest.raises(GrammarError):
        g.advance_token(setup.ids("M")[0])  # the box starts with the coordinate token
    g = _boxed(setup, 10)
    for bad in [EOS, *setup.ids("L", "3", "e", "$")]:
        with pytest.raises(GrammarError):
            g.advance_token(bad)
    with pytest.raises(GrammarError):
        g.advance_value(0.5)
    g.advance_token(setup.ids("M")[0])
    with pytest.raises(GrammarError, match="result"):
        g.result((4, 4))


def _run_batch(setup: Setup, grammars: list[SvgTokenSegmentGrammar], seed: int) -> None:
    """Drive the grammars to their end as the engine does: random logits, masked sampling."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    b = len(grammars)
    index = np.zeros(b, dtype=np.int32)
    temperature = torch.rand(b, generator=gen) * 1.5
    temperature[::3] = 0.0
    seeds = torch.randint(0, 2**62, (b,), generator=gen)
    for step in range(300):
        if all(g.finished for g in grammars):
            return
        token_rows = [g if g.next_kind is StepKind.TOKEN else None for g in grammars]
        fill_row_indices(token_rows, index)  # type: ignore[arg-type]
        logits = torch.randn(b, setup.width, generator=gen) * 4
        masked = apply_masks(logits, torch.from_numpy(index), setup.device_table)
        ids = sample(masked, temperature, torch.ones(b), seeds, torch.full((b,), step)).tolist()
        for row, g in enumerate(grammars):
            kind = g.next_kind
            if kind is StepKind.TOKEN:
                assert setup.table.allowed(int(index[row]))[ids[row]]
                g.advance_token(ids[row])
                if g.next_kind is StepKind.COORD_X:
                    g.advance_value(rng.integers(0, 1024) / 1023)
            elif kind is StepKind.COORD_Y:
                g.advance_value(rng.integers(0, 1024) / 1023)
            elif kind is StepKind.SIZE:
                g.advance_value(tuple(2.0 ** (rng.integers(0, 1024, size=2) / 1023 * 10 - 10)))
    raise AssertionError("grammars did not finish")


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31))
def test_random_weights_always_give_a_path_that_parses(setup: Setup, seed: int) -> None:
    grammars = [SvgTokenSegmentGrammar(setup.region, setup.rows, 3 + k * 4) for k in range(12)]
    _run_batch(setup, grammars, seed)
    for k, g in enumerate(grammars):
        assert len(g.path_ids) <= 3 + k * 4
        groups = parse_items(decode_items(setup.tokenizer, g.path_ids))
        assert groups == g.parser.groups
        assert "".join(g.chunks) == path_text(groups)
        seg = g.result((16, 12))
        assert seg.box_path == path_text(groups) and sum(seg.mask_counts) == 16 * 12
        if g.finish_reason is GrammarEnd.LENGTH:
            assert len(g.path_ids) == 3 + k * 4
