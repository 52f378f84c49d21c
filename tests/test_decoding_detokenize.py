"""Streaming detokenization equals `Tokenizer.decode` and never splits a character."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from decoding.detokenize import StreamDetokenizer, detokenize
from decoding.vocab import TokenVocab, byte_level_alphabet, byte_level_bytes
from tests.support.toy_tokenizers import (
    CORPUS,
    byte_fallback_bpe,
    byte_level_bpe,
    random_byte_level,
)

TEXTS = [
    *CORPUS,
    "",
    " ",
    "😀😀😀",
    "a😀b🇫🇷c",
    "👍🏽 family: 👨‍👩‍👧",
    "mixed 日本語 and émoji 🎉!",
    "\n\n\t  trailing   ",
]


@pytest.fixture(scope="module", params=["byte_level", "byte_fallback", "synthetic"])
def tok(request: pytest.FixtureRequest) -> Tokenizer:
    if request.param == "byte_level":
        t = byte_level_bpe(vocab_size=400)
        t.add_tokens(["   ", "Ġx", "zz"])  # added non-special tokens, as CodeGen has
        t.add_special_tokens(["<special>"])
        return t
    if request.param == "byte_fallback":
        return byte_fallback_bpe()
    return random_byte_level(3000, seed=1)


@pytest.fixture(scope="module")
def vocab(tok: Tokenizer) -> TokenVocab:
    return TokenVocab.from_tokenizer(tok)


def _stream(vocab: TokenVocab, ids: list[int], skip: bool = True) -> list[str]:
    stream = StreamDetokenizer(vocab, skip_special_tokens=skip)
    return [stream.push(i) for i in ids] + [stream.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_texts(tok: Tokenizer, vocab: TokenVocab, text: str) -> None:
    ids = tok.encode(text).ids
    pieces = _stream(vocab, ids)
    assert "".join(pieces) == tok.decode(ids)
    # Characters split across tokens are held back, never emitted as replacement characters.
    assert "\ufffd" not in "".join(pieces)


def test_emoji_split_across_tokens_is_held_back() -> None:
    vocab = TokenVocab.from_tokenizer(random_byte_level(1000, seed=2))
    tok_ids = {bytes([b]): i for i, p in enumerate(vocab.pieces) if p and len(p) == 1 for b in p}
    emoji = "😀".encode()
    stream = StreamDetokenizer(vocab)
    outs = [stream.push(tok_ids[bytes([b])]) for b in emoji]
    assert outs == ["", "", "", "😀"]
    assert stream.flush() == ""
    assert byte_level_alphabet()[0x20] == "\u0120"  # the GPT-2 stand-in for a space


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_random_ids_match_decode(tok: Tokenizer, vocab: TokenVocab, data: st.DataObject) -> None:
    n = tok.get_vocab_size(with_added_tokens=True)
    ids = data.draw(st.lists(st.integers(0, n + 20), max_size=16))
    skip = data.draw(st.booleans())
    assert "".join(_stream(vocab, ids, skip)) == tok.decode(ids, skip_special_tokens=skip)


def test_out_of_range_ids_decode_to_nothing(tok: Tokenizer, vocab: TokenVocab) -> None:
    n = tok.get_vocab_size(with_added_tokens=True)
    ids = tok.encode("hello 😀").ids
    padded = [n + 5, *ids, 51199, n]
    assert detokenize(vocab, padded) == tok.decode(padded) == tok.decode(ids)


def test_byte_fallback_runs() -> None:
    tok = byte_fallback_bpe()
    vocab = TokenVocab.from_tokenizer(tok)
    byte_id = {tok.token_to_id(f"<0x{b:02X}>"): b for b in range(256)}
    ids = {b: i for i, b in byte_id.items()}
    euro = [ids[b] for b in "€".encode()]
    assert detokenize(vocab, euro) == tok.decode(euro) == "€"
    broken = [ids[0xE2], ids[0x82]]  # a truncated character: one U+FFFD per byte
    assert detokenize(vocab, broken) == tok.decode(broken) == "\ufffd\ufffd"
    stream = StreamDetokenizer(vocab)
    assert [stream.push(i) for i in euro] == ["", "", ""]
    assert stream.flush() == "€"


def test_special_tokens_skipped_by_default() -> None:
    tok = byte_level_bpe(vocab_size=300)
    vocab = TokenVocab.from_tokenizer(tok)
    eos = tok.token_to_id("<|endoftext|>")
    ids = [*tok.encode("hi").ids, eos]
    assert detokenize(vocab, ids) == "hi"
    assert detokenize(vocab, ids, skip_special_tokens=False) == "hi<|endoftext|>"


def test_byte_level_bytes_rule() -> None:
    assert byte_level_bytes("\u0120hello") == b" hello"
    assert byte_level_bytes("   ") == b"   "  # not stand-ins: plain UTF-8, like the library
    assert byte_level_bytes("Ã©") == "é".encode()


def test_decoders_without_a_byte_mapping_are_read_through_the_library() -> None:
    from tokenizers import decoders, models

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    for decoder in (None, decoders.WordPiece()):
        if decoder is not None:
            tok.decoder = decoder
        vocab = TokenVocab.from_tokenizer(tok)
        assert vocab.style == "text"
        assert detokenize(vocab, [0, 1, 0]) == tok.decode([0, 1, 0])


def test_linear_work_per_push() -> None:
    """Each push touches only its own token's bytes (no re-decoding of the prefix)."""
    vocab = TokenVocab.from_tokenizer(random_byte_level(1000, seed=3))
    stream = StreamDetokenizer(vocab)
    some = next(i for i, p in enumerate(vocab.pieces) if p == b" ab" or (p and p.isalpha()))
    total = "".join(stream.push(some) for _ in range(20000))
    assert len(total) == 20000 * len(vocab.pieces[some])
