"""`stream_events`: how a request's events reach its reader (both engines' streams use it)."""

from __future__ import annotations

import asyncio

import pytest

from vlm_server.engine.api import (
    Box,
    EngineError,
    ErrorCode,
    Finished,
    FinishReason,
    PathDelta,
    TextDelta,
    stream_events,
)


def _collect(pushed: list[object], between: bool) -> list[object]:
    """Events read from a queue fed with ``pushed``; ``between``: the reader takes each one
    before the next arrives (it keeps up), else all were queued before it looked."""

    async def run() -> list[object]:
        queue: asyncio.Queue = asyncio.Queue()
        got: list[object] = []
        if between:

            async def feed() -> None:
                for event in pushed:
                    queue.put_nowait(event)
                    await asyncio.sleep(0.001)

            feeding = asyncio.create_task(feed())
        else:
            for event in pushed:
                queue.put_nowait(event)
        try:
            async for event in stream_events(queue):
                got.append(event)
        except EngineError as err:
            got.append(err)
        if between:
            await feeding
        return got

    return asyncio.run(run())


DONE = Finished(FinishReason.EOS, text="abc")


def test_a_reader_that_keeps_up_gets_every_delta() -> None:
    pushed = [TextDelta("a"), TextDelta("b"), TextDelta("c"), DONE]
    assert _collect(pushed, between=True) == pushed


def test_deltas_queued_behind_a_busy_reader_come_merged_and_the_end_follows() -> None:
    pushed = [TextDelta("a"), TextDelta("b"), TextDelta("c"), DONE]
    assert _collect(pushed, between=False) == [TextDelta("abc"), DONE]


def test_an_error_ends_the_stream_after_the_text_before_it() -> None:
    error = EngineError(ErrorCode.CANCELLED, "the request was cancelled")
    got = _collect([TextDelta("a"), TextDelta("b"), error, TextDelta("never")], between=False)
    assert got == [TextDelta("ab"), error]


def test_nothing_after_the_result_is_read() -> None:
    got = _collect([DONE, TextDelta("late")], between=False)
    assert got == [DONE]


@pytest.mark.parametrize("between", [True, False])
def test_the_text_is_the_same_either_way(between: bool) -> None:
    pushed = [TextDelta(c) for c in "hello, world"] + [DONE]
    got = _collect(pushed, between)
    assert "".join(e.text for e in got if isinstance(e, TextDelta)) == "hello, world"


def test_path_deltas_merge_like_text_keeping_the_box() -> None:
    box = Box(0.1, 0.2, 0.3, 0.4)
    pushed = [PathDelta("", box), PathDelta("M 0 0"), PathDelta(" L 1 1"), DONE]
    assert _collect(pushed, between=True) == pushed
    assert _collect(pushed, between=False) == [PathDelta("M 0 0 L 1 1", box), DONE]
    # Text and path deltas never merge into each other.
    mixed = [TextDelta("a"), PathDelta("M 0 0"), TextDelta("b"), DONE]
    assert _collect(mixed, between=False) == mixed
