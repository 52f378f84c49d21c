"""Incremental, UTF-8-safe detokenization: each token's bytes are decoded once.

`push(id)` returns only complete characters; bytes of a character split across tokens wait in
the incremental UTF-8 decoder. Invalid sequences become U+FFFD exactly as a whole-text decode
would (Python's incremental decoder and the tokenizers library both replace each maximal
invalid subpart with one U+FFFD), so the concatenation of all pushes and `flush()` equals
`tokenizer.decode(ids)` for byte-level tokenizers.

Sentencepiece-style vocabularies follow the library's ByteFallback rule: a run of `<0xHH>`
tokens is decoded as a whole when the run ends; if the run is not valid UTF-8 each of its bytes
becomes one U+FFFD. A leading space the decoder strips is dropped once, at the start.

Ids the tokenizer does not know (the model's vocabulary is padded beyond it) produce nothing.
Special tokens are skipped unless `skip_special_tokens=False`.
"""

from __future__ import annotations

import codecs

from .vocab import TokenVocab


class StreamDetokenizer:
    """Turns a stream of token ids into a stream of text pieces; O(bytes) per push."""

    def __init__(self, vocab: TokenVocab, skip_special_tokens: bool = True) -> None:
        self._vocab = vocab
        self._skip_special = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._run = bytearray()  # pending sentencepiece byte-fallback run
        self._strip_pending = vocab.strip_leading_space
        self._held_space = False  # a trailing space kept back (vocab.strip_trailing_space)

    def push(self, token_id: int) -> str:
        """Text completed by this token (possibly empty)."""
        vocab = self._vocab
        if not 0 <= token_id < vocab.size:
            return ""
        piece = vocab.pieces[token_id]
        if piece is None or (self._skip_special and token_id in vocab.special_ids):
            return ""
        if vocab.style == "byte_level":
            return self._emit(self._utf8.decode(piece))
        if token_id in vocab.byte_tokens:
            self._run += piece
            return ""
        return self._emit(self._end_run() + piece.decode("utf-8", errors="replace"))

    def flush(self) -> str:
        """Whatever is still pending at the end of the stream."""
        if self._vocab.style == "byte_level":
            text = self._emit(self._utf8.decode(b"", final=True))
        else:
            text = self._emit(self._end_run())
        self._held_space = False  # the decoder drops the output's last space
        return text

    def _end_run(self) -> str:
        if not self._run:
            return ""
        run, self._run = bytes(self._run), bytearray()
        try:
            return run.decode("utf-8")
        except UnicodeDecodeError:
            return "\ufffd" * len(run)

    def _emit(self, text: str) -> str:
        if self._strip_pending and text:
            self._strip_pending = False
            if text[0] == " ":
                text = text[1:]
        if not self._vocab.strip_trailing_space or not text:
            return text
        if self._held_space:
            text = " " + text
        self._held_space = text.endswith(" ")
        return text[:-1] if self._held_space else text


def detokenize(vocab: TokenVocab, ids: list[int], skip_special_tokens: bool = True) -> str:
    """Whole-sequence convenience wrapper around StreamDetokenizer."""
    stream = StreamDetokenizer(vocab, skip_special_tokens)
    return "".join(stream.push(i) for i in ids) + stream.flush()
