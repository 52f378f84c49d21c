"""Priorities through the engine (tiny model, CPU): a request's priority crosses to an engine
process, and an interactive request submitted after twenty background ones, while the
background work fills the rows it may hold, is admitted at once and streams before every
background request still queued."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from image_pipeline import PreparedImage
from vlm_server.engine.api import (
    BATCH_PRIORITY,
    Emitted,
    EngineError,
    Finished,
    GenerationRequest,
    Task,
)
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.engine import BatchedEngine
from vlm_server.engine.process.wire import Submit, dumps, loads
from vlm_server.models.interface import LoadedModel


@pytest.fixture(scope="module")
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_the_priority_crosses_to_the_engine_process() -> None:
    for priority in (BATCH_PRIORITY, 0, 7):
        request = GenerationRequest(Task.QUERY, None, question="q", priority=priority)
        data, shared = dumps(Submit(3, request))
        assert shared == []  # nothing but values
        got = loads(data, [])
        assert isinstance(got, Submit) and got.request.priority == priority


class _Route:
    """A route that notes, in ``firsts``, its request's name when its first event comes."""

    def __init__(self, name: str, firsts: list[str]) -> None:
        self.name, self.firsts = name, firsts
        self.outcome: list[object] = []
        self.events: list[Emitted] = []

    def accepted(self) -> None:
        self.outcome.append("accepted")

    def refused(self, error: EngineError) -> None:
        self.outcome.append(error)

    def emit(self, event: Emitted) -> None:
        if not self.events:
            self.firsts.append(self.name)
        self.events.append(event)


def test_an_interactive_request_goes_ahead_of_twenty_background_ones(
    _one_thread: None, tiny: LoadedModel, sample_image: PreparedImage
) -> None:
    """The scheduler driven by hand (no thread): orders, never times."""
    engine = BatchedEngine(
        tiny,
        EngineConfig(
            max_batch_size=4,
            background_reserved_rows=1,
            kv_budget_bytes=16 << 20,
            cuda_graphs=False,
        ),
    )
    s = engine.scheduler
    firsts: list[str] = []  # request names, in the order their first events came
    admitted: list[str] = []  # in admission order
    routes: dict[str, _Route] = {}

    def submit(name: str, priority: int) -> None:
        request = GenerationRequest(
            Task.QUERY,
            sample_image if len(routes) % 2 else None,  # one picture, and text alone
            request_id=name,
            question=f"what is {name}?",
            temperature=0.0,
            max_tokens=6,
            priority=priority,
        )
        routes[name] = route = _Route(name, firsts)
        engine.admit(request, route)  # nothing slow: queued before it returns
        assert route.outcome == ["accepted"]

    def tick() -> None:
        s.waiting.extend(engine._inbox)
        engine._inbox.clear()
        s.tick()
        for seq in s.running:
            if seq.request.request_id not in admitted:
                admitted.append(seq.request.request_id)

    try:
        for i in range(20):
            submit(f"bg{i}", BATCH_PRIORITY)
        for _ in range(100):
            tick()
            if firsts:  # background work streams, in every row it may hold
                break
        assert firsts and len(s.running) == 3 and s.headroom.rows == 3
        queued = [q.request.request_id for q in s.waiting]
        assert len(queued) == 20 - len(admitted) >= 15
        submit("urgent", 5)
        tick()
        assert admitted[-1] == "urgent"  # the reserved row: at once
        assert [q.request.request_id for q in s.waiting] == queued  # none went ahead
        for _ in range(10_000):
            if not s.has_work():
                break
            tick()
        assert admitted.index("urgent") < min(admitted.index(name) for name in queued)
        assert firsts.index("urgent") < min(firsts.index(name) for name in queued)
        for route in routes.values():
            ends = [e for e in route.events if isinstance(e, Finished | EngineError)]
            assert len(ends) == 1 and isinstance(ends[0], Finished)
        assert not s.running and not s.waiting and s.headroom.rows == 0
    finally:
        engine.close()
