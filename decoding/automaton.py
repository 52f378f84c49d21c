"""Byte-level DFAs: the one representation every text constraint compiles to.

A constraint (regex, list of choices, SVG path language) becomes a deterministic automaton over
UTF-8 *bytes*, not characters. Tokens of a byte-level BPE vocabulary are byte strings that may
hold half of a multi-byte character; walking bytes handles them with no special case, and every
language built here only accepts valid UTF-8, so a finished answer always decodes cleanly.

Conventions:
  * state 0 is DEAD: every transition loops to it and it never accepts;
  * `trans` is a dense int32 table [n_states, 256];
  * after `trimmed()`, every state other than DEAD can still reach an accepting state, so "the
    walk is not in DEAD" means "the input is a prefix of some accepted string".
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

import numpy as np

DEAD = 0


@dataclass(frozen=True, eq=False)
class Dfa:
    """A byte DFA: transition table, accepting flags and start state (state 0 is DEAD)."""

    trans: np.ndarray  # int32 [n_states, 256]
    accepting: np.ndarray  # bool [n_states]
    start: int

    def __post_init__(self) -> None:
        if self.trans.ndim != 2 or self.trans.shape[1] != 256 or self.trans.dtype != np.int32:
            raise ValueError("trans must be an int32 array of shape [n_states, 256]")
        if self.accepting.shape != (self.trans.shape[0],) or self.accepting.dtype != np.bool_:
            raise ValueError("accepting must be a bool array with one entry per state")
        if np.any(self.trans[DEAD] != DEAD) or self.accepting[DEAD]:
            raise ValueError("state 0 must be the non-accepting DEAD sink")
        if not 0 <= self.start < self.n_states:
            raise ValueError("start state out of range")
        if self.trans.min() < 0 or self.trans.max() >= self.n_states:
            raise ValueError("transition target out of range")

    @property
    def n_states(self) -> int:
        return int(self.trans.shape[0])

    @cached_property
    def _rows(self) -> list[list[int]]:
        # Python lists make the per-byte walk in the commit path ~10x cheaper than numpy scalars.
        return self.trans.tolist()

    @cached_property
    def _accepting_list(self) -> list[bool]:
        return self.accepting.tolist()

    def walk(self, state: int, data: bytes) -> int:
        """State after consuming `data` from `state` (DEAD once the input leaves the language)."""
        rows = self._rows
        for b in data:
            state = rows[state][b]
        return state

    def is_accepting(self, state: int) -> bool:
        """Whether `state` accepts."""
        return self._accepting_list[state]

    def matches(self, data: bytes) -> bool:
        """Whether the whole of `data` is in the language."""
        return self.is_accepting(self.walk(self.start, data))

    def signature(self) -> str:
        """Content hash of the automaton (a cache key; equal for equal tables)."""
        h = hashlib.sha256()
        h.update(np.int64(self.start).tobytes())
        h.update(np.ascontiguousarray(self.trans, dtype="<i4").tobytes())
        h.update(np.packbits(self.accepting).tobytes())
        return h.hexdigest()

    def live_states(self) -> np.ndarray:
        """Bool [n_states]: states from which an accepting state is reachable."""
        live = self.accepting.copy()
        while True:
            grown = live | live[self.trans].any(axis=1)
            if np.array_equal(grown, live):
                return live
            live = grown

    def reachable_states(self) -> np.ndarray:
        """Bool [n_states]: states reachable from the start state."""
        seen = np.zeros(self.n_states, dtype=bool)
        seen[self.start] = True
        frontier = np.array([self.start])
        while frontier.size:
            nxt = np.unique(self.trans[frontier])
            nxt = nxt[~seen[nxt]]
            seen[nxt] = True
            frontier = nxt
        return seen

    def trimmed(self) -> Dfa:
        """Same state numbering, but every transition into a state that cannot accept goes to DEAD.

        After this, "not DEAD" means "can still finish", which is what token masks rely on.
        """
        live = self.live_states()
        trans = np.where(live[self.trans], self.trans, DEAD).astype(np.int32)
        trans[~live] = DEAD
        return Dfa(trans, self.accepting & live, self.start)

    def minimized(self) -> Dfa:
        """The minimal equivalent DFA, numbered canonically (BFS from start, byte order).

        Equal languages give equal tables, hence equal signatures and shared mask caches.
        """
        dfa = self.trimmed()
        keep = dfa.reachable_states()
        keep[DEAD] = True
        old_ids = np.flatnonzero(keep)
        remap = np.full(dfa.n_states, -1, dtype=np.int64)
        remap[old_ids] = np.arange(old_ids.size)
        trans = remap[dfa.trans[old_ids]]
        accepting = dfa.accepting[old_ids]
        # Moore refinement: split classes by (class, classes of all successors) until stable.
        cls = np.where(accepting, 2, 1)
        cls[DEAD] = 0
        n_cls = len(np.unique(cls))
        while True:
            sig = np.concatenate([cls[:, None], cls[trans]], axis=1)
            _, new_cls = np.unique(sig, axis=0, return_inverse=True)
            new_cls = new_cls.reshape(-1)
            n_new = int(new_cls.max()) + 1
            cls = new_cls
            if n_new == n_cls:
                break
            n_cls = n_new
        start = int(cls[remap[dfa.start]])
        cls_trans = np.zeros((n_cls, 256), dtype=np.int64)
        cls_trans[cls] = cls[trans]
        cls_acc = np.zeros(n_cls, dtype=bool)
        cls_acc[cls] = accepting
        return _canonical(cls_trans, cls_acc, start, dead=int(cls[DEAD]))


def _canonical(trans: np.ndarray, accepting: np.ndarray, start: int, dead: int) -> Dfa:
    """Renumber states: DEAD first, then BFS order from start, successors in byte order."""
    order = [dead]
    index = {dead: 0}
    queue = deque([start])
    if start not in index:
        index[start] = len(order)
        order.append(start)
    rows = trans.tolist()
    while queue:
        s = queue.popleft()
        for t in rows[s]:
            if t not in index:
                index[t] = len(order)
                order.append(t)
                queue.append(t)
    lookup = np.zeros(trans.shape[0], dtype=np.int32)
    for old, new in index.items():
        lookup[old] = new
    order_arr = np.array(order)
    new_trans = lookup[trans[order_arr]].astype(np.int32)
    return Dfa(new_trans, accepting[order_arr].copy(), index[start])


def choices_dfa(choices: Iterable[str]) -> Dfa:
    """DFA accepting exactly the given strings (UTF-8 encoded)."""
    words = [c.encode("utf-8") for c in choices]
    if not words:
        raise ValueError("choices must not be empty")
    # A byte trie is already deterministic; minimizing merges shared suffixes.
    children: list[dict[int, int]] = [{}, {}]  # state 0 DEAD, state 1 root
    accepting = [False, False]
    for word in words:
        node = 1
        for b in word:
            nxt = children[node].get(b)
            if nxt is None:
                nxt = len(children)
                children[node][b] = nxt
                children.append({})
                accepting.append(False)
            node = nxt
        accepting[node] = True
    trans = np.zeros((len(children), 256), dtype=np.int32)
    for state, edges in enumerate(children):
        for b, target in edges.items():
            trans[state, b] = target
    return Dfa(trans, np.array(accepting, dtype=bool), 1).minimized()
