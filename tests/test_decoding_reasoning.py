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
    max_tokens: int, reserve: int = 0, room: int | None = None
) -> tuple[ReasoningGrammar, ReasoningRows, MaskTable]:
    table = MaskTable(VOCAB, max_rows=16)
    rows = ReasoningRows.register(table, T)
    suppress = table.allow_all_but([T.answer_id])

    def answer(n: int) -> TextGrammar:
        return TextGrammar(T.eos_id, n, row=suppress, first_row=NO_MASK)

    return ReasoningGrammar(rows, max_tokens, answer, reserve, room), rows, table


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
    assert g.max_positions == 41  # each phase's budget, and the marker


def test_suppressed_tokens_and_the_budget_are_enforced() -> None:
    g, rows, table = _grammar(3)
    g.advance_token(11)
    with pytest.raises(GrammarError):
        g.advance_token(T.size_id)
    with pytest.raises(GrammarError):
        g.advance_token(T.eos_id)
    with pytest.raises(GrammarError):
        g.advance_value(0.5)  # no coordinate token came
    g.advance_token(12)
    g.advance_token(13)
    # The reasoning spent its budget: the marker comes next, and the answer gets its own.
    assert not g.finished and g.mask_row == rows.to_answer
    assert table.allowed(rows.to_answer).nonzero()[0].tolist() == [T.answer_id]
    with pytest.raises(GrammarError):
        g.advance_token(14)
    g.advance_token(T.answer_id)
    for token in (20, 21, 22):
        assert not g.finished
        g.advance_token(token)
    assert g.finished and g.finish_reason.value == "length"
    assert g.answer is not None and g.answer.token_ids == [20, 21, 22]
    assert g.reasoning_ids == [11, 12, 13] and g.max_positions == 7


def test_a_reserve_is_checked_against_the_answer_budget() -> None:
    """A constrained answer's shortest string must fit ``max_tokens``; it no longer cuts the
    reasoning short while the context has room."""
    g, rows, _ = _grammar(3, reserve=3)
    for token in (11, 12, 13):
        assert g.mask_row != rows.to_answer
        g.advance_token(token)
    assert g.mask_row == rows.to_answer
    with pytest.raises(ValueError):
        _grammar(3, reserve=4)


def test_the_context_bounds_both_phases() -> None:
    """With little room left, reasoning yields in time for the marker and the shortest
    answer (at least one token), and the answer ends at the context."""
    g, rows, _ = _grammar(5, reserve=2, room=6)
    assert g.max_positions == 6
    g.advance_token(11)
    g.advance_token(5)
    g.advance_value(0.1)
    g.advance_token(12)
    assert g.mask_row == rows.to_answer  # 3 reasoning + marker + 2 answer tokens = 6
    g.advance_token(T.answer_id)
    g.advance_token(20)
    g.advance_token(21)
    assert g.finished and g.finish_reason.value == "length"
    free, rows, _ = _grammar(5, room=4)
    for token in (11, 12):
        free.advance_token(token)
    assert free.mask_row == rows.to_answer  # one answer token is kept
    free.advance_token(T.answer_id)
    free.advance_token(20)
    assert free.finished and free.answer is not None and free.answer.token_ids == [20]
    with pytest.raises(ValueError):
        _grammar(5, reserve=3, room=3)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40),
    st.integers(1, 12),
    st.one_of(st.none(), st.integers(1, 30)),
)
def test_any_walk_stays_within_its_budget(
    tokens: list[int], max_tokens: int, room: int | None
) -> None:
    """Whatever the masks allow, each phase's tokens stay within max_tokens and positions
    within max_positions, which stays within the context's room."""
    g, _, table = _grammar(max_tokens, room=room)
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
    assert len(g.reasoning_ids) <= max_tokens and answer <= max_tokens
    assert positions <= g.max_positions <= (room or g.max_positions)
