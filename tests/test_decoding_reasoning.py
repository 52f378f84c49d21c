"""The reasoning grammar on its own: the reference's protocol, spans, budgets, refusals."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decoding.grammars import (
    GrammarError,
    ReasoningGrammar,
    ReasoningRows,
    ReasoningTokens,
    StepKind,
    TextGrammar,
)
from decoding.mask_table import NO_MASK, MaskTable

T = ReasoningTokens(
    eos_id=0,
    answer_id=3,
    coord_id=5,
    size_id=6,
    start_ground_points_id=7,
    end_ground_id=9,
    suppressed=(0, 6),
)
VOCAB = 40


def _grammar(
    max_tokens: int, reserve: int = 0
) -> tuple[ReasoningGrammar, ReasoningRows, MaskTable]:
    table = MaskTable(VOCAB, max_rows=16)
    rows = ReasoningRows.register(table, T)
    suppress = table.allow_all_but([T.answer_id])

    def answer(n: int) -> TextGrammar:
        return TextGrammar(T.eos_id, n, row=suppress, first_row=NO_MASK)

    return ReasoningGrammar(rows, max_tokens, answer, reserve), rows, table


def test_the_reference_protocol_step_by_step() -> None:
    g, rows, table = _grammar(20)
    assert g.next_kind is StepKind.REASON and g.mask_row == NO_MASK  # the first token is free
    g.advance_token(0)  # eos as the first reasoning token is text, as in the reference
    assert not g.finished and g.mask_row == rows.thinking
    assert not table.allowed(rows.thinking)[[T.eos_id, T.size_id]].any()
    for token, value in [
        (11, None),
        (7, None),
        (5, 0.25),
        (5, 0.5),
        (12, None),
        (9, None),
        (5, 0.75),
    ]:
        g.advance_token(token)
        if value is None:
            assert g.next_kind is StepKind.REASON
        else:
            assert g.next_kind is StepKind.COORD_X
            g.advance_value(value)
    spans = g.spans()
    assert [(s.start, s.end) for s in spans] == [(0, 2), (2, 6), (6, 8)]
    assert [s.coords for s in spans] == [(), (0.25, 0.5), (0.75,)]
    g.advance_token(T.answer_id)  # ends the reasoning; fed back; the answer follows
    assert not g.reasoning and g.next_kind is StepKind.TOKEN and g.mask_row == NO_MASK
    g.advance_token(14)
    assert g.mask_row != NO_MASK  # the answer suppresses the answer marker after its first
    g.advance_token(T.eos_id)
    assert g.finished and g.finish_reason.value == "stop"
    assert g.token_ids == [0, 11, 7, 5, 5, 12, 9, 5, 3, 14]
    assert g.max_positions == 21


def test_suppressed_tokens_and_the_budget_are_enforced() -> None:
    g, _, _ = _grammar(3)
    g.advance_token(11)
    with pytest.raises(GrammarError):
        g.advance_token(T.size_id)
    with pytest.raises(GrammarError):
        g.advance_token(T.eos_id)
    with pytest.raises(GrammarError):
        g.advance_value(0.5)  # no coordinate token came
    g.advance_token(12)
    g.advance_token(13)  # the whole budget went to reasoning: no answer
    assert g.finished and g.finish_reason.value == "length" and g.answer is None


def test_a_reserve_forces_the_answer_in_time() -> None:
    g, rows, table = _grammar(5, reserve=2)
    g.advance_token(11)
    g.advance_token(5)
    g.advance_value(0.1)
    g.advance_token(12)
    assert g.mask_row == rows.to_answer  # 3 reasoning tokens: only the marker is left
    assert table.allowed(rows.to_answer).nonzero()[0].tolist() == [T.answer_id]
    with pytest.raises(GrammarError):
        g.advance_token(13)
    g.advance_token(T.answer_id)
    g.advance_token(20)
    g.advance_token(21)
    assert g.finished and g.finish_reason.value == "length"
    with pytest.raises(ValueError):
        _grammar(3, reserve=4)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40), st.integers(1, 12))
def test_any_walk_stays_within_its_budget(tokens: list[int], max_tokens: int) -> None:
    """Whatever the masks allow, the counted tokens never exceed max_tokens and positions
    never exceed max_positions."""
    g, _, table = _grammar(max_tokens)
    positions = 0
    for token in tokens:
        if g.finished:
            break
        row = g.mask_row
        if row != NO_MASK and not table.allowed(row)[token]:
            continue
        g.advance_token(token)
        positions += 1
        if g.next_kind is StepKind.COORD_X:
            g.advance_value(0.5)
    answer = len(g.answer.token_ids) if g.answer is not None else 0
    assert len(g.reasoning_ids) + answer <= max_tokens
    assert positions <= g.max_positions
