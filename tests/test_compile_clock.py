"""The start-up's compile clock (engine/device/compile_clock.py) through Triton's JIT hooks,
driven as Triton drives them: a hook before each compile, one after."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vlm_server.engine.device.compile_clock import CompileClock

knobs = pytest.importorskip("triton").knobs


def _compile(name: str, key: object) -> None:
    fn = SimpleNamespace(module="m", name=name)  # a fresh info object per hook, as Triton's
    assert not knobs.runtime.jit_cache_hook(key=key, fn=fn, repr=name)
    info = SimpleNamespace(module="m", name=name)
    knobs.runtime.jit_post_compile_hook(key=key, fn=info, repr=name)


def test_compiles_are_counted_and_the_hooks_before_still_run() -> None:
    seen: list[str] = []
    before, after = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append(f"pre {kw['fn'].name}")
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(f"post {kw['fn'].name}")
    try:
        with CompileClock() as clock:
            assert clock.active
            _compile("_up_kernel", ("sig", 1))
            _compile("_down_kernel", ["unhashable"])
        assert clock.count == 2 and clock.seconds >= 0 and clock.slowest is not None
        assert clock.line().startswith("Triton compiled or read back 2 kernels in ")
        assert seen == [f"{w} {k}" for k in ("_up_kernel", "_down_kernel") for w in ("pre", "post")]
        assert not clock.active
        assert knobs.runtime.jit_cache_hook is not None  # the earlier hooks are back
        knobs.runtime.jit_post_compile_hook(key=1, fn=SimpleNamespace(name="x"))
        assert seen[-1] == "post x" and clock.count == 2  # no longer counting
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before, after


def test_nothing_compiled_says_so() -> None:
    before = knobs.runtime.jit_cache_hook
    with CompileClock() as clock:
        assert knobs.runtime.jit_cache_hook is not before
        assert clock.line() == "Triton compiled no kernel"
    assert knobs.runtime.jit_cache_hook is before
    assert clock.line() == "Triton compiled no kernel"  # still said after the context
    assert CompileClock().line() == "no Triton compile hooks"  # never entered
