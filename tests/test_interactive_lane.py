"""The interactive prefill lane in the scheduler (engine/core/scheduler.py), on the script
runtime: while background work runs, new interactive pictures go to the runtime's interactive
lane in small batches of their own, with slots of their own; without background work they take
the prefill stream as before; a batch never mixes the lanes; and prompts riding the lane are
sampled by the very next step, which waits for their batch on the device, when no other
interactive request runs."""

from __future__ import annotations

from tests.test_scheduler_priorities import Harness
from vlm_server.engine.api import BATCH_PRIORITY
from vlm_server.engine.core.sequence import Sequence


def _names(seqs: list[Sequence]) -> list[str]:
    return [q.request.request_id for q in seqs]


def _batches(h: Harness) -> list[tuple[int, bool]]:
    return [(len(b.jobs), b.interactive) for b in h.rt.batches]


def test_interactive_pictures_take_their_lane_while_background_runs() -> None:
    h = Harness(reserved=2, prefix_slots=2, prefill_batch=2, interactive_batch=2)
    for i in range(6):
        h.submit(f"bg{i}", priority=BATCH_PRIORITY, image=f"p{i}", max_tokens=30)
    assert _names(h.tick()) == ["bg0", "bg1"]
    for i in range(3):
        h.submit(f"i{i}", image=f"q{i}")
    assert _names(h.tick()) == ["i0", "i1"]  # a batch of the lane's size
    assert _names(h.tick()) == ["i2"]  # the lane's second slot, beside the first
    assert _batches(h) == [(2, False), (2, True), (1, True)]
    h.submit("i3", image="q3")
    assert h.tick() == []  # both of the lane's slots are busy
    h.rt.batches[1].done = True
    assert _names(h.tick()) == ["i3"]
    assert _batches(h)[-1] == (1, True)
    h.run()
    h.all_ended()
    assert not any(b.interactive for b in h.rt.batches[4:])  # background alone: one lane


def test_without_background_work_pictures_take_the_prefill_stream() -> None:
    h = Harness(interactive_batch=2)
    for i in range(3):
        h.submit(f"i{i}", image=f"q{i}")
    assert _names(h.tick()) == ["i0", "i1", "i2"]
    assert _batches(h) == [(3, False)]
    h.run()
    h.all_ended()


def test_with_the_lane_off_interactive_pictures_share_the_prefill_stream() -> None:
    h = Harness(reserved=2, prefix_slots=2, prefill_batch=2)
    h.submit("bg", priority=-1, image="p", max_tokens=30)
    h.tick()
    h.submit("i", image="q")
    assert _names(h.tick()) == ["i"]
    assert _batches(h) == [(1, False), (1, False)]
    h.run()
    h.all_ended()


def test_a_batch_holds_the_pictures_of_one_lane() -> None:
    h = Harness(reserved=2, interactive_batch=4)
    h.submit("text", priority=-1, max_tokens=40)  # background work without a picture
    h.tick()
    h.submit("i0", image="q0")
    h.submit("bg0", priority=-1, image="p0")
    h.submit("i1", image="q1")  # arrived later, but ahead of background work
    assert _names(h.tick()) == ["i0", "i1"]
    assert _names(h.tick()) == ["bg0"]
    assert _batches(h) == [(2, True), (1, False)]
    h.run()
    h.all_ended()


def _rows(h: Harness, *seqs: Sequence) -> set[int]:
    return {q.row for q in seqs}


def test_riders_of_the_lane_are_sampled_by_the_next_step_behind_their_batch() -> None:
    h = Harness(reserved=2, interactive_batch=2, riding=64)
    bg = h.submit("bg", priority=-1, max_tokens=60)
    for _ in range(4):
        h.tick()
    ask = h.submit("ask", image="q", prompt=5, max_tokens=3)
    assert _names(h.tick()) == ["ask"]
    batch = h.rt.batches[-1]
    assert batch.interactive and not batch.done
    rows, after = h.rt.mixed[-1]
    # Launched in the tick that admitted it: its held row and the background row wait for
    # the batch on the device, not for the host to see it done.
    assert after is batch and set(rows) == _rows(h, bg, ask)
    assert not ask.rides_prefix and not ask.held
    h.run()
    h.all_ended()
    assert sum(after is not None for _, after in h.rt.mixed) == 1


def test_riders_wait_for_their_batch_while_another_interactive_request_runs() -> None:
    """Chaining would hold that request's next token behind the picture: the held row waits
    for the host to see the batch done instead."""
    h = Harness(reserved=2, interactive_batch=2, riding=64)
    h.submit("bg", priority=-1, max_tokens=60)
    talk = h.submit("talk", max_tokens=60)
    for _ in range(4):
        h.tick()
    ask = h.submit("ask", image="q", prompt=5, max_tokens=3)
    assert _names(h.tick()) == ["ask"]
    batch = h.rt.batches[-1]
    for _ in range(3):
        h.tick()
        assert ask.rides_prefix and talk.grammar.token_ids  # talk goes on
    assert all(after is None for _, after in h.rt.mixed)
    batch.done = True
    h.run()
    h.all_ended()
    assert all(after is None for _, after in h.rt.mixed)


def test_riders_of_each_lane_chain_behind_their_own_lane() -> None:
    """Batches the host never sees done: a background rider alone waits for its batch on the
    prefill stream; an interactive rider arriving next waits for the lane only, and the
    background row, decoding by then, goes with it. Every step waits for one lane."""
    h = Harness(reserved=2, interactive_batch=2, riding=64)
    bg = h.submit("bg", priority=-1, image="p", prompt=4, max_tokens=3)
    h.tick()
    ask = h.submit("ask", image="q", prompt=4, max_tokens=3)
    h.tick()
    rows = (bg.row, ask.row)
    for _ in range(50):
        if not h.s.has_work():
            break
        h.tick()  # no batch is finished by the test: only by a step that waited for it
    h.all_ended()
    normal, lane = h.rt.batches
    assert not normal.interactive and lane.interactive
    waits = [(r, after) for r, after in h.rt.mixed if after is not None]
    assert waits == [([rows[0]], normal), (list(rows), lane)]
