"""Token masks: every row equals the brute-force allowed set; budgets; cache; mask table."""

from __future__ import annotations

import numpy as np
import pytest

from decoding.automaton import DEAD, Dfa, choices_dfa
from decoding.mask_table import NO_MASK, MaskTable, MaskTableFull
from decoding.regex_dfa import regex_dfa
from decoding.svg_path import PathLanguage
from decoding.token_masks import (
    EOS_ONLY,
    UNREACHABLE,
    CompiledMasks,
    MaskCache,
    compile_masks,
)
from decoding.token_trie import TokenTrie
from decoding.vocab import TokenVocab
from tests.support.toy_tokenizers import byte_fallback_bpe, byte_level_bpe

PAD = 16  # the model's vocabulary is padded beyond the tokenizer's


@pytest.fixture(scope="module")
def vocab() -> TokenVocab:
    return TokenVocab.from_tokenizer(byte_level_bpe())


@pytest.fixture(scope="module")
def sp_vocab() -> TokenVocab:
    return TokenVocab.from_tokenizer(byte_fallback_bpe())


def _automata(vocab: TokenVocab) -> dict[str, Dfa]:
    return {
        "phone": regex_dfa(r"\d{3}-\d{2,4}"),
        "words": regex_dfa(r"[a-z]+( [a-z]+){0,3}\."),
        "unicode": regex_dfa(r"(é|日本|😀)+ ?"),
        "any": regex_dfa(r".{0,6}"),
        "choices": choices_dfa(["yes", "no", "maybe later", "Zürich"]),
        "path": PathLanguage.for_vocab(20, vocab.text_pieces()).dfa,
    }


def _token_dist(dfa: Dfa, pieces: list[bytes | None]) -> list[int]:
    """Independent token-level distances by plain Python relaxation."""
    n = dfa.n_states
    dist = [0 if dfa.accepting[s] else UNREACHABLE for s in range(n)]
    dist[DEAD] = UNREACHABLE
    changed = True
    while changed:
        changed = False
        for s in range(1, n):
            for p in pieces:
                if p:
                    t = dfa.walk(s, p)
                    if t != DEAD and dist[t] + 1 < dist[s]:
                        dist[s] = dist[t] + 1
                        changed = True
    return dist


def _check_all_rows(compiled: CompiledMasks, vocab: TokenVocab, eos: int, blocked=()) -> int:
    dfa, width = compiled.dfa, compiled.width
    pieces = [None if i in blocked else p for i, p in enumerate(vocab.text_pieces())]
    dist = _token_dist(dfa, pieces)
    assert compiled.dist.tolist() == [min(d, UNREACHABLE) for d in dist]
    checked = 0
    for s in range(1, dfa.n_states):
        if dist[s] >= UNREACHABLE:
            continue
        targets = [dfa.walk(s, p) if p else DEAD for p in pieces]
        # Every remaining budget from the minimum to "plenty" maps to the right row.
        for remaining in range(dist[s], dist[s] + 8):
            row = compiled.row(s, remaining)
            if row == EOS_ONLY:
                assert dfa.accepting[s]
                assert all(t == DEAD or dist[t] > remaining - 1 for t in targets)
                continue
            expected = np.zeros(width, dtype=bool)
            for i, t in enumerate(targets):
                expected[i] = t != DEAD and dist[t] <= remaining - 1
            expected[eos] = dfa.accepting[s]
            assert np.array_equal(compiled.allowed(row), expected), (s, remaining)
            checked += 1
        # With an unbounded budget the row is exactly "the token's bytes keep the DFA alive".
        row = compiled.row(s, 1 << 20)
        if row != EOS_ONLY:
            alive = np.zeros(width, dtype=bool)
            alive[[i for i, t in enumerate(targets) if t != DEAD]] = True
            alive[eos] = dfa.accepting[s]
            assert np.array_equal(compiled.allowed(row), alive)
    return checked


@pytest.mark.parametrize("name", ["phone", "words", "unicode", "any", "choices", "path"])
def test_rows_equal_brute_force(vocab: TokenVocab, name: str) -> None:
    dfa = _automata(vocab)[name]
    compiled = compile_masks(dfa, vocab, eos_id=0, width=vocab.size + PAD)
    assert _check_all_rows(compiled, vocab, eos=0) > 0
    for r in range(compiled.rows.shape[0]):
        assert not compiled.allowed(r)[vocab.size :].any()


def test_rows_equal_brute_force_byte_fallback(sp_vocab: TokenVocab) -> None:
    eos = 2
    for dfa in (regex_dfa(r"(é|日本)+!?"), regex_dfa(r"[A-Z][a-z]{1,4}"), choices_dfa(["ok", "ß"])):
        compiled = compile_masks(dfa, sp_vocab, eos_id=eos, width=sp_vocab.size)
        _check_all_rows(compiled, sp_vocab, eos=eos)


def test_blocked_and_special_ids_never_allowed(vocab: TokenVocab) -> None:
    blocked = {i for i, p in enumerate(vocab.text_pieces()) if p and b"5" in p}
    compiled = compile_masks(regex_dfa(r"\d+"), vocab, 0, vocab.size, blocked=blocked)
    _check_all_rows(compiled, vocab, eos=0, blocked=blocked)
    for r in range(compiled.rows.shape[0]):
        allowed = compiled.allowed(r)
        assert not allowed[sorted(blocked)].any()
        assert not allowed[sorted(vocab.special_ids - {0})].any()


