"""Code point ranges -> UTF-8 byte-range sequences, so character classes run on a byte DFA."""

from __future__ import annotations

MAX_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)

# Code points encoded with 1, 2, 3 and 4 bytes; within one segment byte order = code point order.
_SEGMENTS = ((0x0, 0x7F), (0x80, 0x7FF), (0x800, 0xFFFF), (0x10000, MAX_CODE_POINT))

ByteRange = tuple[int, int]


def normalize(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, merged, clipped to encodable code points (surrogates removed)."""
    pieces: list[tuple[int, int]] = []
    for lo, hi in ranges:
        lo, hi = max(lo, 0), min(hi, MAX_CODE_POINT)
        if lo > hi:
            continue
        # Surrogates never occur in decoded text, and UTF-8 cannot encode them.
        if lo < SURROGATES[0]:
            pieces.append((lo, min(hi, SURROGATES[0] - 1)))
        if hi > SURROGATES[1]:
            pieces.append((max(lo, SURROGATES[1] + 1), hi))
    pieces.sort()
    merged: list[tuple[int, int]] = []
    for lo, hi in pieces:
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def complement(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """All encodable code points not in `ranges`."""
    out: list[tuple[int, int]] = []
    nxt = 0
    for lo, hi in normalize(ranges):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CODE_POINT:
        out.append((nxt, MAX_CODE_POINT))
    return normalize(out)


def byte_sequences(ranges: list[tuple[int, int]]) -> list[list[ByteRange]]:
    """Byte-range sequences whose concatenations are exactly the UTF-8 encodings of `ranges`."""
    out: list[list[ByteRange]] = []
    for lo, hi in normalize(ranges):
        for seg_lo, seg_hi in _SEGMENTS:
            a, b = max(lo, seg_lo), min(hi, seg_hi)
            if a <= b:
                out.extend(_split(list(chr(a).encode()), list(chr(b).encode())))
    return out


def _split(lo: list[int], hi: list[int]) -> list[list[ByteRange]]:
    """Sequences covering the same-length encodings from `lo` to `hi` (byte-wise lexicographic)."""
    n = len(lo)
    if n == 1:
        return [[(lo[0], hi[0])]]
    if lo[0] == hi[0]:
        return [[(lo[0], lo[0]), *rest] for rest in _split(lo[1:], hi[1:])]
    smallest, largest = [0x80] * (n - 1), [0xBF] * (n - 1)
    out: list[list[ByteRange]] = []
    first, last = lo[0], hi[0]
    if lo[1:] != smallest:
        out.extend([(lo[0], lo[0]), *rest] for rest in _split(lo[1:], largest))
        first += 1
    tail: list[list[ByteRange]] = []
    if hi[1:] != largest:
        tail = [[(hi[0], hi[0]), *rest] for rest in _split(smallest, hi[1:])]
        last -= 1
    if first <= last:
        out.append([(first, last)] + [(0x80, 0xBF)] * (n - 1))
    return out + tail
