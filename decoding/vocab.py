"""What each token id contributes to the output, as bytes: the shared input of masks and
detokenization.

Two decoder families are understood, read from the tokenizer's own decoder config:

* byte-level BPE (GPT-2, CodeGen/Phi, Moondream): a token string is a sequence of stand-in
  characters, one per byte. A token whose characters are not all stand-ins (an added token such
  as a run of spaces) contributes its plain UTF-8 bytes instead, exactly as the library's
  ByteLevel decoder does.
* sentencepiece style (Replace "▁"->" ", ByteFallback, Fuse, Strip, or Metaspace): `<0xHH>`
  tokens are single raw bytes, other pieces are UTF-8 text with "▁" read as a space; the
  decoder may strip one leading space from the whole output.

Any other decoder the library supports (WordPiece, BPEDecoder, CTC, other sequences, or none)
is read through the library itself ("text" style): a token's piece is what it adds to the
decoded text after a fixed one-token anchor, so context such as WordPiece's "##" joins or a
decoder's leading-space strip is taken into account. Such pieces are whole characters: a token
whose own text is not (it decodes to U+FFFD) is left out of constraints.

Special tokens (eos, template markers) are kept apart: masks never allow them except eos, and
detokenization skips them by default, like `Tokenizer.decode`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

from tokenizers import Tokenizer

Style = Literal["byte_level", "sentencepiece", "text"]


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> stand-in character table (printable Latin-1 maps to itself)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shift)
            shift += 1
    return table


_CHAR_TO_BYTE = {c: b for b, c in byte_level_alphabet().items()}


def byte_level_bytes(token: str) -> bytes:
    """Bytes of one byte-level BPE token string (plain UTF-8 when it is not all stand-ins)."""
    try:
        return bytes(_CHAR_TO_BYTE[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


def _byte_fallback_value(token: str) -> int | None:
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return int(token[3:5], 16)
        except ValueError:
            return None
    return None


@dataclass(frozen=True, eq=False)
class TokenVocab:
    """Per token id: its output bytes, whether it is special, and the decoder style.

    `pieces[i]` is None for ids the tokenizer does not know. `byte_tokens` holds the
    sentencepiece `<0xHH>` ids (decoded in runs, see detokenize.py).
    """

    pieces: tuple[bytes | None, ...]
    special_ids: frozenset[int]
    byte_tokens: frozenset[int]
    style: Style
    strip_leading_space: bool
    digest: str
    # The decoder drops a trailing space from the whole output (a word-suffix decoder's last
    # separator): the detokenizer holds a trailing space back until more text follows.
    strip_trailing_space: bool = False

    @property
    def size(self) -> int:
        """Number of ids the tokenizer knows (the model's vocabulary may be larger)."""
        return len(self.pieces)

    def text_pieces(self) -> list[bytes | None]:
        """Per id: bytes for ids a constraint may use; None for special and unknown ids."""
        return self._text_pieces

    @cached_property
    def _text_pieces(self) -> list[bytes | None]:
        return [None if i in self.special_ids else p for i, p in enumerate(self.pieces)]

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> TokenVocab:
        """Read the pieces from a `tokenizers.Tokenizer`, whatever its decoder."""
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        size = max(vocab.values()) + 1 if vocab else 0
        strings: list[str | None] = [None] * size
        for token, idx in vocab.items():
            strings[idx] = token
        special = frozenset(
            idx for idx, added in tokenizer.get_added_tokens_decoder().items() if added.special
        )
        try:
            style, strip, meta, fallback = _decoder_style(
                json.loads(tokenizer.to_str()).get("decoder")
            )
        except ValueError:  # a decoder without an exact byte mapping: ask the library
            pieces, strip, trail = _library_pieces(tokenizer, strings, special)
            digest = _digest(f"text|{trail}", strip, pieces, special)
            return cls(tuple(pieces), special, frozenset(), "text", strip, digest, trail)
        pieces: list[bytes | None] = []
        byte_tokens = set()
        for idx, token in enumerate(strings):
            if token is None:
                pieces.append(None)
                continue
            value = _byte_fallback_value(token) if fallback and idx not in special else None
            if style == "byte_level":
                pieces.append(byte_level_bytes(token))
            elif value is not None:
                pieces.append(bytes([value]))
                byte_tokens.add(idx)
            else:
                pieces.append((token.replace(meta, " ") if meta else token).encode("utf-8"))
        digest = _digest(style, strip, pieces, special)
        return cls(tuple(pieces), special, frozenset(byte_tokens), style, strip, digest)


def _library_pieces(
    tokenizer: Tokenizer, strings: list[str | None], special: frozenset[int]
) -> tuple[list[bytes | None], bool, bool]:
    """Per id, the text the library's decoder gives the token in context; and whether the
    decoder strips a leading / a trailing space from the whole output.

    Decoders put a token's separator before it (WordPiece, none) or after it (BPEDecoder's
    word suffix), so both readings are taken -- what a token adds after an anchor token, and
    what it adds before one -- and the one that reproduces `decode` on a probe text wins.
    """
    texts = [i for i, t in enumerate(strings) if t is not None and i not in special]
    base: list[bytes | None] = [
        t.encode("utf-8") if t is not None and i in special else None for i, t in enumerate(strings)
    ]
    anchor = _anchor(tokenizer, texts)
    if anchor is None:
        return base, False, False
    alone = tokenizer.decode([anchor], skip_special_tokens=False)
    after = tokenizer.decode_batch([[anchor, i] for i in texts], skip_special_tokens=False)
    before = tokenizer.decode_batch([[i, anchor] for i in texts], skip_special_tokens=False)
    readings = []
    for decoded, cut in ((after, _after_prefix), (before, _before_suffix)):
        pieces = list(base)
        for i, text in zip(texts, decoded, strict=True):
            piece = cut(text, alone)
            if piece is not None and ("\ufffd" not in piece or "\ufffd" in (strings[i] or "")):
                pieces[i] = piece.encode("utf-8")
        strips = _strips_spaces(tokenizer, pieces, texts)
        readings.append((pieces, *strips))
    probe = tokenizer.encode(tokenizer.decode(texts[:: max(1, len(texts) // 48)])).ids
    want = tokenizer.decode(probe)

    def misses(reading: tuple[list[bytes | None], bool, bool]) -> int:
        pieces, lead, trail = reading
        got = b"".join(pieces[i] or b"" for i in probe if i not in special).decode("utf-8")
        got = got[1:] if lead and got.startswith(" ") else got
        got = got[:-1] if trail and got.endswith(" ") else got
        return sum(a != b for a, b in zip(got, want, strict=False)) + abs(len(got) - len(want))

    return min(readings, key=misses)


def _after_prefix(text: str, anchor: str) -> str | None:
    return text[len(anchor) :] if text.startswith(anchor) else None


def _before_suffix(text: str, anchor: str) -> str | None:
    return text[: len(text) - len(anchor)] if text.endswith(anchor) else None


def _strips_spaces(
    tokenizer: Tokenizer, pieces: list[bytes | None], texts: list[int]
) -> tuple[bool, bool]:
    """Whether a token decoded alone loses the leading / trailing space it has in context."""
    lead = trail = None
    for i in texts:
        piece = pieces[i]
        if piece is None or len(piece) < 2 or piece.strip(b" ") == b"":
            continue
        alone = tokenizer.decode([i], skip_special_tokens=False)
        if lead is None and piece.startswith(b" "):
            lead = alone == piece[1:].decode("utf-8")
        if trail is None and piece.endswith(b" "):
            trail = alone == piece[:-1].decode("utf-8")
        if lead is not None and trail is not None:
            break
    return bool(lead), bool(trail)


def _anchor(tokenizer: Tokenizer, ids: list[int]) -> int | None:
    """A token that decodes alone to plain ASCII letters or digits (None if there is none)."""
    for start in range(0, len(ids), 256):
        chunk = ids[start : start + 256]
        for i, text in zip(chunk, tokenizer.decode_batch([[i] for i in chunk]), strict=True):
            if text.isascii() and text.isalnum():
                return i
    return None


def _digest(style: str, strip: bool, pieces: list[bytes | None], special: frozenset[int]) -> str:
    h = hashlib.sha256(f"{style}|{strip}|{len(pieces)}".encode())
    for idx, piece in enumerate(pieces):
        if piece is None:
            h.update(b"\xff\xff\xff\xff")
            continue
        h.update(len(piece).to_bytes(4, "little"))
        h.update(b"S" if idx in special else b"T")
        h.update(piece)
    return h.hexdigest()


def _decoder_style(config: dict | None) -> tuple[Style, bool, str | None, bool]:
    """(style, strips one leading space, meta-space character, byte fallback) from the
    tokenizer's decoder config."""
    if config is None:
        raise ValueError("tokenizer has no decoder; cannot map tokens to bytes")
    kind = config.get("type")
    if kind == "ByteLevel":
        return "byte_level", False, None, False
    if kind == "Metaspace":
        strip = config.get("prepend_scheme", "always") != "never"
        return "sentencepiece", strip, config.get("replacement", "\u2581"), False
    if kind != "Sequence":
        raise ValueError(f"unsupported tokenizer decoder {kind!r}")
    parts = config.get("decoders", [])
    kinds = [p.get("type") for p in parts]
    if kinds == ["ByteLevel"]:
        return "byte_level", False, None, False
    if not kinds or not set(kinds) <= {"Replace", "ByteFallback", "Fuse", "Strip"}:
        raise ValueError(f"unsupported tokenizer decoder sequence {kinds}")
    strip, meta = False, None
    for p in parts:
        if p["type"] == "Replace":
            meta = p.get("pattern", {}).get("String")
            if meta is None or len(meta) != 1 or p.get("content") != " ":
                raise ValueError("unsupported Replace decoder (only one character -> ' ')")
        if p["type"] == "Strip":
            if p.get("content") != " " or p.get("stop", 0) != 0 or p.get("start", 0) > 1:
                raise ValueError("unsupported Strip decoder (only one leading space)")
            strip = p.get("start", 0) == 1
    return "sentencepiece", strip, meta, "ByteFallback" in kinds
