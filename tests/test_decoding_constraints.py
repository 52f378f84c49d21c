"""Client constraints: caps before any work, the cheap token lower bound, the cooperative time
budget, the cache keyed by the constraint, and reference-counted mask-table rows."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import decoding.constraints as constraints_module
from decoding.automaton import Dfa, _acyclic_classes, _moore_classes, choices_dfa
from decoding.constraints import BudgetTooSmall, ConstraintCompiler
from decoding.limits import (
    UNLIMITED,
    CompileBudget,
    CompileTimeout,
    ConstraintLimits,
    ConstraintTooLarge,
)
from decoding.mask_table import NO_MASK, MaskTable, MaskTableFull
from decoding.regex_dfa import parse_regex, regex_dfa, shortest_match_bytes
from decoding.token_masks import compile_masks
from decoding.vocab import TokenVocab
from tests.support.toy_tokenizers import byte_level_bpe

EOS = 0
PAD = 16


@pytest.fixture(scope="module")
def vocab() -> TokenVocab:
    return TokenVocab.from_tokenizer(byte_level_bpe())


def _compiler(vocab: TokenVocab, rows: int = 1024, **limits: float) -> ConstraintCompiler:
    table = MaskTable(vocab.size + PAD, max_rows=rows)
    return ConstraintCompiler(vocab, table, EOS, limits=ConstraintLimits(**limits))


@pytest.fixture
def compile_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[object]]:
    """Records every mask compilation the constraint compiler starts."""
    calls: list[object] = []

    def counting(dfa: Dfa, *args: object, **kwargs: object) -> object:
        calls.append(dfa)
        return compile_masks(dfa, *args, **kwargs)

    monkeypatch.setattr(constraints_module, "compile_masks", counting)
    yield calls


class _Clock:
    """A clock that advances one second per reading: any loop that polls runs out."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


# ---------------------------------------------------------------- caps and lower bound


@pytest.mark.parametrize(
    ("kind", "value", "limits"),
    [
        ("choices", ["a"] * 5, {"max_choices": 4}),
        ("choices", ["x" * 33], {"max_choice_chars": 32}),
        ("choices", ["abcd"] * 9, {"max_choices_total_chars": 32}),
        ("regex", "a" * 65, {"max_regex_chars": 64}),
        ("regex", "(a|b)*a(a|b){12}", {"max_constraint_states": 4096}),
        ("regex", "[a-z]{40}", {"max_mask_rows": 8}),
    ],
)
def test_caps_refuse_with_a_typed_error(
    vocab: TokenVocab, kind: str, value: object, limits: dict, compile_calls: list
) -> None:
    compiler = _compiler(vocab, **limits)
    with pytest.raises(ConstraintTooLarge):
        getattr(compiler, kind)(value)
    assert len(compile_calls) <= 1  # at most the one compilation that found the cap
    assert len(compiler.table) == 1  # nothing registered: only NO_MASK


def test_a_16_kb_choice_is_refused_at_once(vocab: TokenVocab, compile_calls: list) -> None:
    with pytest.raises(ConstraintTooLarge, match="1024"):
        _compiler(vocab).choices(["x" * 16_384])
    assert not compile_calls  # refused before any work


@pytest.mark.parametrize(
    ("kind", "value"),
    [("choices", ["ab" * 250, "cd" * 300]), ("regex", r"[\u0000-\U0010FFFF]{200}")],
)
def test_short_budget_is_refused_before_compiling(
    vocab: TokenVocab, compile_calls: list, kind: str, value: object
) -> None:
    with pytest.raises(BudgetTooSmall, match="max_tokens=3"):
        getattr(_compiler(vocab), kind)(value, max_tokens=3)
    assert not compile_calls


def test_exact_budget_check_after_compiling_releases_the_rows(vocab: TokenVocab) -> None:
    compiler = _compiler(vocab)
    rows = compiler.regex(r"\d{12}")
    need = rows.dist(rows.dfa.start)
    compiler.release(rows)
    assert need > 1  # the lower bound lets this through, the exact check does not
    live = compiler.table.live_rows
    with pytest.raises(BudgetTooSmall):
        compiler.regex(r"\d{12}", max_tokens=need - 1)
    assert compiler.table.live_rows == live
    compiler.release(compiler.regex(r"\d{12}", max_tokens=need))


