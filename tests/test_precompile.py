"""Compiling Triton kernels ahead of the graphs' warm-ups (engine/device/precompile.py): the
recording hook, the parallel compile's bookkeeping and the once-per-process pass, with stand-in
JIT functions (the real compile needs a GPU: tests/test_precompile_gpu.py)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from vlm_server.engine.device import graphs, precompile

pytestmark = pytest.mark.skipif(not precompile.available(), reason="this Triton has no hook")


class StandIn:
    """A JIT function as the hook sees it: `preload` compiles its specialization."""

    def __init__(self, fails: bool = False) -> None:
        self.loaded: list[tuple[str, str]] = []
        self.fails = fails

    def preload(self, data: str) -> None:
        if self.fails:
            raise RuntimeError("no such target")
        self.loaded.append((data, threading.current_thread().name))


def _meet(fn: StandIn, data: str) -> object:
    """What Triton's launch path asks the hook on a cache miss (its keyword arguments)."""
    hook = precompile.knobs.runtime.jit_cache_hook
    return hook(
        key=data,
        repr=data,
        fn=SimpleNamespace(module="m", name="k", jit_function=fn),
        compile={"key": data, "specialization_data": data},
        is_manual_warmup=False,
        already_compiled=False,
    )


def test_recording_skips_each_kernel_and_keeps_it_once_then_restores_the_hook() -> None:
    before = precompile.knobs.runtime.jit_cache_hook
    a, b = StandIn(), StandIn()
    with precompile.recording() as recorded:
        assert _meet(a, "a1") is True  # skipped: neither compiled nor launched
        assert _meet(a, "a1") is True
        assert _meet(a, "a2") is True
        assert _meet(b, "a1") is True  # another kernel's specialization of the same text
        # One without specialization data is skipped all the same, and not kept.
        assert precompile.knobs.runtime.jit_cache_hook(fn=None, compile={}) is True
    assert precompile.knobs.runtime.jit_cache_hook is before
    assert recorded.kernels == [(a, "a1"), (a, "a2"), (b, "a1")]


def test_compile_all_preloads_each_on_the_pool_and_counts_failures() -> None:
    good, bad = StandIn(), StandIn(fails=True)
    recorded = precompile.Recorded()
    recorded.kernels = [(good, "g1"), (bad, "b1"), (good, "g2")]
    assert precompile.compile_all(recorded, threads=2) == 2
    assert [d for d, _ in good.loaded] == ["g1", "g2"]


def test_ahead_runs_the_pass_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precompile, "_warmed", False)
    fn = StandIn()
    passes: list[bool] = []

    def warm_ups() -> None:
        passes.append(True)
        _meet(fn, "s1")
        _meet(fn, "s2")

    line = precompile.ahead(warm_ups, threads=2)
    assert line.startswith("2 of 2 kernels compiled ahead on 2 threads"), line
    assert [d for d, _ in fn.loaded] == ["s1", "s2"]
    # A second engine in the process compiles in its own warm-ups (no pass on garbage).
    assert precompile.ahead(warm_ups, threads=2) == "no kernels compiled ahead"
    assert passes == [True]


def test_no_pass_after_an_engine_warmed_up_without_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precompile, "_warmed", False)
    assert precompile.ahead(lambda: pytest.fail("one thread: no pass"), 1).startswith("no")
    assert precompile.ahead(lambda: pytest.fail("kernels compiled already"), 8).startswith("no")


def test_ahead_does_nothing_with_one_thread_and_survives_a_failing_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(precompile, "_warmed", False)
    assert precompile.ahead(lambda: pytest.fail("no pass with one thread"), 1) == (
        "no kernels compiled ahead"
    )
    before = precompile.knobs.runtime.jit_cache_hook

    def broken() -> None:
        raise ValueError("a warm-up broke")

    assert precompile.ahead(broken, threads=4) == "no kernels compiled ahead"
    assert precompile.knobs.runtime.jit_cache_hook is before


def test_warm_ups_only_runs_each_key_and_keeps_no_graph() -> None:
    class Stream:
        device = "cpu"
        synced = 0

        def synchronize(self) -> None:
            self.synced += 1

    stream, seen = Stream(), []
    captured: graphs.GraphSet[int] = graphs.GraphSet("warm-ups")
    with graphs.warm_ups_only():
        captured.capture(
            [3, 1], lambda k: seen.append(("prepare", k)), lambda k: seen.append(("run", k)),
            stream, progress=False,
        )  # fmt: skip
    assert seen == [("prepare", 3), ("run", 3), ("prepare", 1), ("run", 1)]
    assert len(captured) == 0 and stream.synced == 1
    assert graphs._warm_ups_only is False
