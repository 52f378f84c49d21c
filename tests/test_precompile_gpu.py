"""Compiling Triton kernels ahead (engine/device/precompile.py) on the GPU: a recorded kernel
is neither compiled nor launched, the pool compiles it, and a later launch finds it; an engine
that compiled ahead answers as one whose warm-ups compiled (each in a fresh process: the pass
runs before any kernel is compiled there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vlm_server.engine.device import precompile
from vlm_server.engine.device.compile_clock import CompileClock

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ROOT = Path(__file__).resolve().parent.parent

try:
    import triton
    import triton.language as tl

    @triton.jit
    def _scaled(x_ptr, out_ptr, n, SCALE: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * SCALE, mask=mask)

except ImportError:
    triton = None


@pytest.mark.skipif(triton is None or not precompile.available(), reason="needs Triton's hook")
def test_a_recorded_kernel_is_skipped_then_compiled_on_the_pool_then_launched() -> None:
    x = torch.arange(1000, device="cuda", dtype=torch.float32)
    out = torch.full_like(x, -1.0)
    scale = 3.0 + torch.randint(0, 1000, ()).item()  # a specialization no test compiled yet
    with precompile.recording() as recorded:
        _scaled[(4,)](x, out, 1000, SCALE=scale, BLOCK=256)
    torch.cuda.synchronize()
    assert (out == -1.0).all()  # not launched
    assert len(recorded.kernels) == 1
    assert precompile.compile_all(recorded, threads=4) == 1
    with CompileClock() as clock:
        _scaled[(4,)](x, out, 1000, SCALE=scale, BLOCK=256)
    torch.cuda.synchronize()
    assert clock.count == 0  # found compiled
    torch.testing.assert_close(out, x * scale)


_SCRIPT = """
import json, sys, torch
from tests.test_engine import _finish_all, _text_requests
from image_pipeline import prepare_pil, sample_image
from vlm_server.models.registry import preset, random_model
loaded = random_model(preset("tiny"), seed=0, dtype=torch.bfloat16, device="cuda", progress=False)
base = sample_image()
turned = base.rotate(90, expand=True)
images = [prepare_pil(base), prepare_pil(turned), prepare_pil(base.resize((300, 200)))]
done = _finish_all(loaded, _text_requests(images), 2, compile_threads=int(sys.argv[1]))
print(json.dumps([[f.text, f.finish_reason.name] for f in done]))
"""


def _answers(threads: int) -> list[list[str]]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(threads)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_an_engine_that_compiled_ahead_answers_as_one_that_did_not() -> None:
    assert _answers(8) == _answers(0)
