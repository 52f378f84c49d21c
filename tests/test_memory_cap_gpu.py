"""--gpu-memory on a GPU: the allocator stops at the cap, the default KV budget stays under
it, and a cap above the card is refused naming the field. In a child process: the cap is
process-wide and would bind the other tests."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

SCRIPT = r"""
import torch
from vlm_server.devices import cap_memory
from vlm_server.engine.device.kv_pool import default_budget
dev = torch.device("cuda")
total = torch.cuda.get_device_properties(dev).total_memory
try:
    cap_memory(dev, total + 1)
except ValueError as e:
    assert "gpu_memory_bytes" in str(e)
else:
    raise AssertionError("a cap above the card was taken")
cap_memory(dev, 2 << 30)
keep = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
budget = default_budget(dev, 2 << 30)
assert 0 < budget <= 0.4 * (1 << 30) + (64 << 20), budget
try:
    more = torch.empty(3 << 30, dtype=torch.uint8, device=dev)
except torch.OutOfMemoryError:
    print("capped")
"""


def test_the_memory_cap_binds_the_allocator_and_the_kv_default() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "capped"
