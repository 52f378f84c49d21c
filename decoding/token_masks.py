"""Compile a byte DFA into token masks over a vocabulary, with a budget-aware twist.

A token is allowed in DFA state s if walking its bytes from s stays alive; eos is allowed only
in accepting states. That alone can strand a request whose token budget runs out mid-answer, so
each state also knows `dist[s]`, the fewest tokens that reach an accepting state. With r tokens
still allowed (eos not counted), token t is allowed only if dist[target] <= r - 1. The allowed
set thus depends on the "level" L = r - 1, but only while L is below the largest dist any
allowed token leads to; above that the full row applies. Rows are precomputed for every
(state, level) pair that differs and deduplicated, so any bounded budget finishes validly with
an accepted string, for any weights.

Row lookup for a state and remaining budget r (see `CompiledMasks.row`): level L clamped to
[dist[s] - 1, max level of s]; L = -1 in an accepting state means "only eos" (EOS_ONLY), which
the grammar takes as "finish now" without spending a step.

Compiled results are cached in memory and on disk (packed bits), keyed by the vocabulary
digest, the automaton signature, eos id, blocked ids and mask width.
"""

from __future__ import annotations

import hashlib
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .automaton import DEAD, Dfa
from .limits import UNLIMITED, CompileBudget, ConstraintTooLarge
from .token_trie import TokenTrie
from .vocab import TokenVocab

EOS_ONLY = -1
UNREACHABLE = 1 << 30
FORMAT_VERSION = 1
MAX_ROWS = 2048
_CHUNK_ELEMENTS = 1 << 22  # states x widest trie level walked at once


@dataclass(frozen=True, eq=False)
class CompiledMasks:
    """Token masks of one automaton over one vocabulary.

    `rows` holds distinct packed rows (numpy packbits, little bit order, `width` bits each).
    State s has levels `level_base[s] .. level_base[s] + n_s - 1` whose local row ids are
    `level_rows[level_ptr[s] : level_ptr[s + 1]]` (EOS_ONLY for "only eos").
    """

    key: str
    dfa: Dfa
    eos_id: int
    width: int
    rows: np.ndarray  # uint8 [n_rows, ceil(width / 8)]
    dist: np.ndarray  # int32 [n_states]; UNREACHABLE where no accepting state can be reached
    level_base: np.ndarray  # int32 [n_states]
    level_ptr: np.ndarray  # int32 [n_states + 1]
    level_rows: np.ndarray  # int32

    def row(self, state: int, remaining: int) -> int:
        """Local row id for `state` with `remaining` tokens left (EOS_ONLY: finish now)."""
        if remaining < self.dist[state]:
            raise ValueError(f"state {state} needs {self.dist[state]} tokens, {remaining} left")
        lo, hi = self.level_ptr[state], self.level_ptr[state + 1]
        level = min(remaining - 1, self.level_base[state] + (hi - lo) - 1)
        return int(self.level_rows[lo + level - self.level_base[state]])

    def allowed(self, local_row: int) -> np.ndarray:
        """Bool [width] of one local row."""
        return np.unpackbits(self.rows[local_row], count=self.width, bitorder="little").astype(bool)


