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

from .limits import UNLIMITED, CompileBudget

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
        src, dst = _edges(self.trans)
        return _backward_reach(self.n_states, self.accepting, src, dst)

    def reachable_states(self) -> np.ndarray:
        """Bool [n_states]: states reachable from the start state."""
        seed = np.zeros(self.n_states, dtype=bool)
        seed[self.start] = True
        src, dst = _edges(self.trans)
        return _backward_reach(self.n_states, seed, dst, src)  # edges reversed: forward reach

    def trimmed(self) -> Dfa:
        """Same state numbering, but every transition into a state that cannot accept goes to DEAD.

        After this, "not DEAD" means "can still finish", which is what token masks rely on.
        """
        live = self.live_states()
        trans = np.where(live[self.trans], self.trans, DEAD).astype(np.int32)
        trans[~live] = DEAD
        return Dfa(trans, self.accepting & live, self.start)

    def minimized(self, budget: CompileBudget = UNLIMITED) -> Dfa:
        """The minimal equivalent DFA, numbered canonically (BFS from start, byte order).

        Equal languages give equal tables, hence equal signatures and shared mask caches.
        Acyclic automata (choices, bounded regexes) are minimized in one bottom-up pass;
        others by Moore refinement, which polls `budget` once per round.
        """
        dfa = self.trimmed()
        keep = dfa.reachable_states()
        keep[DEAD] = True
        old_ids = np.flatnonzero(keep)
        remap = np.full(dfa.n_states, -1, dtype=np.int64)
        remap[old_ids] = np.arange(old_ids.size)
        trans = remap[dfa.trans[old_ids]]
        accepting = dfa.accepting[old_ids]
        # Bytes no state tells apart share one column: signatures need one column per class.
        _, columns = np.unique(trans, axis=1, return_index=True)
        narrow = trans[:, np.sort(columns)]
        cls = _acyclic_classes(narrow, accepting, budget)
        if cls is None:
            cls = _moore_classes(narrow, accepting, budget)
        n_cls = int(cls.max()) + 1
        start = int(cls[remap[dfa.start]])
        cls_trans = np.zeros((n_cls, 256), dtype=np.int64)
        cls_trans[cls] = cls[trans]
        cls_acc = np.zeros(n_cls, dtype=bool)
        cls_acc[cls] = accepting
        return _canonical(cls_trans, cls_acc, start, dead=int(cls[DEAD]))


def _edges(trans: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct (source, target) pairs of `trans` [n, k], DEAD targets left out."""
    n = trans.shape[0]
    flat = np.arange(n, dtype=np.int64)[:, None] * n + trans.astype(np.int64)
    pairs = np.unique(flat[trans != DEAD])
    return pairs // n, pairs % n


def _backward_reach(
    n_states: int, seeds: np.ndarray, src: np.ndarray, dst: np.ndarray
) -> np.ndarray:
    """Bool [n_states]: `seeds` and every state with a path of edges (src -> dst) into them."""
    order = np.argsort(dst, kind="stable")
    preds = src[order].tolist()
    bounds = np.searchsorted(dst[order], np.arange(n_states + 1)).tolist()
    seen = seeds.astype(bool).copy()
    seen_list = seen.tolist()
    stack = np.flatnonzero(seen).tolist()
    while stack:
        s = stack.pop()
        for p in preds[bounds[s] : bounds[s + 1]]:
            if not seen_list[p]:
                seen_list[p] = True
                stack.append(p)
    return np.array(seen_list, dtype=bool)


def _acyclic_classes(
    trans: np.ndarray, accepting: np.ndarray, budget: CompileBudget
) -> np.ndarray | None:
    """Equivalence classes of a trimmed acyclic DFA in one bottom-up pass (None if cyclic).

    Equivalent states have equal heights (longest word to the end), so states are grouped
    height by height, leaves first, and each group is split by (accepting, successor classes)
    once every successor already has its class.
    """
    n = trans.shape[0]
    rows = trans.tolist()
    succ = [sorted({t for t in row if t != DEAD}) for row in rows]
    pending = [len(s) for s in succ]
    preds: list[list[int]] = [[] for _ in range(n)]
    for s, targets in enumerate(succ):
        for t in targets:
            preds[t].append(s)
    height = [0] * n
    ready = [s for s in range(1, n) if pending[s] == 0]
    order: list[int] = []
    while ready:
        s = ready.pop()
        order.append(s)
        for p in preds[s]:
            height[p] = max(height[p], height[s] + 1)
            pending[p] -= 1
            if pending[p] == 0:
                ready.append(p)
    if len(order) != n - 1:
        return None  # a cycle: some state never became ready
    cls = [0] * n  # DEAD is class 0
    acc = accepting.tolist()
    by_height: dict[int, list[int]] = {}
    for s in order:
        by_height.setdefault(height[s], []).append(s)
    signature: dict[tuple, int] = {}
    for h in sorted(by_height):
        budget.check()
        for s in by_height[h]:
            key = (h, acc[s], tuple(cls[t] for t in rows[s]))
            cls[s] = signature.setdefault(key, len(signature) + 1)
    return np.array(cls, dtype=np.int64)


def _moore_classes(trans: np.ndarray, accepting: np.ndarray, budget: CompileBudget) -> np.ndarray:
    """Equivalence classes by Moore refinement: split by (class, successor classes) until
    stable. DEAD (state 0) is alone in class 0."""
    cls = np.where(accepting, 2, 1)
    cls[DEAD] = 0
    n_cls = len(np.unique(cls))
    while True:
        budget.check()
        sig = np.concatenate([cls[:, None], cls[trans]], axis=1)
        _, new_cls = np.unique(sig, axis=0, return_inverse=True)
        new_cls = new_cls.reshape(-1)
        n_new = int(new_cls.max()) + 1
        cls = new_cls
        if n_new == n_cls:
            return cls
        n_cls = n_new


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


def choices_dfa(choices: Iterable[str], budget: CompileBudget = UNLIMITED) -> Dfa:
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
    return Dfa(trans, np.array(accepting, dtype=bool), 1).minimized(budget)
