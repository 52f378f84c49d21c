"""Small tokenizers built from scratch with the `tokenizers` library, for tests and benchmarks.

Nothing is downloaded: a byte-level BPE trained on a fixed corpus (GPT-2 style), a synthetic
byte-level vocabulary of any size (random byte strings plus all 256 single bytes, for timing
mask builds at the real 51,200-entry size), and a sentencepiece-style BPE with byte fallback.
"""

from __future__ import annotations

import json
import random

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from decoding.vocab import byte_level_alphabet

EOS = "<|endoftext|>"

CORPUS = [
    "A photo of a cat sitting on a red chair next to the window.",
    "Two dogs play in the park; one of them holds a stick. The sky is blue.",
    "Question: how many apples are on the table? Answer: there are 3 apples.",
    "The answer is yes. The answer is no. Maybe 42, maybe 1024 or 7.5 percent.",
    "M 10 20 L 30 40 L 50 60 Q 1 2 3 4 C 5 6 7 8 9 10 Z M 0 0 L 100 100 Z",
    "email: someone@example.com, phone 555-1234, date 2024-06-21, price $19.99",
    "Café, naïve, façade, résumé, Zürich, São Paulo, Ångström, crème brûlée.",
    "日本語のテキスト、中文文本、한국어 텍스트, русский текст, ελληνικά.",
    "Emoji: 😀 🎉 👍🏽 🐈‍⬛ ❤️ and flags 🇫🇷 🇯🇵 in a sentence.",
    "def main():\n    return {'key': [1, 2, 3]}  # code\n\n\tindented\r\n",
    "UPPER lower MiXeD 0123456789 !@#$%^&*()_+-=[]{}|;':\",./<>?`~",
]


def byte_level_bpe(vocab_size: int = 1000, corpus: list[str] | None = None) -> Tokenizer:
    """GPT-2 style byte-level BPE trained on `corpus` (default: a fixed mixed-script corpus).

    The eos token `<|endoftext|>` is special and has id 0.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[EOS],
        show_progress=False,
    )
    tok.train_from_iterator((corpus or CORPUS) * 20, trainer)
    return tok


def random_byte_level(n_tokens: int = 51200, seed: int = 0) -> Tokenizer:
    """Byte-level vocabulary of `n_tokens` entries: all 256 bytes, random text-like and raw byte
    strings, and `<|endoftext|>` (special, last id). No merges: for decoding and masks only."""
    rng = random.Random(seed)
    alphabet = byte_level_alphabet()
    strings: set[bytes] = {bytes([b]) for b in range(256)}
    letters = "abcdefghijklmnopqrstuvwxyz"
    while len(strings) < n_tokens - 1:
        kind = rng.random()
        if kind < 0.45:
            word = "".join(rng.choice(letters) for _ in range(rng.randint(1, 9)))
            piece = (" " + word).encode()
        elif kind < 0.65:
            word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
            piece = (word.capitalize() if rng.random() < 0.3 else word).encode()
        elif kind < 0.75:
            digits = str(rng.randint(0, 999))
            piece = (" " + digits if rng.random() < 0.5 else digits).encode()
        elif kind < 0.85:
            piece = "".join(rng.choice(" .,;:!?-'\"()\n\t") for _ in range(rng.randint(2, 4)))
            piece = piece.encode()
        else:
            piece = bytes(rng.randrange(256) for _ in range(rng.randint(2, 4)))
        strings.add(piece)
    ordered = sorted(strings, key=lambda s: (len(s), s))
    vocab = {"".join(alphabet[b] for b in s): i for i, s in enumerate(ordered)}
    vocab[EOS] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    return tok


def byte_fallback_bpe(vocab_size: int = 300, corpus: list[str] | None = None) -> Tokenizer:
    """Sentencepiece-style BPE ("▁" for spaces, `<0xHH>` byte fallback, leading space stripped
    on decode). Ids 0-2 are the special `<unk>`, `<s>`, `</s>`; then the 256 byte tokens."""
    text = [line for line in (corpus or CORPUS) if line.isascii()]
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    trainer_tok.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False)
    trainer_tok.train_from_iterator(text * 20, trainer)
    model = json.loads(trainer_tok.to_str())["model"]
    vocab: dict[str, int] = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in sorted(model["vocab"], key=model["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = trainer_tok.normalizer
    tok.pre_tokenizer = trainer_tok.pre_tokenizer
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok
