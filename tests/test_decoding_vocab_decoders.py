"""Tokenizers with decoders that have no exact byte mapping (WordPiece, BPEDecoder, none at
all) are read through the library's own decoder: detokenization matches `Tokenizer.decode`,
and constraints compile over the pieces."""

from __future__ import annotations

import random

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from decoding.constraints import ConstraintCompiler
from decoding.detokenize import detokenize
from decoding.mask_table import MaskTable
from decoding.vocab import TokenVocab

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a red car and a blue bus wait at the light, then leave.",
    "yes, no, maybe: counting 12 cars and 7 dogs!",
    "segment the tree; point at the sign",
] * 20
SPECIAL = ["<|endoftext|>", "[UNK]"]


def _wordpiece() -> Tokenizer:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        CORPUS, trainers.WordPieceTrainer(vocab_size=200, special_tokens=SPECIAL)
    )
    tok.decoder = decoders.WordPiece()
    return tok


def _bpe_suffix() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="[UNK]", end_of_word_suffix="</w>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=SPECIAL, end_of_word_suffix="</w>")
    tok.train_from_iterator(CORPUS, trainer)
    tok.decoder = decoders.BPEDecoder(suffix="</w>")
    return tok


def _no_decoder() -> Tokenizer:
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS, trainers.WordLevelTrainer(special_tokens=SPECIAL))
    return tok


@pytest.fixture(params=[_wordpiece, _bpe_suffix, _no_decoder], ids=lambda f: f.__name__)
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    return request.param()


def test_library_decoders_are_accepted_and_detokenize_like_decode(tokenizer: Tokenizer) -> None:
    vocab = TokenVocab.from_tokenizer(tokenizer)
    assert vocab.style == "text" and vocab.size == tokenizer.get_vocab_size()
    rng = random.Random(0)
    for sentence in CORPUS[:4]:
        ids = tokenizer.encode(sentence).ids
        assert detokenize(vocab, ids) == tokenizer.decode(ids)
        for _ in range(5):  # random cuts: a stream may start anywhere
            cut = ids[rng.randrange(len(ids)) :]
            assert detokenize(vocab, cut) == tokenizer.decode(cut)


def test_constraints_compile_over_library_pieces(tokenizer: Tokenizer) -> None:
    vocab = TokenVocab.from_tokenizer(tokenizer)
    eos = tokenizer.token_to_id("<|endoftext|>")
    table = MaskTable(vocab.size + 8)
    compiler = ConstraintCompiler(vocab, table, eos)
    # Separators sit before words (WordPiece, no decoder) or after them (word suffix).
    choices = [" red car", "red car ", " blue bus", "blue bus "]
    rows = compiler.choices(choices, max_tokens=12)
    rng = np.random.default_rng(0)
    for _ in range(10):
        state, remaining, out = rows.dfa.start, 12, []
        while True:
            row = rows.row(state, remaining)
            allowed = np.flatnonzero(table.allowed(row)) if row >= 0 else np.array([eos])
            token = int(rng.choice(allowed))
            if token == eos:
                break
            state = rows.step(state, token, remaining)
            remaining -= 1
            out.append(token)
        text = b"".join(rows.piece(t) for t in out).decode()
        assert text in choices
    compiler.release(rows)