def cache_dir_default() -> Path:
    """Default on-disk cache: $XDG_CACHE_HOME/moondream-serve/masks (or ~/.cache/...)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moondream-serve" / "masks"


class MaskCache:
    """Compiled masks in memory (LRU) and optionally on disk; safe to share between threads."""

    def __init__(
        self,
        directory: Path | str | None = None,
        use_disk: bool = True,
        memory_entries: int = 64,
    ) -> None:
        """`directory` None means `cache_dir_default()`; `use_disk=False` keeps memory only."""
        if not use_disk:
            self.directory: Path | None = None
        else:
            self.directory = Path(directory) if directory is not None else cache_dir_default()
        self.memory_entries = memory_entries
        self._memory: OrderedDict[str, CompiledMasks] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str, dfa: Dfa) -> CompiledMasks | None:
        with self._lock:
            hit = self._memory.get(key)
            if hit is not None:
                self._memory.move_to_end(key)
                return hit
        if self.directory is None:
            return None
        path = self.directory / f"{key}.npz"
        try:
            with np.load(path) as f:
                compiled = CompiledMasks(
                    key,
                    dfa,
                    int(f["eos_id"]),
                    int(f["width"]),
                    f["rows"],
                    f["dist"],
                    f["level_base"],
                    f["level_ptr"],
                    f["level_rows"],
                )
        except (OSError, KeyError, ValueError):
            return None  # missing or damaged: recompile
        self._remember(compiled)
        return compiled

    def put(self, compiled: CompiledMasks) -> None:
        self._remember(compiled)
        if self.directory is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.directory / f"{compiled.key}.npz"
        tmp = final.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp.npz")
        np.savez(
            tmp,
            eos_id=compiled.eos_id,
            width=compiled.width,
            rows=compiled.rows,
            dist=compiled.dist,
            level_base=compiled.level_base,
            level_ptr=compiled.level_ptr,
            level_rows=compiled.level_rows,
        )
        os.replace(tmp, final)  # atomic: readers never see half a file

    def _remember(self, compiled: CompiledMasks) -> None:
        with self._lock:
            self._memory[compiled.key] = compiled
            self._memory.move_to_end(compiled.key)
            while len(self._memory) > self.memory_entries:
                self._memory.popitem(last=False)


_TRIES: weakref.WeakKeyDictionary[TokenVocab, TokenTrie] = weakref.WeakKeyDictionary()
_TRIES_LOCK = threading.Lock()


def vocab_trie(vocab: TokenVocab) -> TokenTrie:
    """The byte trie of a vocabulary's text pieces, built once per vocabulary object."""
    with _TRIES_LOCK:
        trie = _TRIES.get(vocab)
        if trie is None:
            trie = TokenTrie.build(vocab.text_pieces())
            _TRIES[vocab] = trie
        return trie


def masks_key(dfa: Dfa, vocab: TokenVocab, eos_id: int, width: int, blocked: Iterable[int]) -> str:
    """Cache key of a compilation."""
    blocked_s = ",".join(str(i) for i in sorted(set(blocked)))
    text = f"{FORMAT_VERSION}|{vocab.digest}|{dfa.signature()}|{eos_id}|{width}|{blocked_s}"
    return hashlib.sha256(text.encode()).hexdigest()


def compile_masks(
    dfa: Dfa,
    vocab: TokenVocab,
    eos_id: int,
    width: int,
    blocked: Iterable[int] = (),
    cache: MaskCache | None = None,
    max_rows: int = MAX_ROWS,
    budget: CompileBudget = UNLIMITED,
) -> CompiledMasks:
    """Masks of `dfa` over `vocab` for a logits row of `width` ids (the model's vocab size).

    `blocked` ids are never allowed (e.g. task-suppressed ids); special ids never are either,
    except `eos_id` in accepting states. Raises ValueError when no token sequence can reach an
    accepting state from the start, ConstraintTooLarge when the masks would need more than
    `max_rows` rows, CompileTimeout when `budget` runs out.
    """
    if not 0 <= eos_id < width:
        raise ValueError(f"eos id {eos_id} outside the mask width {width}")
    blocked = frozenset(blocked)
    dfa = dfa.trimmed()
    key = masks_key(dfa, vocab, eos_id, width, blocked)
    if cache is not None and (hit := cache.get(key, dfa)) is not None:
        return hit
    # eos is never text, even in a vocabulary that does not mark it special.
    excluded = [i for i in blocked | {eos_id} if i < vocab.size] + list(range(width, vocab.size))
    trie = vocab_trie(vocab).without(excluded)
    compiled = _compile(key, dfa, trie, eos_id, width, max_rows, budget)
    if cache is not None:
        cache.put(compiled)
    return compiled


