"""How much of a start-up Triton's compiler takes: the kernels compiled (or read back from
its disk cache) while a `CompileClock` is on, their time and the slowest.

A fresh machine compiles every kernel variant a graph capture's warm-up meets (each launch
configuration, dtype and early-launch setting) one after another; a warm cache reads them
back. Triton's JIT hooks (``triton.knobs.runtime``) say when each compile starts and ends;
where a Triton has no such hooks the clock counts nothing.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType
from typing import Any

try:
    from triton import knobs
except ImportError:  # no Triton, or one without knobs
    knobs = None


class CompileClock:
    """A context in which Triton's compiles are counted and timed (the hooks set before it
    are still called, and restored after)."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self.slowest: tuple[float, str] | None = None
        self._started: dict[tuple[str, Any], float] = {}
        self._lock = threading.Lock()
        self._before: Any = None
        self._after: Any = None
        self.active = False
        self._hooked = False  # whether the hooks were ever set (`line` after the context)

    def __enter__(self) -> CompileClock:
        runtime = getattr(knobs, "runtime", None)  # a Triton without the hooks: inactive
        if runtime is not None and hasattr(runtime, "jit_post_compile_hook"):
            self._before, self._after = runtime.jit_cache_hook, runtime.jit_post_compile_hook
            runtime.jit_cache_hook, runtime.jit_post_compile_hook = self._start, self._end
            self.active = self._hooked = True
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        err: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.active:
            knobs.runtime.jit_cache_hook = self._before  # type: ignore[union-attr]
            knobs.runtime.jit_post_compile_hook = self._after  # type: ignore[union-attr]
            self.active = False

    def line(self) -> str:
        """What the clock saw, for a start-up log line."""
        if not self.count:
            return "Triton compiled no kernel" if self._hooked else "no Triton compile hooks"
        name = f"; slowest {self.slowest[1]} {self.slowest[0]:.1f} s" if self.slowest else ""
        return f"Triton compiled or read back {self.count} kernels in {self.seconds:.1f} s{name}"

    def _start(self, **kwargs: Any) -> Any:
        with self._lock:
            self._started[_key(kwargs)] = time.perf_counter()
        # A true answer skips the compile: only the earlier hook may give one.
        return self._before(**kwargs) if self._before is not None else None

    def _end(self, **kwargs: Any) -> Any:
        now = time.perf_counter()
        fn = kwargs.get("fn")
        with self._lock:
            began = self._started.pop(_key(kwargs), None)
            if began is not None:
                took = now - began
                self.count += 1
                self.seconds += took
                if self.slowest is None or took > self.slowest[0]:
                    self.slowest = (took, _name(fn))
        return self._after(**kwargs) if self._after is not None else None


def _name(fn: Any) -> str:
    """A hook's function info (`triton.runtime.jit.JitFunctionInfo`) as module.name."""
    return f"{getattr(fn, 'module', '?')}.{getattr(fn, 'name', fn)}"


def _key(kwargs: dict[str, Any]) -> tuple[str, Any]:
    """A compile's identity between its two hooks: its kernel and cache key (hashable)."""
    key = kwargs.get("key")
    try:
        hash(key)
    except TypeError:
        key = repr(key)
    return _name(kwargs.get("fn")), key
