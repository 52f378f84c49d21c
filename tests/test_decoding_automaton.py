"""Byte DFAs: regex subset vs Python's re, choices, UTF-8 ranges, the segment path language."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decoding.automaton import DEAD, Dfa, choices_dfa
from decoding.regex_dfa import regex_dfa
from decoding.svg_path import PathLanguage, parse_path
from decoding.utf8_ranges import byte_sequences, complement, normalize

# ---------------------------------------------------------------- regex vs re

_ATOMS = ["a", "b", "c", "é", r"\d", r"\.", ".", "[a-c]", "[^a]", r"\w", r"\s", "[é-ë1]", "日"]


def _regexes() -> st.SearchStrategy[str]:
    def extend(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        quant = st.sampled_from(["?", "*", "+", "{2}", "{0,2}", "{1,}", "*?", "{,2}"])
        return st.one_of(
            st.tuples(inner, inner).map("".join),
            st.tuples(inner, inner).map(lambda t: f"({t[0]}|{t[1]})"),
            st.tuples(inner, quant).map(lambda t: f"(?:{t[0]}){t[1]}"),
        )

    return st.recursive(st.sampled_from(_ATOMS), extend, max_leaves=6)


_TEXT = st.text(alphabet="abc1.é日 \në", max_size=6)


def _byte_dist(dfa: Dfa) -> np.ndarray:
    """Fewest bytes from each state to acceptance."""
    dist = np.where(dfa.accepting, 0, 1 << 20)
    while True:
        new = np.minimum(dist, dist[dfa.trans].min(axis=1) + 1)
        if np.array_equal(new, dist):
            return dist
        dist = new


def _accepted_walk(dfa: Dfa, data: st.DataObject, max_len: int = 12) -> bytes:
    """A random accepted byte string (hypothesis-driven walk over live transitions)."""
    dist = _byte_dist(dfa)
    state, out = dfa.start, bytearray()
    for _ in range(max_len):
        options = np.flatnonzero(dist[dfa.trans[state]] < (1 << 20)).tolist()
        stop = dfa.accepting[state] and data.draw(st.booleans())
        if stop or not options:
            break
        b = data.draw(st.sampled_from(options))
        out.append(b)
        state = int(dfa.trans[state, b])
    while not dfa.accepting[state]:  # finish along a shortest path
        b = int(np.argmin(dist[dfa.trans[state]]))
        out.append(b)
        state = int(dfa.trans[state, b])
    return bytes(out)


@settings(max_examples=300, deadline=None)
@given(_regexes(), st.lists(_TEXT, max_size=25))
def test_regex_agrees_with_re_on_random_strings(pattern: str, texts: list[str]) -> None:
    dfa = regex_dfa(pattern)
    for text in texts:
        expected = re.fullmatch(pattern, text, re.ASCII) is not None
        assert dfa.matches(text.encode()) == expected, (pattern, text)


@settings(max_examples=150, deadline=None)
@given(_regexes(), st.data())
def test_regex_accepted_strings_match_re(pattern: str, data: st.DataObject) -> None:
    dfa = regex_dfa(pattern)
    for _ in range(5):
        text = _accepted_walk(dfa, data).decode("utf-8")  # the language is valid UTF-8 only
        assert re.fullmatch(pattern, text, re.ASCII), (pattern, text)


@pytest.mark.parametrize(
    "pattern",
    [
        r"\d{3}-\d{4}",
        r"(yes|no|maybe)",
        r"^\$\d+(\.\d\d)?$",
        r"[\w.-]+@[a-z]+\.(com|org)",
        r"(?P<word>[A-Z][a-z]*)( \w+)*",
        r"[^\x00-\x1f]{0,5}",
        r"a{,3}b{2,}",
        r"[]a-]+\\",
        r"\u00e9\U0001F600?",
        r"[\t\n\r ]*x",
    ],
)
def test_regex_examples(pattern: str) -> None:
    dfa = regex_dfa(pattern)
    samples = ["", "555-1234", "yes", "$12.50", "a@b.com", "Hello big world", "aab", "]-\\"]
    samples += ["é😀", "\t x", "abc\x01", "aaabbb", "é"]
    for text in samples:
        expected = re.fullmatch(pattern, text, re.ASCII) is not None
        assert dfa.matches(text.encode()) == expected, (pattern, text)


@pytest.mark.parametrize(
    ("pattern", "fragment"),
    [
        (r"(?=a)b", "lookahead"),
        (r"(?<!a)b", "lookbehind"),
        (r"(a)\1", "backreference"),
        (r"\bword", "word boundary"),
        (r"(?i)abc", "inline flags"),
        (r"a*+", "possessive"),
        (r"a^b", "anchor"),
        (r"\p{L}", "Unicode property"),
        (r"a{2000}", "repetition count"),
    ],
)
def test_regex_unsupported_syntax_is_named(pattern: str, fragment: str) -> None:
    with pytest.raises(ValueError, match="unsupported syntax") as info:
        regex_dfa(pattern)
    assert fragment in str(info.value)


@pytest.mark.parametrize("pattern", ["(a", "a)", "[a", "*a", "a**", "a{3,1}", r"\q", "[z-a]"])
def test_regex_malformed_raises(pattern: str) -> None:
    with pytest.raises(ValueError):
        regex_dfa(pattern)


def test_minimization_is_canonical() -> None:
    assert regex_dfa("(ab)*").signature() == regex_dfa("(ab)*(ab)*").signature()
    assert regex_dfa("a|a|a").signature() == regex_dfa("a").signature()
    assert regex_dfa("[0-9]").signature() == regex_dfa(r"\d").signature()
    assert regex_dfa("a").signature() != regex_dfa("b").signature()


def test_trimmed_dead_means_cannot_finish() -> None:
    dfa = regex_dfa("ab|ac").trimmed()
    live = dfa.live_states()
    assert live[dfa.start] and not live[DEAD]
    assert dfa.walk(dfa.start, b"ad") == DEAD
    assert dfa.walk(dfa.start, b"a") != DEAD


# ---------------------------------------------------------------- choices


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(max_size=6), min_size=1, max_size=6), st.lists(st.text(max_size=6)))
def test_choices_accept_exactly_the_list(choices: list[str], others: list[str]) -> None:
    dfa = choices_dfa(choices)
    for text in choices + others:
        assert dfa.matches(text.encode()) == (text in choices)


def test_choices_empty_list_rejected() -> None:
    with pytest.raises(ValueError):
        choices_dfa([])


# ---------------------------------------------------------------- UTF-8 ranges


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 0x10FFFF),
    st.integers(0, 0x10FFFF),
    st.lists(st.integers(0, 0x10FFFF), max_size=40),
)
def test_byte_sequences_cover_exactly_the_range(a: int, b: int, probes: list[int]) -> None:
    lo, hi = min(a, b), max(a, b)
    seqs = byte_sequences([(lo, hi)])

    def covered(cp: int) -> bool:
        enc = chr(cp).encode()
        return any(
            len(s) == len(enc) and all(x <= c <= y for (x, y), c in zip(s, enc, strict=True))
            for s in seqs
        )

    for cp in [*probes, lo, hi, lo - 1, hi + 1]:
        if 0 <= cp <= 0x10FFFF and not 0xD800 <= cp <= 0xDFFF:
            assert covered(cp) == (lo <= cp <= hi), hex(cp)


def test_complement_and_normalize() -> None:
    assert normalize([(5, 9), (1, 3), (4, 4), (0xD7FF, 0xE000)]) == [
        (1, 9),
        (0xD7FF, 0xD7FF),
        (
            0xE000,
            0xE000,
        ),
    ]
    assert complement([(0, 0x10FFFF)]) == []
    assert complement([(10, 10)])[0] == (0, 9)


# ---------------------------------------------------------------- segment path language


@pytest.mark.parametrize("grid", [1, 9, 10, 100, 255, 1000])
def test_path_dfa_agrees_with_parser_on_random_text(grid: int) -> None:
    rng = np.random.default_rng(grid)
    lang = PathLanguage(grid, 6)
    dfa = lang.dfa
    pieces = ["M", "L", "Q", "C", "Z", " ", "0", "1", "5", "9", "10", str(grid), str(grid + 1)]
    for _ in range(3000):
        text = "M " + " ".join(rng.choice(pieces, size=rng.integers(1, 12)))
        text = text.replace("  ", " ")
        try:
            parse_path(text, grid)
            parsed = True
        except ValueError:
            parsed = False
        assert dfa.is_accepting(dfa.walk(lang.start(1000), text.encode())) == parsed, text


@functools.cache
def _language(grid: int, cap: int) -> PathLanguage:
    return PathLanguage(grid, cap)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([1, 7, 100, 999]), st.integers(1, 12), st.data())
def test_path_walks_parse_and_respect_max_points(
    grid: int, max_points: int, data: st.DataObject
) -> None:
    lang = _language(grid, 16)  # max_points below the cap: the DFA's count is exact
    dfa = Dfa(lang.dfa.trans, lang.dfa.accepting, lang.start(max_points))
    text = _accepted_walk(dfa, data, max_len=40).decode("ascii")
    subpaths = parse_path(text, grid)
    points = sum(len(cmd.points) for sub in subpaths for cmd in sub)
    assert 1 <= points <= max_points
    assert text.endswith("Z")


def test_path_examples() -> None:
    lang = PathLanguage(100, 6)
    ok = ["M 0 0 Z", "M 10 20 L 30 40 Q 1 2 3 4 C 5 6 7 8 9 10 Z", "M 1 1 Z M 100 100 L 0 0 Z"]
    bad = ["", "M 0 0", "M 0 0 Z ", "M 01 0 Z", "M 101 0 Z", "M 0 0 L 1 Z", "L 1 1 Z", "M 1  1 Z"]
    for text in ok:
        assert lang.dfa.is_accepting(lang.dfa.walk(lang.start(50), text.encode())), text
        parse_path(text, 100)
    for text in bad:
        assert not lang.dfa.is_accepting(lang.dfa.walk(lang.start(50), text.encode())), text
        with pytest.raises(ValueError):
            parse_path(text, 100)


def test_path_point_budget_closes_the_path() -> None:
    lang = PathLanguage(100, 6)
    dfa = lang.dfa
    # Two points left after M: a C (3 points) cannot start, Q (2) can, then only Z.
    state = dfa.walk(lang.start(3), b"M 5 5 ")
    assert dfa.walk(state, b"C") == DEAD
    state = dfa.walk(state, b"Q 1 2 3 4 ")
    assert dfa.walk(state, b"L") == DEAD
    assert dfa.walk(state, b" ") == DEAD
    assert dfa.is_accepting(dfa.walk(state, b"Z"))
    assert dfa.walk(state, b"Z M") == DEAD  # no point left for another subpath


def test_path_count_cap_grows_for_multi_command_tokens() -> None:
    plain = PathLanguage.for_vocab(100, [b"M", b" 1", b"Z", None])
    assert plain.count_cap == 6
    # A token that can start two cubic commands spends up to 6 points at once.
    greedy = PathLanguage.for_vocab(100, [b"C 1 2 3 4 5 6 C", b" 1"])
    assert greedy.count_cap >= 9