@pytest.mark.parametrize(
    ("pattern", "shortest"),
    [
        ("", 0),
        ("()", 0),
        ("a{0}", 0),
        ("ab|c", 1),
        ("é{2}x?", 4),
        ("(日本)+", 6),
        ("[^\\x00-\\U0010FFFF]", None),
    ],
)
def test_shortest_match_bytes(pattern: str, shortest: int | None) -> None:
    assert shortest_match_bytes(parse_regex(pattern)) == shortest


def test_a_regex_matching_nothing_is_refused(vocab: TokenVocab) -> None:
    with pytest.raises(ValueError, match="matches nothing"):
        _compiler(vocab).regex(r"[^\x00-\U0010FFFF]")


# ---------------------------------------------------------------- time budget


def test_budget_is_polled_inside_every_long_loop(vocab: TokenVocab) -> None:
    with pytest.raises(CompileTimeout):
        regex_dfa(r"(a|b)*a(a|b){6}", budget=CompileBudget(0.5, _Clock()))  # determinization
    with pytest.raises(CompileTimeout):
        choices_dfa(["abc", "abd"], budget=CompileBudget(0.5, _Clock()))  # minimization
    dfa = regex_dfa(r"[a-z]{3}")
    with pytest.raises(CompileTimeout):
        compile_masks(dfa, vocab, EOS, vocab.size + PAD, budget=CompileBudget(0.5, _Clock()))


def test_timeouts_are_cached_refusals(vocab: TokenVocab, compile_calls: list) -> None:
    compiler = _compiler(vocab, constraint_compile_seconds=1e-9)
    for _ in range(2):
        with pytest.raises(CompileTimeout, match="budget"):
            compiler.regex(r"[a-z]{3}[0-9]{2}")
    assert len(compile_calls) <= 1  # the second refusal comes from the cache


