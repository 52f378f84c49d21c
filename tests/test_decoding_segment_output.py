"""Segment output: path -> normalized coordinates, polygons, rasterized mask, COCO RLE."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decoding.automaton import Dfa
from decoding.segment_output import (
    build_segment,
    filled,
    rasterize,
    rle_decode,
    rle_encode,
    rle_from_string,
    rle_to_string,
)
from decoding.svg_path import PathLanguage, parse_path


def test_rle_known_values() -> None:
    assert rle_encode(np.array([[0, 1], [1, 1]], dtype=bool)) == [1, 3]
    assert rle_encode(np.array([[1, 0], [0, 0]], dtype=bool)) == [0, 1, 3]
    assert rle_encode(np.zeros((2, 3), dtype=bool)) == [6]
    assert rle_to_string([3, 5, 2, 1]) == "352L"
    assert rle_from_string("352L") == [3, 5, 2, 1]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 12), st.integers(1, 12), st.data())
def test_rle_round_trip(h: int, w: int, data: st.DataObject) -> None:
    bits = data.draw(st.lists(st.booleans(), min_size=h * w, max_size=h * w))
    mask = np.array(bits, dtype=bool).reshape(h, w)
    counts = rle_encode(mask)
    assert sum(counts) == h * w
    assert all(c > 0 for c in counts[1:])
    assert np.array_equal(rle_decode(counts, (h, w)), mask)
    assert rle_from_string(rle_to_string(counts)) == counts


def _runs_column_major(mask: np.ndarray) -> list[int]:
    """COCO's counts by their definition: the mask read column by column, run lengths, zeros
    first."""
    flat = mask.ravel(order="F")
    counts, value, run = [], False, 0
    for bit in flat:
        if bit == value:
            run += 1
        else:
            counts.append(run)
            value, run = bool(bit), 1
    counts.append(run)
    return counts


@pytest.mark.parametrize("seed", range(6))
def test_rle_counts_are_the_column_major_runs(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(60):
        h, w = (int(v) for v in rng.integers(1, 40, 2))
        mask = rng.random((h, w)) < rng.random()
        if rng.random() < 0.3:  # long runs: blocks crossing column ends
            mask = np.repeat(np.repeat(mask[: max(1, h // 8), : max(1, w // 8)], 8, 0), 8, 1)
        assert rle_encode(mask) == _runs_column_major(mask)
    assert rle_encode(np.ones((3, 1), bool)[:, ::-1]) == [0, 3]  # a strided view
    assert rle_encode(np.zeros((0, 4), bool)) == []
    with pytest.raises(ValueError, match="2-D"):
        rle_encode(np.zeros(4, bool))


@pytest.mark.parametrize("seed", range(4))
def test_rasterize_fills_the_pixels_pillows_one_bit_fill_does(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(20):
        width, height = (int(v) for v in rng.integers(5, 300, 2))
        shapes = [
            [tuple(p) for p in rng.uniform(-0.2, 1.2, (int(n), 2))]
            for n in rng.integers(1, 9, int(rng.integers(1, 4)))
        ]
        want = filled(shapes, width, height, "1")
        got = rasterize(shapes, width, height)
        assert got.dtype == bool and np.array_equal(got, np.array(want, dtype=bool))


def test_rasterize_square() -> None:
    mask = rasterize([[(0.25, 0.25), (0.75, 0.25), (0.75, 0.75), (0.25, 0.75)]], 8, 8)
    assert mask.shape == (8, 8)
    assert mask[4, 4] and not mask[0, 0] and not mask[7, 7]
    assert 16 <= mask.sum() <= 25
    assert rasterize([[(0.5, 0.5)]], 4, 4).sum() == 1
    assert rasterize([], 3, 2).shape == (2, 3)


def test_build_segment_maps_grid_into_box() -> None:
    result = build_segment((0.5, 0.5), (0.5, 0.5), "M 0 0 L 100 0 L 100 100 L 0 100 Z", (20, 10))
    assert result.box == (0.25, 0.25, 0.75, 0.75)
    assert result.polygons == [[(0.25, 0.25), (0.75, 0.25), (0.75, 0.75), (0.25, 0.75)]]
    assert result.path.startswith("M 0.25000 0.25000 L 0.75000 0.25000")
    assert result.path.endswith("Z")
    assert result.mask_size == (10, 20)
    mask = rle_decode(result.mask_counts, result.mask_size)
    assert mask[5, 10] and not mask[0, 0]
    assert result.rle()["size"] == [10, 20]
    assert rle_from_string(result.rle()["counts"]) == result.mask_counts


def test_curves_are_flattened_inside_their_hull() -> None:
    result = build_segment(
        (0.5, 0.5),
        (1.0, 1.0),
        "M 0 0 Q 100 0 100 100 C 50 100 0 50 0 0 Z",
        (16, 16),
        curve_segments=6,
    )
    polygon = result.polygons[0]
    assert len(polygon) == 1 + 6 + 6
    assert polygon[6] == pytest.approx((1.0, 1.0))
    assert polygon[-1] == pytest.approx((0.0, 0.0))
    assert all(0 <= x <= 1 and 0 <= y <= 1 for x, y in polygon)


@functools.cache
def _language() -> PathLanguage:
    return PathLanguage(100, 20)


@functools.cache
def _live() -> np.ndarray:
    return _language().dfa.live_states()


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 15),
    st.tuples(st.integers(0, 1023), st.integers(0, 1023)),
    st.tuples(st.integers(0, 1023), st.integers(0, 1023)),
    st.tuples(st.integers(1, 64), st.integers(1, 64)),
    st.data(),
)
def test_every_path_of_the_grammar_builds(
    max_points: int,
    center_bins: tuple[int, int],
    size_bins: tuple[int, int],
    image: tuple[int, int],
    data: st.DataObject,
) -> None:
    lang = _language()
    dfa, live = lang.dfa, _live()
    state, text = lang.start(max_points), bytearray()
    # A random walk through the automaton, closed along the cheapest way once long enough.
    for _ in range(200):
        if dfa.accepting[state] and (len(text) > 60 or data.draw(st.booleans())):
            break
        options = [b for b in b" 0123456789MLQCZ" if live[dfa.trans[state, b]]]
        if not options:
            break
        if len(text) > 60:
            options = [b for b in options if b in b" Z0"] or options
        b = data.draw(st.sampled_from(options))
        text.append(b)
        state = int(dfa.trans[state, b])
    assert dfa.accepting[state], bytes(text)
    center = (center_bins[0] / 1024, center_bins[1] / 1024)
    size = tuple(2.0 ** (b / 1023 * 10 - 10) for b in size_bins)
    result = build_segment(center, size, text.decode(), image)
    assert sum(result.mask_counts) == image[0] * image[1]
    points = sum(len(c.points) for sub in parse_path(text.decode()) for c in sub)
    assert points <= max_points
    assert len(result.polygons) == text.count(b"M")


def test_no_dfa_needed_for_unrelated_parse_errors() -> None:
    with pytest.raises(ValueError):
        build_segment((0.5, 0.5), (0.1, 0.1), "M 0 0 L", (4, 4))
    assert isinstance(_language().dfa, Dfa)
