"""Moondream 3's segment path language: reading and scaling items, and the token grammar
generated from the same transitions (it admits exactly what the parser accepts)."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decoding.automaton import Dfa
from decoding.svg_token_dfa import KINDS, kind_vocab, path_dfa
from decoding.svg_tokens import (
    ARITY,
    GRID,
    NUMBER_BOUND,
    PathParser,
    chunk_texts,
    decode_items,
    format_number,
    item_kind,
    parse_items,
    path_text,
    token_items,
)
from decoding.vocab import TokenVocab
from tests.support.toy_tokenizers import byte_level_bpe
from vlm_server.models.common.tokenizer_build import build_tokenizer
from vlm_server.models.registry import preset


def _items(text: str) -> list[str]:
    return text.split(" ")


def _path(text: str) -> str:
    return path_text(parse_items(_items(text)))


def test_the_model_authors_example_scales_into_the_box() -> None:
    items = _items("M 480 0 L - 10 960 C 96 192 288 384 480 576 Z")
    groups = parse_items(items)
    assert path_text(groups) == "M 0.5 0 L -0.01 1 C 0.1 0.2 0.3 0.4 0.5 0.6 Z"
    assert chunk_texts(groups) == ["M 0.5 0", " L -0.01 1", " C 0.1 0.2 0.3 0.4 0.5 0.6", " Z"]
    assert "".join(chunk_texts(groups)) == path_text(groups)
    assert [g.args for g in groups] == [(480, 0), (-10, 960), (96, 192, 288, 384, 480, 576), ()]


def test_numbers_print_with_at_most_three_decimals() -> None:
    assert [format_number(v / GRID) for v in (0, 1, 320, 640, 960, 1920, -1, -96)] == [
        "0",
        "0.001",
        "0.333",
        "0.667",
        "1",
        "2",
        "-0.001",
        "-0.1",
    ]
    assert _path("M - 0 - 1920") == "M 0 -2"
    assert _path("M 1920 - 1920") == "M 2 -2"


@pytest.mark.parametrize("letter", list(ARITY))
def test_every_command_letter_takes_its_arity(letter: str) -> None:
    arity = ARITY[letter]
    args = ["0", "1", "0", "1", "0", "96", "192"][:arity] if letter in "Aa" else ["96"] * arity
    items = ["M", "0", "0", letter, *args]
    groups = parse_items(items)
    assert groups[-1].letter == letter and len(groups[-1].args) == arity
    if arity:
        # One argument short: the path cannot end; one group more (SVG's repetition) can.
        with pytest.raises(ValueError):
            parse_items(items[:-1])
        assert len(parse_items(items + args)) == 3
    else:
        with pytest.raises(ValueError):
            parse_items([*items, "0"])


def test_commands_repeat_and_moveto_repeats_as_lines() -> None:
    groups = parse_items(_items("m 96 96 192 192 H 96 192 Z M 0 0"))
    assert [(g.letter, g.repeat, g.command) for g in groups] == [
        ("m", False, "m"),
        ("m", True, "l"),
        ("H", False, "H"),
        ("H", True, "H"),
        ("Z", False, "Z"),
        ("M", False, "M"),
    ]
    assert path_text(groups) == "m 0.1 0.1 0.2 0.2 H 0.1 0.2 Z M 0 0"


def test_an_arc_keeps_its_angle_and_flags() -> None:
    assert _path("M 0 0 A 480 96 - 30 1 0 960 960") == "M 0 0 A 0.5 0.1 -30 1 0 1 1"
    for bad in ("2", "00", "-"):  # a flag is "0" or "1", never negative
        with pytest.raises(ValueError):
            parse_items(["M", "0", "0", "A", "96", "96", "0", bad])


@pytest.mark.parametrize(
    "items",
    [
        [],  # empty
        ["L", "1", "2"],  # not a moveto first
        ["M", "1"],  # ends inside a command
        ["M", "1", "2", "-"],  # a dangling minus
        ["M", "-", "-", "1", "2"],
        ["M", "-", "L"],
        ["M", "1", "L", "2", "3"],  # a command inside M's arguments
        ["M", "1", "2", "foo"],
        ["M1", "2"],
        ["M", "1.5", "2"],
        ["M", "+5", "2"],
        ["M", "-5", "2"],  # one item: the minus is a token of its own
        ["M", "\u0663", "2"],  # a non-ASCII digit
        ["M", str(NUMBER_BOUND + 1), "0"],
        ["M", "0", "0", "", ""],  # two whitespace tokens in a row
    ],
)
def test_junk_and_broken_paths_are_refused(items: list[str]) -> None:
    with pytest.raises(ValueError):
        parse_items(items)


def test_one_whitespace_token_may_separate_items() -> None:
    assert path_text(parse_items(["", "M", "", "-", "", "1", "2", ""])) == "M -0.001 0.002"
    assert _path(f"M {NUMBER_BOUND} 0") == "M 2 0"


def test_groups_stream_as_they_complete() -> None:
    parser = PathParser()
    done = [parser.push(item) for item in _items("M 1 2 3 4 Z")]
    assert [g.text() if g else None for g in done] == [
        None,
        None,
        "M 0.001 0.002",
        None,
        "0.003 0.004",
        "Z",
    ]
    assert parser.finish() == parser.groups


@functools.cache
def _dfa() -> Dfa:
    return path_dfa()


POOL = [*ARITY, "-", "0", "1", "7", "960", str(NUMBER_BOUND), str(NUMBER_BOUND + 1), "", "x"]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(POOL), max_size=14))
def test_the_grammar_accepts_exactly_what_the_parser_accepts(items: list[str]) -> None:
    kinds = [item_kind(item) for item in items]
    dfa_accepts = None not in kinds and _dfa().matches("".join(kinds).encode())  # type: ignore[arg-type]
    try:
        parse_items(items)
    except ValueError:
        assert not dfa_accepts, items
    else:
        assert dfa_accepts, items


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_every_walk_the_grammar_allows_parses(data: st.DataObject) -> None:
    """Random walks over the DFA's live kinds (one item per kind) parse, and the parser keeps
    pace: every prefix the walk takes is a prefix the parser takes."""
    dfa, live = _dfa(), _dfa().live_states()
    example = {k: k for k in KINDS} | {"0": "1", "#": "960", " ": ""}
    state, parser = dfa.start, PathParser()
    for _ in range(data.draw(st.integers(1, 40))):
        options = [k for k in KINDS if live[dfa.trans[state, ord(k)]]]
        kind = data.draw(st.sampled_from(options))
        parser.push(example[kind])
        state = int(dfa.trans[state, ord(kind)])
    assert parser.state.accepting == bool(dfa.accepting[state])


def test_kinds_of_items() -> None:
    assert [item_kind(i) for i in ("", "M", "z", "-", "0", "1", "2", "10", "1920")] == [
        " ",
        "M",
        "z",
        "-",
        "0",
        "0",
        "#",
        "#",
        "#",
    ]
    assert [item_kind(i) for i in ("1921", "01a", "B", "--", "1 2")] == [None] * 5


def test_items_are_read_one_token_at_a_time() -> None:
    """Each id decoded on its own and stripped: "4" then "80" are two numbers, a spaced
    letter is its letter, ids up to 20 and special tokens are dropped."""
    tok = build_tokenizer(preset("tiny"))
    ids = [tok.token_to_id(t) for t in ("M", "4", "Ġm", "\u0120")]
    assert None not in ids
    assert decode_items(tok, [0, 5, 17, 18, 20, *ids, tok.token_to_id("8")]) == ["M", "4", "m", "8"]
    items = token_items(tok, {i for i in range(18)})
    assert items[:21] == [None] * 21
    assert items[tok.token_to_id("Ġm")] == "m" and items[tok.token_to_id("\u0120")] == ""


def test_the_kind_vocabulary_leaves_out_what_a_path_never_holds() -> None:
    vocab = TokenVocab.from_tokenizer(byte_level_bpe())
    tok = byte_level_bpe()
    items = token_items(tok, vocab.special_ids)
    kinds = kind_vocab(items)
    assert kinds.size == len(items) and kinds.digest != vocab.digest
    by_text = {tok.id_to_token(i): p for i, p in enumerate(kinds.pieces)}
    assert by_text["M"] == b"M" and by_text["Ġ10"] == b"#" and by_text["5"] == b"#"
    assert by_text["Ġ"] == b" " and by_text["e"] is None and by_text["<|endoftext|>"] is None
    # This vocabulary puts "-" and "0" among the first ids, which a path drops like specials.
    assert tok.token_to_id("-") <= 20 and by_text["-"] is None and by_text["0"] is None
