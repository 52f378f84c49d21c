"""Moondream 3's segment geometry: the clamped box, SVG's rules when flattening (relative
commands, H/V, smooth curves, arcs, subpaths), the image-space path and the mask."""

from __future__ import annotations

import math

import pytest

from decoding.segment_output import rle_decode
from decoding.svg_geometry import build_box_segment, clamped_box, flatten, image_path
from decoding.svg_tokens import GRID, PathGroup, parse_items


def _groups(text: str) -> list[PathGroup]:
    return parse_items(text.split(" "))


def _close(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        p == pytest.approx(q, abs=1e-9) for p, q in zip(a, b, strict=True)
    )


def test_the_box_is_clamped_to_the_picture() -> None:
    assert clamped_box((0.5, 0.5), (0.5, 0.25)) == (0.25, 0.375, 0.75, 0.625)
    assert clamped_box((0.9, 0.05), (0.4, 0.2)) == pytest.approx((0.7, 0.0, 1.0, 0.15))
    assert clamped_box((1.2, -0.1), (2.0, 0.0)) == (0.5, 0.0, 1.0, 0.0)  # each clamped first


def test_lines_relative_and_absolute_agree() -> None:
    square = [(0.0, 0.0), (1.0, 0.0), (1.0, 1.0), (0.0, 1.0)]
    for text in (
        "M 0 0 L 960 0 L 960 960 L 0 960 Z",
        "m 0 0 l 960 0 l 0 960 l - 960 0 z",
        "M 0 0 H 960 V 960 H 0 Z",
        "M 0 0 h 960 v 960 h - 960 Z",
        "M 0 0 960 0 960 960 0 960 Z",  # a moveto's further pairs are lines
    ):
        assert _close(flatten(_groups(text))[0], square), text


def test_smooth_curves_reflect_the_previous_control_point() -> None:
    explicit = flatten(_groups("M 0 0 C 0 480 480 480 480 0 C 480 - 480 960 - 480 960 0"), 4)
    smooth = flatten(_groups("M 0 0 C 0 480 480 480 480 0 S 960 - 480 960 0"), 4)
    assert _close(smooth[0], explicit[0])
    quad = flatten(_groups("M 0 0 Q 480 960 960 0 T 1920 0"), 2)[0]
    # The reflected control point (1440, -960) pulls the second half's middle up.
    assert quad[2] == pytest.approx((1.0, 0.0)) and quad[3][1] == pytest.approx(-0.5)
    # Without a previous curve S and T take the current point as their first control.
    assert _close(flatten(_groups("M 0 0 T 960 0"), 2)[0], [(0.0, 0.0), (0.25, 0.0), (1.0, 0.0)])


def test_arcs_follow_their_ellipse() -> None:
    # A half circle of radius 480 from the left to the right edge through the top (sweep 1).
    points = flatten(_groups("M 0 480 A 480 480 0 0 1 960 480"), 8)[0]
    assert points[-1] == (1.0, 0.5)
    for x, y in points:
        assert math.hypot(x - 0.5, y - 0.5) == pytest.approx(0.5)
        assert y <= 0.5 + 1e-9
    below = flatten(_groups("M 0 480 A 480 480 0 0 0 960 480"), 8)[0]
    assert all(y >= 0.5 - 1e-9 for _, y in below)
    # Radii too small grow until the arc fits; zero radii draw a line.
    grown = flatten(_groups("M 0 480 A 96 96 0 0 1 960 480"), 8)[0]
    assert all(math.hypot(x - 0.5, y - 0.5) == pytest.approx(0.5) for x, y in grown)
    assert flatten(_groups("M 0 0 A 0 96 0 0 1 960 960"))[0] == [(0.0, 0.0), (1.0, 1.0)]


def test_each_subpath_is_a_polygon() -> None:
    polygons = flatten(_groups("M 0 0 L 960 0 L 0 960 Z L 480 480 M 96 96 L 192 96 Z"))
    assert [len(p) for p in polygons] == [3, 2, 2]
    assert polygons[1] == [(0.0, 0.0), (0.5, 0.5)]  # on after Z: from the subpath's start


def test_the_image_path_maps_every_command_into_the_box() -> None:
    box = (0.2, 0.4, 0.6, 0.6)  # 0.4 wide, 0.2 high
    groups = _groups("M 0 960 l 480 - 480 H 960 v 96 A 480 240 0 1 0 0 0 Z")
    assert image_path(groups, box) == (
        "M 0.20000 0.60000 l 0.20000 -0.10000 H 0.60000 v 0.02000 "
        "A 0.20000 0.05000 0.00000 1 0 0.20000 0.40000 Z"
    )
    # A rotated arc's ellipse is scaled by the box: a quarter turn swaps which radius widens.
    turned = image_path(_groups("M 0 0 A 480 240 90 0 1 960 960"), box).split()
    assert [float(v) for v in turned[4:6]] == pytest.approx([0.1, 0.1])


def test_a_segment_result_of_a_box_and_path() -> None:
    groups = _groups(f"M 0 0 L {GRID} 0 L {GRID} {GRID} L 0 {GRID} Z")
    seg = build_box_segment((0.5, 0.5), (0.5, 0.5), groups, (20, 10))
    assert seg.box == (0.25, 0.25, 0.75, 0.75) and seg.points == ((0.5, 0.5),)
    assert seg.box_path == "M 0 0 L 1 0 L 1 1 L 0 1 Z"
    assert "".join(seg.chunks) == seg.box_path and len(seg.chunks) == 5
    assert seg.polygons == [[(0.25, 0.25), (0.75, 0.25), (0.75, 0.75), (0.25, 0.75)]]
    assert seg.path == "M 0.25000 0.25000 L 0.75000 0.25000 L 0.75000 0.75000 L 0.25000 0.75000 Z"
    mask = rle_decode(seg.mask_counts, seg.mask_size)
    assert seg.mask_size == (10, 20) and mask[5, 10] and not mask[0, 0] and not mask[9, 19]
    assert 40 <= mask.sum() <= 66