def test_unsatisfiable_constraint_raises(vocab: TokenVocab) -> None:
    digits = {i for i, p in enumerate(vocab.text_pieces()) if p and any(48 <= b <= 57 for b in p)}
    with pytest.raises(ValueError, match="cannot be satisfied"):
        compile_masks(regex_dfa(r"\d"), vocab, 0, vocab.size, blocked=digits)


def test_row_budget_limit(vocab: TokenVocab) -> None:
    with pytest.raises(ValueError, match="too complex"):
        compile_masks(regex_dfa(r"[a-z]{0,40}"), vocab, 0, vocab.size, max_rows=3)


def test_budget_too_small_raises(vocab: TokenVocab) -> None:
    compiled = compile_masks(regex_dfa(r"\d{3}-\d{4}"), vocab, 0, vocab.size)
    start = compiled.dfa.start
    with pytest.raises(ValueError):
        compiled.row(start, int(compiled.dist[start]) - 1)
    compiled.row(start, int(compiled.dist[start]))


def test_disk_cache_round_trip(vocab: TokenVocab, tmp_path) -> None:
    dfa = regex_dfa(r"(yes|no)\.")
    first = compile_masks(dfa, vocab, 0, vocab.size, cache=MaskCache(tmp_path))
    files = list(tmp_path.glob("*.npz"))
    assert [f.stem for f in files] == [first.key]
    loaded = compile_masks(dfa, vocab, 0, vocab.size, cache=MaskCache(tmp_path))
    assert loaded is not first
    for name in ("rows", "dist", "level_base", "level_ptr", "level_rows"):
        assert np.array_equal(getattr(loaded, name), getattr(first, name))
    # A different eos, width or blocked set is a different entry.
    other = compile_masks(dfa, vocab, 1, vocab.size, cache=MaskCache(tmp_path))
    assert other.key != first.key
    assert len(list(tmp_path.glob("*.npz"))) == 2
    # A damaged file is recompiled, not trusted.
    files[0].write_bytes(b"not a numpy file")
    again = compile_masks(dfa, vocab, 0, vocab.size, cache=MaskCache(tmp_path))
    assert np.array_equal(again.rows, first.rows)


def test_memory_cache_returns_same_object(vocab: TokenVocab) -> None:
    cache = MaskCache(use_disk=False)
    dfa = regex_dfa(r"a+")
    assert compile_masks(dfa, vocab, 0, vocab.size, cache=cache) is compile_masks(
        regex_dfa(r"a+"), vocab, 0, vocab.size, cache=cache
    )


def test_default_cache_dir_follows_xdg(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert MaskCache().directory == tmp_path / "moondream-serve" / "masks"
    assert MaskCache(use_disk=False).directory is None
    assert not (tmp_path / "moondream-serve").exists()  # nothing written until a put


def test_trie_walk_matches_python_walk(vocab: TokenVocab) -> None:
    trie = TokenTrie.build(vocab.text_pieces())
    dfa = regex_dfa(r"[a-z ]*(é|\d)?").trimmed()
    states = np.arange(1, dfa.n_states)
    ends = trie.walk_states(dfa.trans, states)
    for row, s in enumerate(states):
        for i, p in enumerate(vocab.text_pieces()):
            assert ends[row, i] == (dfa.walk(int(s), p) if p else DEAD)


def test_vocab_digest_tracks_content(vocab: TokenVocab) -> None:
    again = TokenVocab.from_tokenizer(byte_level_bpe())
    assert again.digest == vocab.digest
    other = TokenVocab.from_tokenizer(byte_level_bpe(vocab_size=500))
    assert other.digest != vocab.digest


# ---------------------------------------------------------------- mask table


def test_mask_table_dedupes_and_registers(vocab: TokenVocab) -> None:
    width = vocab.size + PAD
    table = MaskTable(width)
    assert len(table) == 1 and table.allowed(NO_MASK).all()
    a = table.allow_only([1, 2])
    assert table.allow_only([2, 1]) == a
    b = table.allow_all_but([0])
    assert len({NO_MASK, a, b}) == 3 and len(table) == 3
    compiled = compile_masks(regex_dfa(r"\d{2}"), vocab, 0, width)
    rows = table.register(compiled, vocab.text_pieces())
    assert table.register(compiled, vocab.text_pieces()) is rows
    dense = table.dense()
    assert dense.shape == (len(table), width)
    assert np.array_equal(table.dense(3), dense[3:])
    start = compiled.dfa.start
    for remaining in range(2, 6):
        local = compiled.row(start, remaining)
        assert np.array_equal(table.allowed(rows.row(start, remaining)), compiled.allowed(local))


def test_mask_table_rejects_wrong_shapes_and_overflow() -> None:
    table = MaskTable(10, max_rows=2)
    with pytest.raises(ValueError):
        table.add(np.ones(9, dtype=bool))
    table.allow_only([3])
    with pytest.raises(MaskTableFull, match="full"):
        table.allow_only([4])
