"""Triton kernels compiled ahead, in parallel, before the graphs' warm-ups meet them one by one.

Start-up with a cold Triton cache spends most of its time compiling: the warm-ups before each
graph capture meet about a hundred kernel specializations one after another (26 of 45 s of an
H100's captures). Triton's compiler releases the GIL in its passes and in ptxas, so threads
compile side by side. `ahead` runs a warm-up pass in which no kernel Triton has not compiled
yet is compiled or launched, only recorded (Triton's ``jit_cache_hook``; the pass's outputs
are garbage, and nothing reads them), then compiles what it recorded on a thread pool
(``JITFunction.preload`` under ``AsyncCompileMode``), so the real warm-ups find every kernel
compiled. A kernel the pass did not meet is compiled by its warm-up as before, and a Triton
without these parts compiles as before: each part is looked up, never assumed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

try:
    from triton import knobs
    from triton.runtime._async_compile import AsyncCompileMode
except ImportError:  # no Triton, or one without these parts: nothing compiles ahead
    knobs = None
    AsyncCompileMode = None


def available() -> bool:
    """Whether this Triton has what `ahead` needs (the hook, async compiles, preload)."""
    runtime = getattr(knobs, "runtime", None)
    return AsyncCompileMode is not None and hasattr(runtime, "jit_cache_hook")


@dataclass
class Recorded:
    """The kernel specializations a pass met uncompiled: (JIT function, its specialization
    data as Triton serializes it), each once."""

    kernels: list[tuple[Any, str]] = field(default_factory=list)
    _seen: set[tuple[int, str]] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def hook(self, **kwargs: Any) -> bool:
        """Triton's ``jit_cache_hook``: record the kernel, and answer True (skip it: neither
        compiled nor launched)."""
        jit_function = getattr(kwargs.get("fn"), "jit_function", None)
        data = (kwargs.get("compile") or {}).get("specialization_data")
        if jit_function is None or not hasattr(jit_function, "preload") or data is None:
            return True  # skipped all the same: its warm-up compiles it later
        with self._lock:
            key = (id(jit_function), data)
            if key not in self._seen:
                self._seen.add(key)
                self.kernels.append((jit_function, data))
        return True


@contextlib.contextmanager
def recording() -> Iterator[Recorded]:
    """Within: every Triton kernel not compiled in this process yet is recorded and skipped
    (no compile, no launch); kernels already compiled launch as usual."""
    recorded = Recorded()
    before = knobs.runtime.jit_cache_hook  # type: ignore[union-attr]
    knobs.runtime.jit_cache_hook = recorded.hook  # type: ignore[union-attr]
    try:
        yield recorded
    finally:
        knobs.runtime.jit_cache_hook = before  # type: ignore[union-attr]


def compile_all(recorded: Recorded, threads: int) -> int:
    """Compile (or read back from Triton's disk cache) every recorded kernel on ``threads``
    threads; returns how many compiled. A kernel that fails is left to its warm-up."""
    failed = 0
    pool = ThreadPoolExecutor(threads, thread_name_prefix="triton-compile")
    with pool, AsyncCompileMode(pool):  # type: ignore[misc]
        for jit_function, data in recorded.kernels:
            try:
                jit_function.preload(data)
            except Exception as err:  # its warm-up compiles it instead
                failed += 1
                log.debug("compile ahead: %s: %s", jit_function, err)
    return len(recorded.kernels) - failed


# Whether an engine of this process warmed its steps up already (with a pass or without): a
# pass runs only before any, since a later one would launch the kernels compiled then on what
# the skipped ones left (garbage), which may be an index.
_warmed = False


def ahead(warm_ups: Callable[[], None], threads: int) -> str:
    """Called by every engine before its steps' warm-ups; for the first in the process, run
    ``warm_ups`` once with every uncompiled Triton kernel recorded and skipped (the
    caller makes it a pass of warm-ups only: nothing it computes is kept), then compile what
    it met on ``threads`` threads. Returns a line for the start-up log; never raises for
    Triton's sake (the warm-ups after it compile whatever is left)."""
    global _warmed
    first, _warmed = not _warmed, True
    if threads < 2 or not available() or not first:
        return "no kernels compiled ahead"
    started = time.perf_counter()
    try:
        with recording() as recorded:
            warm_ups()
        met = time.perf_counter() - started
        compiled = compile_all(recorded, threads)
    except Exception as err:  # an optimization: the warm-ups compile as before
        log.warning("compiling ahead failed, the warm-ups compile instead: %s", err)
        return "no kernels compiled ahead"
    return (
        f"{compiled} of {len(recorded.kernels)} kernels compiled ahead on {threads} threads "
        f"in {time.perf_counter() - started:.1f} s (the pass that met them {met:.1f} s)"
    )
