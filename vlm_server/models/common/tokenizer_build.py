"""Build a byte-level BPE tokenizer of any size, deterministically, with no downloads.

The merges first spell out a built-in list of common words (with and without a leading space,
so prompts tokenize into a few tokens), then add seeded pseudo-random merges until the
requested size. Special tokens sit at the ids the token contract names.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from decoding.vocab import byte_level_alphabet
from vlm_server.models.common.contracts import GPT2_EOS, TINY_SPECIAL_TOKENS
from vlm_server.models.contract import TokenContract

# Enough everyday words that captions of random weights read as words, not byte soup.
_WORDS = tuple(
    """
the a an of and to in is on with for at by from as that this it its are was be has have
there here what which who where how many much one two three four five red green blue black
white yellow dog cat car person man woman child tree house road sky water sign window door
table chair bird horse bus truck bicycle street building grass cloud light left right top
bottom small large image picture photo shows showing standing sitting near next under over
background foreground front behind group some several people color colour face hand head
""".split()  # noqa: SIM905
)

# The 2025-06 layout's reserved ids (bos/eos, template brackets, answer, coord, size, ...).
_CONTRACT_2025_06_SPECIALS = TINY_SPECIAL_TOKENS[:10]


class TokenizerSpec(Protocol):
    """What the builder reads of a configuration: its contract and its tokenizer's size."""

    @property
    def tokens(self) -> TokenContract: ...

    @property
    def tokenizer_vocab_size(self) -> int: ...


@dataclass(frozen=True)
class Vocabulary:
    """A `TokenizerSpec` of its own, for a family whose configuration names another era's
    synthetic vocabulary."""

    tokens: TokenContract
    tokenizer_vocab_size: int


def _specials_for(config: TokenizerSpec) -> dict[int, str]:
    contract = config.tokens
    if contract.name == "tiny":
        return dict(enumerate(TINY_SPECIAL_TOKENS))
    if contract.eos_id == GPT2_EOS:
        if config.tokenizer_vocab_size > GPT2_EOS:
            return {GPT2_EOS: "<|endoftext|>"}
        return {}
    return dict(enumerate(_CONTRACT_2025_06_SPECIALS))


def build_tokenizer(
    config: TokenizerSpec, seed: int = 0, words: Sequence[str] = _WORDS, spaced_only: bool = False
) -> Tokenizer:
    """A byte-level BPE tokenizer with exactly ``config.tokenizer_vocab_size`` entries whose
    merges spell ``words`` first (with a leading space, and without unless ``spaced_only``)."""
    size = config.tokenizer_vocab_size
    specials = _specials_for(config)
    byte_chars = list(byte_level_alphabet().values())
    n_regular = size - len(specials)
    if n_regular < len(byte_chars):
        raise ValueError(f"tokenizer_vocab_size {size} leaves no room for the 256 byte tokens")

    tokens: list[str] = list(byte_chars)
    known = set(tokens)
    merges: list[tuple[str, str]] = []

    def add_merge(a: str, b: str) -> None:
        if len(tokens) < n_regular and a + b not in known:
            merges.append((a, b))
            tokens.append(a + b)
            known.add(a + b)

    space = byte_level_alphabet()[ord(" ")]
    # Spaced words first: BPE applies merges by rank, so "Ġ"+"r" must outrank "r"+"e" for
    # " red" to become one token.
    for spelled in [space + w for w in words] + ([] if spaced_only else list(words)):
        # Left-to-right merges: "Ġ"+"c" -> "Ġc", "Ġc"+"a" -> "Ġca", ...
        for i in range(1, len(spelled)):
            add_merge(spelled[:i], spelled[i])
    rng = random.Random(seed)
    letters = [c for c in byte_chars if c.isalpha() and c.isascii()] + [space]
    while len(tokens) < n_regular:
        # Short pieces merge more often, like a real BPE; pieces stay inside printable text.
        piece = tokens[rng.randrange(len(tokens))]
        left = piece if rng.random() < 0.5 else rng.choice(letters)
        right = rng.choice(letters) if rng.random() < 0.8 else piece
        if right.startswith(space) or len(left) + len(right) > 12:
            continue
        add_merge(left, right)

    vocab: dict[str, int] = {}
    regular = iter(tokens)
    for i in range(size):
        vocab[specials[i] if i in specials else next(regular)] = i
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(specials.values()))
    if tokenizer.get_vocab_size() != size:
        raise AssertionError(f"built {tokenizer.get_vocab_size()} tokens, wanted {size}")
    return tokenizer
