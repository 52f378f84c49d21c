"""The token grammar of Moondream 3's segment path: svg_tokens.py's parser as an automaton.

Each token adds exactly one item to the path, so the language is one over tokens, not over
the bytes of their concatenation ("4" then "80" are two numbers, not 480). The project's mask
compiler works on byte DFAs over a vocabulary's pieces, so the language is written over item
kinds and the vocabulary is seen through a stand-in whose piece for each token is the single
byte of its item's kind (a letter, "-", "0" for the numbers 0 and 1, "#" for the other
numbers, " " for a whitespace token), or None when the token can never be in a path. Walking
a token through this DFA is walking its kind; the compiler then precomputes the mask rows per
state and remaining budget, eos only where the path may end, as for any other constraint.

The DFA is generated from `svg_tokens.next_state`, the parser's own transitions, so the
grammar admits exactly the item sequences the parser accepts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from .automaton import DEAD, Dfa
from .svg_tokens import FLAG_NUMBER, LETTERS, MINUS, NUMBER, SPACE, START, item_kind, next_state
from .vocab import TokenVocab

KINDS = LETTERS + MINUS + FLAG_NUMBER + NUMBER + SPACE


def path_dfa() -> Dfa:
    """The path language over item kinds (one byte per token), minimized."""
    index = {START: 1}
    order = [None, START]  # state 0 is DEAD
    edges: list[tuple[int, int, int]] = []
    pos = 1
    while pos < len(order):
        state = order[pos]
        assert state is not None
        for kind in KINDS:
            nxt = next_state(state, kind)
            if nxt is None:
                continue
            if nxt not in index:
                index[nxt] = len(order)
                order.append(nxt)
            edges.append((pos, ord(kind), index[nxt]))
        pos += 1
    trans = np.full((len(order), 256), DEAD, dtype=np.int32)
    for s, b, t in edges:
        trans[s, b] = t
    accepting = np.array([s is not None and s.accepting for s in order], dtype=bool)
    return Dfa(trans, accepting, 1).minimized()


def kind_vocab(items: Sequence[str | None]) -> TokenVocab:
    """The stand-in vocabulary: per token id, the byte of its item's kind (None: never in a
    path). ``items`` are `svg_tokens.token_items`."""
    pieces: list[bytes | None] = []
    for item in items:
        kind = item_kind(item) if item is not None else None
        pieces.append(kind.encode("ascii") if kind is not None else None)
    h = hashlib.sha256(b"svg-token-kinds")
    for piece in pieces:
        h.update(piece or b"\xff")
    return TokenVocab(tuple(pieces), frozenset(), frozenset(), "text", False, h.hexdigest())
