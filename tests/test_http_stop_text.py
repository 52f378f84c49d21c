"""Stop sequences over text that arrives in pieces: what is sent is exactly the text before the
first stop sequence (the one that is complete first), however the pieces split it, and no piece
of a stop is ever sent."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from vlm_server.http.stop_text import StopText

ALPHABET = "ab c\n"


def _run(pieces: list[str], stops: tuple[str, ...]) -> tuple[list[str], bool]:
    matcher = StopText(stops)
    sent = [matcher.feed(p) for p in pieces]
    sent.append(matcher.flush())
    return sent, matcher.stopped


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(ALPHABET, max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=8),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=4),
)
def test_what_is_sent_is_the_text_before_the_first_stop(
    text: str, cuts: list[int], stops: list[str]
) -> None:
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    sent, stopped = _run(pieces, tuple(stops))
    # Checked one character at a time: the first end of a stop, then its earliest start.
    want, found = text, False
    for n in range(1, len(text) + 1):
        starts = [n - len(s) for s in stops if text[:n].endswith(s)]
        if starts:
            want, found = text[: min(starts)], True
            break
    assert "".join(sent) == want
    assert stopped == found


def test_a_possible_beginning_is_held_back_until_settled() -> None:
    matcher = StopText(("END",))
    assert matcher.feed("the E") == "the "  # "E" may begin END
    assert matcher.feed("N") == ""
    assert matcher.feed("D and more") == ""
    assert matcher.stopped and matcher.feed("ignored") == ""
    other = StopText(("END",))
    assert other.feed("the EN") == "the "
    assert other.feed("Xs") == "ENXs"  # settled: not the stop
    assert other.flush() == ""
