"""What background work yields to interactive requests (EngineConfig.background_yield), and
interactive pictures started during a commit's wait, in the scheduler on the script runtime:
with "prefill" no background picture batch starts while an interactive picture is on its lane;
with "steps" a step that interactive rows want carries only those, and the step that samples
riders of the lane carries them alone; background work goes on once they are done, and every
request ends; an interactive picture arriving while the scheduler waits for a step starts on
its lane before that step's commit, but only while background work runs."""

from __future__ import annotations

from tests.test_scheduler_priorities import Harness
from vlm_server.engine.api import BATCH_PRIORITY
from vlm_server.engine.core.headroom import YIELDS_IN_A_ROW
from vlm_server.engine.core.sequence import Sequence


def _names(seqs: list[Sequence]) -> list[str]:
    return [q.request.request_id for q in seqs]


def _rows(*seqs: Sequence) -> set[int]:
    return {q.row for q in seqs}


def _background(h: Harness, n: int, image: bool = True) -> list[Sequence]:
    return [
        h.submit(f"bg{i}", BATCH_PRIORITY, image=f"p{i}" if image else None, max_tokens=40)
        for i in range(n)
    ]


def _picture_beside_background(background_yield: str, n: int) -> Harness:
    """Background work without a picture running; then an interactive picture and ``n``
    background ones arrive, and the interactive one takes its lane."""
    h = Harness(reserved=2, prefill_batch=1, interactive_batch=2, background_yield=background_yield)
    h.submit("text", BATCH_PRIORITY, max_tokens=60)
    h.tick()
    h.submit("i0", image="q0")
    _background(h, n)
    assert _names(h.tick()) == ["i0"]
    return h


def test_prefill_yield_holds_background_pictures_while_the_lane_runs() -> None:
    h = _picture_beside_background("prefill", 2)
    lane = h.rt.batches[-1]
    assert lane.interactive
    for _ in range(4):
        assert h.tick() == []  # bg0's picture waits: the interactive one is on its lane
    lane.done = True
    assert _names(h.tick()) == ["bg0"]
    h.run()
    h.all_ended()


def test_a_lane_that_never_pauses_lets_a_background_batch_start_after_some_of_its_batches() -> None:
    h = Harness(reserved=2, prefill_batch=1, interactive_batch=1, background_yield="prefill")
    h.submit("text", BATCH_PRIORITY, max_tokens=200)
    h.tick()
    _background(h, 1)
    for i in range(YIELDS_IN_A_ROW):
        h.submit(f"i{i}", image=f"q{i}")  # each new picture while the last is on the lane
        assert _names(h.tick()) == [f"i{i}"]
        for batch in h.rt.batches[:-1]:  # the older ones end: the newest is always pending
            batch.done = True
    assert _names(h.tick()) == ["bg0"]  # beside the lane, after that many of its batches
    assert not h.rt.batches[-1].interactive
    h.run()
    h.all_ended()


def test_without_prefill_yield_background_pictures_start_beside_the_lane() -> None:
    h = _picture_beside_background("steps", 1)
    assert _names(h.tick()) == ["bg0"]
    h.run()
    h.all_ended()


def _talk_beside_background(
    background_yield: str, n: int, max_tokens: int
) -> tuple[Harness, Sequence, list[Sequence]]:
    """``n`` background requests running, then an interactive one, ticked until it ended."""
    h = Harness(reserved=2, background_yield=background_yield)
    bgs = _background(h, n, image=False)
    for _ in range(3):
        h.tick()
    talk = h.submit("talk", max_tokens=max_tokens)
    while not talk.finished:
        h.tick()
    return h, talk, bgs


def test_steps_yield_carries_interactive_rows_alone_then_background_goes_on() -> None:
    # A step for each token, and its prompt's: within the yields in a row.
    h, talk, bgs = _talk_beside_background("steps", 3, YIELDS_IN_A_ROW - 1)
    alone = [rows for rows in h.rt.decodes if _rows(talk) & set(rows)]
    assert alone and all(set(rows) == _rows(talk) for rows in alone)
    mixed = [rows for rows, _ in h.rt.mixed if _rows(talk) & set(rows)]
    assert mixed and all(set(rows) == _rows(talk) for rows in mixed)
    launched, bg_rows = len(h.rt.decodes), _rows(*bgs)
    h.run()
    h.all_ended()
    after = h.rt.decodes[launched:]
    assert after and all(set(rows) <= bg_rows for rows in after)


def test_interactive_traffic_that_never_pauses_leaves_background_rows_steps() -> None:
    h, talk, bgs = _talk_beside_background("steps", 2, 30)
    steps = [set(rows) for rows in h.rt.decodes if _rows(talk) & set(rows)]
    assert len(steps) > 2 * YIELDS_IN_A_ROW
    with_background = [i for i, rows in enumerate(steps) if rows & _rows(*bgs)]
    assert len(with_background) < len(steps) / 2  # most steps the interactive rows' alone
    gaps = [b - a for a, b in zip([-1, *with_background], with_background, strict=False)]
    assert with_background and max(gaps) <= YIELDS_IN_A_ROW + 1  # never starved
    h.run()
    h.all_ended()


def test_without_steps_yield_interactive_rows_share_steps_with_background() -> None:
    h, talk, bgs = _talk_beside_background("prefill", 3, 6)
    assert any(set(rows) == _rows(talk, *bgs) for rows in h.rt.decodes)
    h.run()
    h.all_ended()


def test_steps_yield_samples_riders_of_the_lane_in_a_step_of_their_own() -> None:
    h = Harness(reserved=2, interactive_batch=2, riding=64, background_yield="steps")
    (bg,) = _background(h, 1, image=False)
    for _ in range(4):
        h.tick()
    ask = h.submit("ask", image="q", prompt=5, max_tokens=3)
    assert _names(h.tick()) == ["ask"]
    batch = h.rt.batches[-1]
    rows, after = h.rt.mixed[-1]
    assert after is batch and set(rows) == _rows(ask)  # behind its batch, alone
    h.run()
    h.all_ended()
    assert bg.finished


def test_a_picture_arriving_during_a_commit_wait_starts_on_its_lane_before_the_commit() -> None:
    h = Harness(reserved=2, interactive_batch=2, background_yield="off")
    _background(h, 2, image=False)
    h.tick()
    h.tick()
    assert h.s.pipe.n_in_flight == 2  # the next tick commits, waiting for the oldest step
    launched = []  # (lane, steps committed by then) of each prefix batch
    launch = h.rt.launch_prefixes

    def record(jobs, partitioned=False, interactive=False):  # type: ignore[no-untyped-def]
        launched.append((interactive, h.steps.committed_n))
        return launch(jobs, partitioned, interactive)

    h.rt.launch_prefixes = record  # type: ignore[method-assign]
    arrivals = [lambda: h.submit("late", image="q")]
    h.arrive_while_waiting(lambda: arrivals.pop()() if arrivals else None)
    committed = h.steps.committed_n
    assert _names(h.tick()) == ["late"]
    assert launched == [(True, committed)]  # on the lane, before the step's commit
    assert h.steps.committed_n == committed + 1
    h.run()
    h.all_ended()


def test_without_background_work_the_commit_wait_is_not_cut_short() -> None:
    h = Harness(reserved=2, interactive_batch=2)
    h.submit("talk", max_tokens=30)
    waits = []

    def arrivals() -> Sequence | None:
        waits.append(1)
        return None

    h.arrive_while_waiting(arrivals)
    h.run()
    h.all_ended()
    assert not waits  # nothing background: the commit blocks as it always did
