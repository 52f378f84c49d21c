"""Copies of the project's Triton modules whose kernels run in Triton's interpreter on the CPU
(the modules the server imports keep their compiled kernels)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType, SimpleNamespace

import pytest


def _scalar_loop_bounds() -> None:
    """Let kernels loop to a runtime integer argument in the interpreter: it passes scalars as
    one-element arrays, which NumPy 2.4 no longer converts with ``int()`` (`range` would fail)."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor
    if getattr(patch, "scalar_bounds", False):
        return

    def patched(tensor: type, scope: object) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))  # type: ignore[attr-defined]

    patched.scalar_bounds = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


def _library_helpers_interpreted() -> None:
    """Let interpreted kernels call Triton's own ``@jit`` helpers (`tl.zeros`, `tl.cdiv`, ...):
    Triton imported without ``TRITON_INTERPRET`` made them compiled-only `JITFunction`s, which
    refuse a call from Python. Such a call only ever comes from an interpreted kernel (a compiled
    one inlines its helpers), so it runs the helper in the interpreter instead of failing; the
    kernels of the modules the server imports stay compiled."""
    from triton.runtime import interpreter, jit

    if getattr(jit.JITFunction.__call__, "interpreted", False):
        return
    helpers: dict[object, interpreter.InterpretedFunction] = {}

    def call(self: jit.JITFunction, *args: object, **kwargs: object) -> object:
        helper = helpers.get(self.fn)
        if helper is None:
            helper = helpers[self.fn] = interpreter.InterpretedFunction(self.fn)
        return helper(*args, **kwargs)

    call.interpreted = True  # type: ignore[attr-defined]
    jit.JITFunction.__call__ = call  # type: ignore[method-assign]


def _device_calls_restore_the_language() -> None:
    """Undo what each device-function call of an interpreted kernel patches in
    ``triton.language``: the interpreter swaps the language's builtins for interpreting ones
    around a kernel's run and restores them after, but a call to a helper patches the
    namespaces the helper's module sees (``triton.language.core`` for Triton's own helpers)
    and never restores them, so a kernel compiled later in the same process (the per-chip
    tests) would be built with interpreting builtins and fail."""
    from triton.runtime import interpreter

    call = interpreter.InterpretedFunction.__call__
    if getattr(call, "restores", False):
        return

    def restoring(self: interpreter.InterpretedFunction, *args: object, **kwargs: object) -> object:
        scope = interpreter._patch_lang(self.fn)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e
        finally:
            scope.restore()

    restoring.restores = True  # type: ignore[attr-defined]
    interpreter.InterpretedFunction.__call__ = restoring  # type: ignore[method-assign]


def interpreted(module: ModuleType) -> ModuleType:
    """A fresh copy of ``module`` loaded with ``TRITON_INTERPRET=1`` (read when `triton.jit`
    wraps each kernel), registered as ``<name>_interpreted``; the caller removes it from
    `sys.modules` when done."""
    name = module.__name__.rsplit(".", 1)[-1] + "_interpreted"
    spec = importlib.util.spec_from_file_location(name, module.__file__)
    assert spec is not None and spec.loader is not None
    copy = importlib.util.module_from_spec(spec)
    sys.modules[name] = copy  # dataclasses look their module up while the body runs
    _scalar_loop_bounds()
    _library_helpers_interpreted()
    _device_calls_restore_the_language()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        spec.loader.exec_module(copy)
    return copy


@contextmanager
def interpreted_copy(module: ModuleType) -> Iterator[ModuleType]:
    """`interpreted` for the length of a block (a module fixture's body), skipped without
    Triton; the copy is removed from `sys.modules` afterwards."""
    pytest.importorskip("triton")
    copy = interpreted(module)
    try:
        yield copy
    finally:
        del sys.modules[copy.__name__]


def interpreted_moe() -> Iterator[SimpleNamespace]:
    """Moondream 3's routing and expert kernels interpreted (a module fixture's body: the
    expert module groups through the interpreted routing kernels)."""
    from vlm_server.models.moondream3 import moe_routing, moe_triton

    mr = interpreted(moe_routing)
    mt = interpreted(moe_triton)
    mt.moe_routing = mr
    yield SimpleNamespace(routing=mr, triton=mt)
    for m in (mr, mt):
        del sys.modules[m.__name__]
