"""Graph capture survives Python's cyclic collector running mid-capture (GPU)."""

from __future__ import annotations

import gc

import pytest
import torch

from vlm_server.engine.device import graphs
from vlm_server.engine.device.graphs import GraphSet

pytestmark = pytest.mark.gpu


def _capture_while_a_graph_becomes_garbage() -> GraphSet[int]:
    """Capture two graphs whose ``run``, inside the first capture, leaves a captured graph held
    by an unreachable cycle alone, then allocates enough to start a collection."""
    stream = torch.cuda.Stream()
    x = torch.ones(4, device="cuda")
    old = torch.cuda.CUDAGraph()
    with torch.cuda.graph(old, stream=stream):
        x.mul_(1)
    holder = {"graph": old}
    del old

    def run(key: int) -> torch.Tensor:
        if torch.cuda.is_current_stream_capturing() and "graph" in holder:
            cycle: list[object] = [holder.pop("graph")]
            cycle.append(cycle)
            del cycle  # garbage of the youngest generation: only the collector frees it
            _junk = [[i] for i in range(2000)]  # past the threshold: a collection may start
        return x * key

    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        captured: GraphSet[int] = GraphSet("collector test")
        captured.capture([3, 2], lambda _key: None, run, stream, progress=False)
    finally:
        gc.set_threshold(*threshold)
    return captured


def test_a_collection_during_capture_cannot_lose_it() -> None:
    captured = _capture_while_a_graph_becomes_garbage()
    with torch.cuda.stream(torch.cuda.Stream()):
        out = captured.replay(3)
    torch.cuda.synchronize()
    assert out.tolist() == [3.0] * 4  # type: ignore[union-attr]


def test_without_the_pause_the_collection_breaks_the_capture(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The hazard the pause exists for: the same capture fails with the collector running
    (so the test above can fail)."""
    monkeypatch.setattr(graphs, "collector_paused", _collector_running)
    with pytest.raises(RuntimeError):
        _capture_while_a_graph_becomes_garbage()
    torch.cuda.synchronize()


def _collector_running() -> object:
    import contextlib

    return contextlib.nullcontext()