def _compile(
    key: str,
    dfa: Dfa,
    trie: TokenTrie,
    eos_id: int,
    width: int,
    max_rows: int,
    budget: CompileBudget,
) -> CompiledMasks:
    n_states = dfa.n_states
    live = np.flatnonzero(dfa.live_states())
    # Per live state: allowed token ids and the state each leads to.
    tokens_of: dict[int, np.ndarray] = {}
    targets_of: dict[int, np.ndarray] = {}
    widest = int(np.diff(trie.level_start).max(initial=1))
    chunk_size = max(1, _CHUNK_ELEMENTS // widest)
    for lo in range(0, live.size, chunk_size):
        budget.check()
        chunk = live[lo : lo + chunk_size]
        ends = trie.walk_states(dfa.trans, chunk, budget)
        for row, state in enumerate(chunk.tolist()):
            ids = np.flatnonzero(ends[row])
            tokens_of[state] = ids
            targets_of[state] = ends[row, ids]
    dist = _distances(n_states, dfa.accepting, targets_of)
    start_dist = dist[dfa.start]
    if start_dist >= UNREACHABLE:
        raise ValueError("the constraint cannot be satisfied with this vocabulary")

    n_bytes = (width + 7) // 8
    row_ids: dict[bytes, int] = {}
    packed_rows: list[np.ndarray] = []
    level_base = np.zeros(n_states, dtype=np.int32)
    level_ptr = np.zeros(n_states + 1, dtype=np.int32)
    level_rows: list[int] = []
    allowed = np.zeros(width, dtype=bool)
    for state in range(n_states):
        if state % 64 == 0:
            budget.check()
        level_ptr[state] = len(level_rows)
        if state == DEAD or dist[state] >= UNREACHABLE:
            continue
        ids, tdist = tokens_of[state], dist[targets_of[state]]
        finite = tdist < UNREACHABLE
        ids, tdist = ids[finite], tdist[finite]
        accepting = bool(dfa.accepting[state])
        base = int(dist[state]) - 1
        top = int(tdist.max()) if tdist.size else -1
        level_base[state] = base
        for level in range(base, max(top, base) + 1):
            if level < 0 and accepting:
                level_rows.append(EOS_ONLY)
                continue
            allowed[:] = False
            allowed[ids[tdist <= level]] = True
            allowed[eos_id] = accepting
            packed = np.packbits(allowed, bitorder="little")
            blob = packed.tobytes()
            local = row_ids.get(blob)
            if local is None:
                if len(packed_rows) >= max_rows:
                    raise ConstraintTooLarge(
                        f"constraint too complex (more than {max_rows} mask rows, max_mask_rows)"
                    )
                local = len(packed_rows)
                row_ids[blob] = local
                packed_rows.append(packed)
            level_rows.append(local)
    level_ptr[n_states] = len(level_rows)
    rows = np.stack(packed_rows) if packed_rows else np.zeros((0, n_bytes), dtype=np.uint8)
    return CompiledMasks(
        key,
        dfa,
        eos_id,
        width,
        rows,
        dist.astype(np.int32),
        level_base,
        level_ptr,
        np.array(level_rows, dtype=np.int32),
    )


def _distances(
    n_states: int, accepting: np.ndarray, targets_of: dict[int, np.ndarray]
) -> np.ndarray:
    """Fewest tokens from each state to an accepting one (UNREACHABLE if none): a breadth-first
    search backwards from the accepting states, one token per edge."""
    src_parts, dst_parts = [], []
    for state, targets in targets_of.items():
        uniq = np.unique(targets)
        src_parts.append(np.full(uniq.size, state, dtype=np.int64))
        dst_parts.append(uniq.astype(np.int64))
    src = np.concatenate(src_parts) if src_parts else np.zeros(0, dtype=np.int64)
    dst = np.concatenate(dst_parts) if dst_parts else np.zeros(0, dtype=np.int64)
    keep = dst != DEAD
    src, dst = src[keep], dst[keep]
    order = np.argsort(dst, kind="stable")
    preds = src[order].tolist()
    bounds = np.searchsorted(dst[order], np.arange(n_states + 1)).tolist()
    dist = [UNREACHABLE] * n_states
    frontier = [s for s in np.flatnonzero(accepting).tolist() if s != DEAD]
    for s in frontier:
        dist[s] = 0
    level = 0
    while frontier:
        level += 1
        nxt = []
        for s in frontier:
            for p in preds[bounds[s] : bounds[s + 1]]:
                if dist[p] == UNREACHABLE:
                    dist[p] = level
                    nxt.append(p)
        frontier = nxt
    return np.array(dist, dtype=np.int64)
