"""A byte trie of a vocabulary, laid out level by level for vectorized walks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from .limits import UNLIMITED, CompileBudget


@dataclass(frozen=True, eq=False)
class TokenTrie:
    """Trie nodes in breadth-first order; node -1 (implicit) is the root.

    Nodes of depth d occupy ids `level_start[d-1] : level_start[d]`, sorted by parent, so a
    node's children are the contiguous ids `child_start[n] : child_start[n] + child_count[n]`.
    Several token ids may end at one node (equal byte strings); `token_node[t]` is -1 for ids
    that take no part (special, empty, blocked).
    """

    byte: np.ndarray  # int64 [n_nodes]: the byte on the edge into the node
    child_start: np.ndarray  # int64 [n_nodes]
    child_count: np.ndarray  # int64 [n_nodes]
    root_children: np.ndarray  # int64: ids of depth-1 nodes
    level_start: np.ndarray  # int64 [max_depth + 1]; level_start[0] == 0
    token_node: np.ndarray  # int64 [n_ids]

    @property
    def n_nodes(self) -> int:
        return int(self.byte.size)

    @classmethod
    def build(cls, pieces: Sequence[bytes | None]) -> TokenTrie:
        """Trie over the non-empty pieces; None marks ids to leave out."""
        uniq = sorted({p for p in pieces if p})
        n = len(uniq)
        lens = np.fromiter((len(p) for p in uniq), dtype=np.int64, count=n)
        width = int(lens.max()) if n else 0
        # Padded byte matrix, one row per distinct piece, in lexicographic order.
        pad = np.zeros((n, width), dtype=np.uint8)
        flat = np.frombuffer(b"".join(uniq), dtype=np.uint8)
        rows = np.repeat(np.arange(n), lens)
        pad[rows, np.arange(flat.size) - np.repeat(np.cumsum(lens) - lens, lens)] = flat
        # Longest common prefix with the previous row decides where a row branches off.
        lcp = np.zeros(n, dtype=np.int64)
        if n > 1:
            differs = pad[1:] != pad[:-1]
            first_diff = np.where(differs.any(axis=1), differs.argmax(axis=1), width)
            lcp[1:] = np.minimum(first_diff, np.minimum(lens[1:], lens[:-1]))
        depth = np.arange(1, width + 1)
        is_new = (lens[:, None] >= depth) & (lcp[:, None] < depth)  # [n, width]
        # Number nodes depth-major, rows in order: BFS order with siblings grouped by parent.
        new_depth, new_row = np.nonzero(is_new.T)
        n_nodes = new_row.size
        node_of = np.full((n, width), -1, dtype=np.int64)
        node_of[new_row, new_depth] = np.arange(n_nodes)
        node_of = np.maximum.accumulate(node_of, axis=0)  # rows sharing a prefix share its node
        byte = pad[new_row, new_depth].astype(np.int64)
        parent = np.where(new_depth > 0, node_of[new_row, np.maximum(new_depth - 1, 0)], -1)
        child_count = np.bincount(parent[parent >= 0], minlength=n_nodes).astype(np.int64)
        child_start = np.full(n_nodes, n_nodes, dtype=np.int64)
        has_parent = np.flatnonzero(parent >= 0)
        first = np.unique(parent[has_parent], return_index=True)
        child_start[first[0]] = has_parent[first[1]]
        level_start = np.searchsorted(new_depth, np.arange(width + 1)).astype(np.int64)
        row_of = {p: i for i, p in enumerate(uniq)}
        token_node = np.fromiter(
            (node_of[row_of[p], len(p) - 1] if p else -1 for p in pieces),
            dtype=np.int64,
            count=len(pieces),
        )
        root_children = np.flatnonzero(parent < 0)
        return cls(byte, child_start, child_count, root_children, level_start, token_node)

    def without(self, ids: Sequence[int]) -> TokenTrie:
        """The same trie with the given token ids left out."""
        token_node = self.token_node.copy()
        ids = [i for i in ids if 0 <= i < token_node.size]
        token_node[ids] = -1
        return replace(self, token_node=token_node)

    @cached_property
    def _node_tokens(self) -> tuple[np.ndarray, np.ndarray]:
        """CSR from node to the token ids ending there: (ptr [n_nodes + 1], ids)."""
        ids = np.flatnonzero(self.token_node >= 0)
        nodes = self.token_node[ids]
        order = np.argsort(nodes, kind="stable")
        ptr = np.zeros(self.n_nodes + 1, dtype=np.int64)
        np.cumsum(np.bincount(nodes, minlength=self.n_nodes), out=ptr[1:])
        return ptr, ids[order]

    def walk_states(
        self, trans: np.ndarray, states: np.ndarray, budget: CompileBudget = UNLIMITED
    ) -> np.ndarray:
        """State reached at every token end, from each start state: int32 [len(states), n_ids]
        (0 where the walk died or the id takes no part).

        All start states walk together, one trie level per step, over the frontier of nodes
        where at least one of them is still alive: a shared prefix is walked once, and a
        subtree every start state has left is never visited. `budget` is polled per level.
        """
        ptr, token_ids = self._node_tokens
        out = np.zeros((len(states), self.token_node.size), dtype=np.int32)
        nodes = self.root_children
        cur = trans[np.asarray(states)[:, None], self.byte[nodes][None, :]]
        while nodes.size:
            budget.check()
            alive = (cur != 0).any(axis=0)
            nodes, cur = nodes[alive], cur[:, alive]
            counts = ptr[nodes + 1] - ptr[nodes]
            ends = np.flatnonzero(counts)
            if ends.size:
                cols, picks = _expand(ends, ptr[nodes[ends]], counts[ends])
                out[:, token_ids[picks]] = cur[:, cols]
            parents, children = _expand(
                np.arange(nodes.size), self.child_start[nodes], self.child_count[nodes]
            )
            cur = trans[cur[:, parents], self.byte[children][None, :]]
            nodes = children
        return out


def _expand(
    owners: np.ndarray, starts: np.ndarray, counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """For each owner i, the ids starts[i] .. starts[i] + counts[i] - 1: (owner per id, id)."""
    total = int(counts.sum())
    first = np.cumsum(counts) - counts
    offsets = np.arange(total) - np.repeat(first, counts)
    return np.repeat(owners, counts), np.repeat(starts, counts) + offsets
