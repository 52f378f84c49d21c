"""Every Triton kernel of the project builds for every chip it may meet, not only for the one
the tests run on: each is compiled ahead of time (``triton.compile`` with a `GPUTarget`; no
launch, so no such chip is needed) for sm_80 (A100), sm_86 (A10, RTX 30), sm_89 (L4, L40,
RTX 40), sm_90 (H100, H200), sm_100 (B200) and sm_120 (RTX 50, RTX PRO). A kernel that fails
to build anywhere fails here, naming the kernel and the chip.

The FP8 kernels of the vision tower use e4m3, which chips before sm_89 lack (Triton refuses
the type there): they are built for sm_89 and later only, and ``--vision-fp8`` refuses older
chips at start (that gate is tested on the CPU in test_chip_features.py). The kernels, their
argument types and constants are tests/support/triton_kernels.py's.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest

from tests.support.triton_kernels import KERNELS, TARGETS, Kernel, jit_function, source

triton = pytest.importorskip("triton")

pytestmark = pytest.mark.gpu


def _is_kernel(value: Any, module: str) -> bool:
    """A launched Triton kernel of ``module`` (it takes pointers; helpers such as _gelu do
    not, and are built inside the kernels that call them)."""
    if not isinstance(value, triton.runtime.JITFunction) or value.__module__ != module:
        return False
    return any(p.endswith("_ptr") for p in inspect.signature(value.fn).parameters)


def test_every_triton_kernel_of_the_project_is_listed() -> None:
    """A new kernel must join KERNELS, so that it is built for every chip too."""
    import pkgutil

    import vlm_server

    listed = {(k.module, k.name) for k in KERNELS}
    found = set()
    for info in pkgutil.walk_packages(vlm_server.__path__, "vlm_server."):
        if info.name.startswith("vlm_server.api"):
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:
            continue
        for name, value in vars(module).items():
            if _is_kernel(value, info.name):
                found.add((info.name, name))
    assert found <= listed, f"kernels missing from KERNELS: {sorted(found - listed)}"


@pytest.mark.parametrize("arch", TARGETS, ids=[f"sm_{a}" for a in TARGETS])
@pytest.mark.parametrize("kernel", KERNELS, ids=[k.name for k in KERNELS])
def test_the_kernel_builds_for_the_chip(kernel: Kernel, arch: int) -> None:
    if arch < kernel.min_arch:
        pytest.skip(f"{kernel.name} needs sm_{kernel.min_arch}+ (FP8 or PDL), gated at start")
    from triton.backends.compiler import GPUTarget

    fn = jit_function(kernel)
    try:
        compiled = triton.compile(source(fn, kernel), target=GPUTarget("cuda", arch, 32))
    except Exception as err:
        pytest.fail(f"{kernel.name} does not build for sm_{arch}: {type(err).__name__}: {err}")
    assert compiled.asm.get("cubin"), f"{kernel.name}: no cubin for sm_{arch}"
