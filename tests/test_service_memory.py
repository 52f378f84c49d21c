"""glibc malloc settings of the server: with a fixed mmap threshold, large buffers freed
between live ones go back to the kernel; with glibc's self-raising default they stay."""

from __future__ import annotations

import asyncio
import ctypes.util
import subprocess
import sys
import textwrap

import pytest

from vlm_server.options.command_line import load_config
from vlm_server.options.table import ServerConfig
from vlm_server.server import memory

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or memory._libc() is None, reason="needs glibc"
)

# Allocates 24 blocks of 8 MiB, frees every other one (the holes sit between live blocks,
# where no heap trim from the top reaches), and prints the resident MiB that stay.
_PROGRAM = textwrap.dedent(
    """
    import ctypes, sys
    from vlm_server.server import memory
    if sys.argv[1] != "0":
        assert memory.limit_mmap_threshold(int(sys.argv[1]))
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    size = 8 << 20
    libc.free(libc.malloc(size))  # glibc's default raises its threshold here
    before = rss()
    blocks = [libc.malloc(size) for _ in range(24)]
    for b in blocks:
        ctypes.memset(b, 1, size)  # touch: resident
    for b in blocks[::2]:
        libc.free(b)
    print(rss() - before)
    """
)


def _kept_mib(threshold: int) -> float:
    run = subprocess.run(
        [sys.executable, "-c", "import ctypes.util\n" + _PROGRAM, str(threshold)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return float(run.stdout.strip())


def test_a_fixed_mmap_threshold_returns_freed_large_buffers() -> None:
    live = 12 * 8  # MiB still allocated
    assert _kept_mib(0) > live + 64  # glibc's default keeps most of the freed 96 MiB
    assert _kept_mib(1 << 20) < live + 16


def test_the_server_defaults_bound_the_heap() -> None:
    config = ServerConfig()
    assert config.malloc_mmap_threshold == 1 << 20 and config.malloc_arena_max == 2
    assert config.memory_trim_interval > 0
    assert load_config(["--malloc-mmap-threshold", "0"], environ={}).malloc_mmap_threshold == 0
    with pytest.raises(SystemExit):
        load_config(["--malloc-mmap-threshold", "64MiB"], environ={})
    assert memory.trim() in (True, False)
    assert ctypes.util.find_library("c")


def test_the_trimmer_trims_periodically_until_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(memory, "trim", lambda: calls.append(1) or True)

    async def run() -> int:
        trimmer = memory.Trimmer(0.01)
        trimmer.start()
        while len(calls) < 3:
            await asyncio.sleep(0.01)
        await trimmer.stop()
        stopped_at = len(calls)
        await asyncio.sleep(0.05)
        return len(calls) - stopped_at

    assert asyncio.run(run()) == 0
