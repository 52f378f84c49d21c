"""The memory plan against a GPU: Moondream 2 (random weights, bf16) under --gpu-memory caps of
8, 16 and 24 GiB, its graphs captured and a burst of distinct pictures served; the
allocator's peak (max_memory_reserved) is within 5% of the plan's, and the KV pool took the
plan's pages up to the memory the plan estimates but cannot know (what was free). Each cap in
a child process: the cap is process-wide."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

SCRIPT = r"""
import asyncio, io, json, sys
import numpy as np
import torch
from PIL import Image
from image_pipeline import prepare_image
from vlm_server.devices import cap_memory
from vlm_server.engine.api import Finished, GenerationRequest, Task
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.memory_plan import plan_memory
from vlm_server.engine.engine import BatchedEngine
from vlm_server.models.registry import memory_shape, preset, random_model
from vlm_server.server.in_process import InProcessEngine

cap = int(sys.argv[1]) << 30
dev = torch.device("cuda")
cap_memory(dev, cap)
config = preset("moondream2")
loaded = random_model(config, dtype=torch.bfloat16, device=dev, progress=False)
cfg = EngineConfig(max_batch_size=32, gpu_memory_bytes=cap)
total = torch.cuda.get_device_properties(dev).total_memory
plan = plan_memory(memory_shape(config), cfg, total, "bf16")
engine = InProcessEngine(BatchedEngine(loaded, cfg))
rng = np.random.default_rng(0)

def picture(i):
    pixels = rng.integers(0, 256, (600 + 8 * i, 800, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG")
    return prepare_image(out.getvalue())

async def one(req):
    async for event in await engine.submit(req):
        if isinstance(event, Finished):
            return event

async def run():
    await engine.start()
    try:
        reqs = [
            GenerationRequest(Task.QUERY, picture(i), question="what is it?", max_tokens=64)
            for i in range(cfg.max_batch_size)
        ]
        await asyncio.gather(*[one(r) for r in reqs])
    finally:
        await engine.close()

asyncio.run(run())
print(json.dumps({
    "planned_peak": plan.peak_bytes,
    "peak": torch.cuda.max_memory_reserved(dev),
    "planned_pages": plan.kv_pages,
    "pages": engine.batched.runtime.kv_pages,
}))
"""


@pytest.mark.parametrize("gib", [8, 16, 24])
def test_the_plans_peak_is_within_5_percent_of_the_measured_one(gib: int) -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(gib)], capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert abs(got["peak"] - got["planned_peak"]) <= 0.05 * got["peak"], got
    assert abs(got["pages"] - got["planned_pages"]) <= 0.05 * got["pages"], got
