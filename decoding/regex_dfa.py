"""A practical regex subset compiled to a byte DFA (always an anchored full match).

Supported: literals; escapes of punctuation; \\n \\t \\r \\f \\v \\0 \\xhh \\uhhhh \\Uhhhhhhhh;
classes `[a-z]`, `[^...]`, `\\d \\w \\s` and their negations (ASCII meaning, like Python's
`re.ASCII`); `.` (any character but newline); groups `(...)`, `(?:...)`, `(?P<name>...)`;
alternation `|`; quantifiers `? * + {m} {m,} {,n} {m,n}` (lazy forms are accepted: they do not
change which strings match); `^` at the very start and `$` at the very end (no-ops).
Anything else (backreferences, lookaround, word boundaries, inline flags, possessive
quantifiers) raises ValueError naming the construct. The language equals that of
`re.fullmatch(pattern, text, re.ASCII)`.

Pipeline: parse -> Thompson NFA over byte ranges -> subset construction over byte classes ->
minimization.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from .automaton import DEAD, Dfa
from .limits import UNLIMITED, CompileBudget, ConstraintTooLarge
from .utf8_ranges import MAX_CODE_POINT, byte_sequences, complement, normalize

MAX_REPEAT = 1000
MAX_NFA_STATES = 50_000
MAX_DFA_STATES = 10_000

_DIGIT = [(0x30, 0x39)]
_WORD = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_SPACE = [(0x09, 0x0D), (0x20, 0x20)]
_CLASS_ESCAPES = {
    "d": _DIGIT,
    "w": _WORD,
    "s": _SPACE,
    "D": complement(_DIGIT),
    "W": complement(_WORD),
    "S": complement(_SPACE),
}
_CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a", "0": "\0"}
_UNSUPPORTED_ESCAPES = {
    "b": "word boundary \\b",
    "B": "non-boundary \\B",
    "A": "anchor \\A",
    "Z": "anchor \\Z",
    "z": "anchor \\z",
    "G": "anchor \\G",
    "N": "named character \\N{...}",
    "p": "Unicode property \\p",
    "P": "Unicode property \\P",
}


# AST: each node is one of these small tuples.
#   ("set", ranges)  ("cat", [nodes])  ("alt", [nodes])  ("rep", node, lo, hi_or_None)
Node = tuple


class _Parser:
    def __init__(self, pattern: str) -> None:
        self.p = pattern
        self.i = 0

    def error(self, message: str) -> ValueError:
        return ValueError(f"regex {self.p!r}: {message} at position {self.i}")

    def unsupported(self, what: str) -> ValueError:
        return ValueError(f"regex {self.p!r}: unsupported syntax: {what} at position {self.i}")

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    def take(self) -> str:
        if self.i >= len(self.p):
            raise self.error("unexpected end of pattern")
        c = self.p[self.i]
        self.i += 1
        return c

    def parse(self) -> Node:
        if self.peek() == "^":
            self.i += 1
        node = self.alternation()
        if self.peek() == "$" and self.i == len(self.p) - 1:
            self.i += 1
        if self.i != len(self.p):
            c = self.p[self.i]
            if c == ")":
                raise self.error("unbalanced ')'")
            if c in "^$":
                raise self.unsupported(f"anchor {c!r} not at the start/end of the pattern")
            raise self.error(f"unexpected {c!r}")
        return node

    def alternation(self) -> Node:
        branches = [self.concatenation()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.concatenation())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def concatenation(self) -> Node:
        items: list[Node] = []
        while True:
            c = self.peek()
            if c is None or c in "|)":
                break
            if c == "$" and self.i == len(self.p) - 1:
                break
            items.append(self.repetition())
        return items[0] if len(items) == 1 else ("cat", items)

    def repetition(self) -> Node:
        node = self.atom()
        quantified = False
        while True:
            c = self.peek()
            if c in ("*", "+", "?"):
                self.i += 1
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            elif c == "{" and (bounds := self.braces()) is not None:
                lo, hi = bounds
            else:
                return node
            if quantified:
                raise self.unsupported("multiple repeat (a quantifier applied to a quantifier)")
            quantified = True
            if self.peek() == "?":
                self.i += 1  # lazy: same language under a full match
            elif self.peek() == "+":
                raise self.unsupported("possessive quantifier")
            node = ("rep", node, lo, hi)

    def braces(self) -> tuple[int, int | None] | None:
        """Parse `{m}`, `{m,}`, `{,n}`, `{m,n}` at self.i; None (nothing consumed) if not one."""
        end = self.p.find("}", self.i)
        if end < 0:
            return None
        body = self.p[self.i + 1 : end]
        lo_s, comma, hi_s = body.partition(",")
        if not (lo_s.isdigit() or (comma and lo_s == "")) or not (hi_s == "" or hi_s.isdigit()):
            return None
        if not body.isascii():
            return None
        lo = int(lo_s) if lo_s else 0
        hi = (int(hi_s) if hi_s else None) if comma else lo
        if hi is not None and hi < lo:
            raise self.error("bad repetition bounds (min > max)")
        if lo > MAX_REPEAT or (hi is not None and hi > MAX_REPEAT):
            raise self.unsupported(f"repetition count above {MAX_REPEAT}")
        self.i = end + 1
        return lo, hi

    def atom(self) -> Node:
        c = self.take()
        if c == "(":
            return self.group()
        if c == "[":
            return ("set", self.char_class())
        if c == ".":
            return ("set", complement([(0x0A, 0x0A)]))
        if c == "\\":
            return ("set", self.escape(in_class=False))
        if c in "*+?":
            raise self.error("nothing to repeat")
        if c == "{":
            # A '{' that does not start a quantifier is a literal, as in Python.
            self.i -= 1
            if self.braces() is not None:
                raise self.error("nothing to repeat")
            self.i += 1
        if c in "^$":
            self.i -= 1
            raise self.unsupported(f"anchor {c!r} not at the start/end of the pattern")
        if c == ")":
            self.i -= 1
            raise self.error("unbalanced ')'")
        return ("set", [(ord(c), ord(c))])

    def group(self) -> Node:
        if self.peek() == "?":
            rest = self.p[self.i :]
            if rest.startswith("?:"):
                self.i += 2
            elif rest.startswith("?P<"):
                end = self.p.find(">", self.i)
                if end < 0 or not self.p[self.i + 3 : end].isidentifier():
                    raise self.error("bad group name")
                self.i = end + 1
            else:
                what = {
                    "?=": "lookahead",
                    "?!": "negative lookahead",
                    "?<=": "lookbehind",
                    "?<!": "negative lookbehind",
                    "?P=": "named backreference",
                    "?#": "comment group",
                    "?>": "atomic group",
                    "?(": "conditional group",
                }
                for prefix, name in what.items():
                    if rest.startswith(prefix):
                        raise self.unsupported(name)
                raise self.unsupported("inline flags or other '(?...)' group")
        node = self.alternation()
        if self.peek() != ")":
            raise self.error("missing ')'")
        self.i += 1
        return node

    def char_class(self) -> list[tuple[int, int]]:
        negate = self.peek() == "^"
        if negate:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            c = self.peek()
            if c is None:
                raise self.error("unterminated character class")
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            lo_set = self.class_item()
            if len(lo_set) == 1 and lo_set[0][0] == lo_set[0][1] and self.is_range_dash():
                self.i += 1  # the '-'
                hi_set = self.class_item()
                if len(hi_set) != 1 or hi_set[0][0] != hi_set[0][1]:
                    raise self.error("bad character range")
                lo, hi = lo_set[0][0], hi_set[0][0]
                if hi < lo:
                    raise self.error("bad character range (reversed)")
                ranges.append((lo, hi))
            else:
                if self.is_range_dash():
                    raise self.error("bad character range (a class escape cannot be an endpoint)")
                ranges.extend(lo_set)
        return complement(ranges) if negate else normalize(ranges)

    def is_range_dash(self) -> bool:
        return self.peek() == "-" and self.i + 1 < len(self.p) and self.p[self.i + 1] != "]"

    def class_item(self) -> list[tuple[int, int]]:
        c = self.take()
        if c == "\\":
            return self.escape(in_class=True)
        if c == "[" and self.peek() in (":", "=", "."):
            raise self.unsupported("POSIX class or nested set")
        return [(ord(c), ord(c))]

    def escape(self, in_class: bool) -> list[tuple[int, int]]:
        c = self.take()
        if c in _CLASS_ESCAPES:
            return list(_CLASS_ESCAPES[c])
        if c in _CHAR_ESCAPES:
            if c == "0":
                # Python reads up to two more octal digits after \0.
                digits = ""
                while len(digits) < 2 and (self.peek() or "x") in "01234567":
                    digits += self.take()
                cp = int("0" + digits, 8)
                return [(cp, cp)]
            cp = ord(_CHAR_ESCAPES[c])
            return [(cp, cp)]
        if c == "b" and in_class:
            return [(0x08, 0x08)]
        if c in "xuU":
            width = {"x": 2, "u": 4, "U": 8}[c]
            digits = self.p[self.i : self.i + width]
            if len(digits) != width or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.error(f"bad \\{c} escape")
            self.i += width
            cp = int(digits, 16)
            if cp > MAX_CODE_POINT:
                raise self.error(f"bad \\{c} escape (beyond U+10FFFF)")
            return [(cp, cp)]
        if c.isdigit():
            raise self.unsupported("backreference or octal escape")
        if c in _UNSUPPORTED_ESCAPES:
            self.i -= 2
            raise self.unsupported(_UNSUPPORTED_ESCAPES[c])
        if c.isascii() and c.isalnum():
            self.i -= 2
            raise self.error(f"bad escape \\{c}")
        return [(ord(c), ord(c))]


@dataclass
class _Nfa:
    eps: list[list[int]] = field(default_factory=list)
    edges: list[list[tuple[int, int, int]]] = field(default_factory=list)  # (lo, hi, target)

    def new(self) -> int:
        if len(self.eps) >= MAX_NFA_STATES:
            raise ConstraintTooLarge(f"regex too large (more than {MAX_NFA_STATES} NFA states)")
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def build(self, node: Node) -> tuple[int, int]:
        """Thompson fragment for `node`: (entry, exit)."""
        kind = node[0]
        if kind == "set":
            entry, exit_ = self.new(), self.new()
            for seq in byte_sequences(node[1]):
                state = entry
                for k, (lo, hi) in enumerate(seq):
                    nxt = exit_ if k == len(seq) - 1 else self.new()
                    self.edges[state].append((lo, hi, nxt))
                    state = nxt
            return entry, exit_
        if kind == "cat":
            entry = exit_ = self.new()
            for child in node[1]:
                a, b = self.build(child)
                self.eps[exit_].append(a)
                exit_ = b
            return entry, exit_
        if kind == "alt":
            entry, exit_ = self.new(), self.new()
            for child in node[1]:
                a, b = self.build(child)
                self.eps[entry].append(a)
                self.eps[b].append(exit_)
            return entry, exit_
        if kind == "rep":
            _, child, lo, hi = node
            entry = exit_ = self.new()
            for _ in range(lo):
                a, b = self.build(child)
                self.eps[exit_].append(a)
                exit_ = b
            if hi is None:
                a, b = self.build(child)
                loop_exit = self.new()
                self.eps[exit_] += [a, loop_exit]
                self.eps[b] += [a, loop_exit]
                return entry, loop_exit
            end = self.new()
            for _ in range(hi - lo):
                a, b = self.build(child)
                self.eps[exit_] += [a, end]
                exit_ = b
            self.eps[exit_].append(end)
            return entry, end
        raise AssertionError(f"unknown node {kind}")


def parse_regex(pattern: str) -> Node:
    """The syntax tree of `pattern` (ValueError naming the construct if unsupported)."""
    return _Parser(pattern).parse()


def shortest_match_bytes(tree: Node) -> int | None:
    """Length in UTF-8 bytes of the shortest string the tree matches (None: matches nothing)."""
    kind = tree[0]
    if kind == "set":
        return len(chr(tree[1][0][0]).encode("utf-8", "surrogatepass")) if tree[1] else None
    if kind in ("cat", "alt"):
        parts = [shortest_match_bytes(child) for child in tree[1]]
        if kind == "alt":
            found = [p for p in parts if p is not None]
            return min(found) if found else None
        return None if None in parts else sum(p for p in parts if p is not None)
    _, child, lo, _ = tree
    inner = shortest_match_bytes(child)
    if lo == 0:
        return 0
    return None if inner is None else lo * inner


def regex_dfa(
    pattern: str | Node,
    max_states: int = MAX_DFA_STATES,
    budget: CompileBudget = UNLIMITED,
) -> Dfa:
    """Compile `pattern` (see module docstring for the subset; or a tree from `parse_regex`)
    to a minimal byte DFA. ConstraintTooLarge beyond `max_states` DFA states; CompileTimeout
    when `budget` runs out."""
    tree = parse_regex(pattern) if isinstance(pattern, str) else pattern
    nfa = _Nfa()
    entry, final = nfa.build(tree)
    return _determinize(nfa, entry, final, max_states, budget).minimized(budget)


def _determinize(nfa: _Nfa, entry: int, final: int, max_states: int, budget: CompileBudget) -> Dfa:
    # Byte classes: bytes no edge range tells apart share one column during subset construction.
    cuts = {0, 256}
    for edges in nfa.edges:
        for lo, hi, _ in edges:
            cuts.add(lo)
            cuts.add(hi + 1)
    bounds = sorted(cuts)
    class_of = np.zeros(256, dtype=np.int64)
    for k, (a, b) in enumerate(itertools.pairwise(bounds)):
        class_of[a:b] = k
    n_classes = len(bounds) - 1

    def closure(states: set[int]) -> frozenset[int]:
        stack = list(states)
        seen = set(states)
        while stack:
            s = stack.pop()
            for t in nfa.eps[s]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        return frozenset(seen)

    start_set = closure({entry})
    index: dict[frozenset[int], int] = {frozenset(): DEAD, start_set: 1}
    order = [frozenset(), start_set]
    table: list[list[int]] = [[DEAD] * n_classes]
    pos = 1
    while pos < len(order):
        budget.check()
        current = order[pos]
        pos += 1
        moves: list[set[int]] = [set() for _ in range(n_classes)]
        for s in current:
            for lo, hi, t in nfa.edges[s]:
                for k in range(class_of[lo], class_of[hi] + 1):
                    moves[k].add(t)
        row = []
        for move in moves:
            if not move:
                row.append(DEAD)
                continue
            target_set = closure(move)
            target = index.get(target_set)
            if target is None:
                if len(order) > max_states:
                    raise ConstraintTooLarge(
                        f"regex too large (more than {max_states} automaton states, "
                        "max_constraint_states)"
                    )
                target = len(order)
                index[target_set] = target
                order.append(target_set)
            row.append(target)
        table.append(row)
    cls_trans = np.array(table, dtype=np.int32)
    trans = np.ascontiguousarray(cls_trans[:, class_of]).astype(np.int32)
    accepting = np.array([final in s for s in order], dtype=bool)
    return Dfa(trans, accepting, 1)