class _WorkClock:
    """A clock that advances 1 ms per reading: a compile budget of N seconds then allows
    about 1000 x N polls of its loops, whatever the machine's speed."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1e-3
        return self.now


def test_formerly_slow_constraints_take_bounded_work(
    vocab: TokenVocab, monkeypatch: pytest.MonkeyPatch
) -> None:
    """They took 11 s, 18 s and a 3.3 s stall; the work of each is now counted in polls of
    the compile loops (about 500, 4,700 and 2,000), not timed: 20 s of the work clock is
    20,000 polls, so a return to quadratic work fails here on any machine."""
    monkeypatch.setattr(
        constraints_module,
        "CompileBudget",
        lambda seconds, clock=None: CompileBudget(seconds, _WorkClock()),
    )
    compiler = _compiler(vocab, constraint_compile_seconds=20.0)
    compiler.release(compiler.choices(["z" * 500]))
    compiler.release(compiler.regex(r"[\u0000-\U0010FFFF]{200}"))
    with pytest.raises(ConstraintTooLarge):
        compiler.regex(r"(a|b)*a(a|b){12}")  # 8,192 states: over the state cap


# ---------------------------------------------------------------- cache


def test_compiled_constraints_are_cached_and_shared(vocab: TokenVocab, compile_calls: list) -> None:
    compiler = _compiler(vocab)
    a = compiler.choices(["yes", "no"])
    b = compiler.choices(["yes", "no"])
    assert a is b and len(compile_calls) == 1
    compiler.release(a)
    compiler.release(b)
    c = compiler.choices(["yes", "no"])  # rows were idle: revived without recompiling
    assert len(compile_calls) == 1 and c.global_ids == a.global_ids
    compiler.release(c)
    with pytest.raises(ValueError):
        compiler.regex("(")  # syntax errors cost no compile at all
    assert len(compile_calls) == 1


# ---------------------------------------------------------------- minimization


@settings(max_examples=40, deadline=None)
@given(st.lists(st.text("abcé", min_size=1, max_size=6), min_size=1, max_size=8))
def test_acyclic_minimization_equals_moore(words: list[str]) -> None:
    dfa = choices_dfa(words)
    assert all(dfa.matches(w.encode()) for w in words)
    raw = Dfa(dfa.trans, dfa.accepting, dfa.start)
    fast = _acyclic_classes(raw.trans, raw.accepting, UNLIMITED)
    slow = _moore_classes(raw.trans.astype(np.int64), raw.accepting, UNLIMITED)
    assert fast is not None
    # Same partition: a bijection between the two class numberings.
    pairs = set(zip(fast.tolist(), slow.tolist(), strict=True))
    assert len(pairs) == len(set(fast.tolist())) == len(set(slow.tolist()))
    assert len(set(fast.tolist())) == dfa.n_states  # already minimal


def test_cyclic_automata_take_the_moore_path() -> None:
    dfa = regex_dfa(r"(ab)*c")
    assert _acyclic_classes(dfa.trans, dfa.accepting, UNLIMITED) is None
    assert dfa.matches(b"ababc") and not dfa.matches(b"abac")


# ---------------------------------------------------------------- mask table rows


def test_rows_are_reference_counted_and_reclaimed(vocab: TokenVocab) -> None:
    compiler = _compiler(vocab, rows=48)
    table = compiler.table
    pinned = table.allow_only([1, 2])
    pinned_bits = table.allowed(pinned).copy()
    table.take_dirty()
    held = compiler.regex(r"[a-c]+")
    for i in range(200):  # far more distinct rows over time than the table has
        letters = "".join(chr(ord("d") + k) for k in range(i % 20 + 1))
        rows = compiler.regex(f"[{letters}]+x{i % 7}")
        compiler.release(rows)
    assert np.array_equal(table.allowed(pinned), pinned_bits)
    assert all(table.refs(r) >= 1 for r in held.global_ids)
    compiler.release(held)
    assert table.live_rows == 2  # NO_MASK and the pinned row
    ids, packed = table.take_dirty()
    assert ids.size and pinned not in ids.tolist()
    dense = np.unpackbits(packed, axis=1, count=table.width, bitorder="little").astype(bool)
    for row, bits in zip(ids.tolist(), dense, strict=True):
        assert np.array_equal(table.allowed(row), bits)


def test_full_only_when_every_row_is_live(vocab: TokenVocab) -> None:
    table = MaskTable(vocab.size + PAD, max_rows=3)  # NO_MASK + one row per pattern
    compiled = [
        compile_masks(regex_dfa(p), vocab, EOS, table.width) for p in ("[ab]", "[cd]", "[ef]")
    ]
    pieces = vocab.text_pieces()
    held = [table.register(c, pieces) for c in compiled[:2]]
    live = table.live_rows
    with pytest.raises(MaskTableFull):
        table.register(compiled[2], pieces)
    assert table.live_rows == live  # a refused registration takes nothing
    table.release(held[0])
    table.register(compiled[2], pieces)  # the idle rows are reused
    with pytest.raises(ValueError):
        table.release(held[0])  # not registered any more
    assert table.allowed(NO_MASK).all()


def test_dirty_rows_come_in_runs_of_consecutive_ids(vocab: TokenVocab) -> None:
    table = MaskTable(vocab.size + PAD, max_rows=8)
    for ids in ([1], [2], [3], [5], [6]):
        table.allow_only(ids)
    table.take_dirty_runs()
    table.allow_only([9])  # slot 6
    runs = table.take_dirty_runs()
    assert [(first, len(rows)) for first, rows in runs] == [(6, 1)]
    table2 = MaskTable(vocab.size + PAD, max_rows=8)
    runs = table2.take_dirty_runs()
    assert [(first, len(rows)) for first, rows in runs] == [(0, 1)] and runs[0][1].all()
    assert table2.take_dirty_runs() == []


def test_the_cache_is_bounded_by_entries_and_bytes(vocab: TokenVocab, compile_calls: list) -> None:
    compiler = _compiler(vocab, cache_entries=2)
    for pattern in ("[ab]", "[cd]", "[ef]", "[ab]"):
        compiler.release(compiler.regex(pattern))
    assert len(compile_calls) == 4  # "[ab]" was the oldest of three: evicted, compiled again
    small = _compiler(vocab, cache_bytes=1)
    for _ in range(2):
        small.release(small.regex("[gh]"))
    assert len(compile_calls) == 6  # nothing fits one byte: nothing kept
