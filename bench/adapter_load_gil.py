"""How much loading an adapter delays another thread of the engine process (CPU, no model).

A ticker thread (the scheduler thread's stand-in) sleeps ``--tick-ms`` in a loop and records
the wall time between its wakes. Meanwhile ``--loads`` seeded random adapters of the preset's
decoder widths (rank ``--rank``, bf16, the reference's ``.pt`` format) load one after another
into a CPU bank, under the engine's shortened GIL switch interval, two ways:

  in-process  the file read, key renames, checks and packing on the loading thread (how the
              engine loaded adapters before engine/adapter_reader.py)
  child       the engine's way now: a child process reads, checks and packs; this process
              copies the packed slot into the staging buffer and the bank (tensor copies)

Figures: the ticker's gaps while each way's loads run (p50, p99, max) beside its gaps with no
load; a load's median wall time, and the CPU time of the thread that loads (what the engine
process does per load: an upper bound of the GIL it holds). A wait for the GIL shows as gaps
well over the tick; on a machine with few free cores the child's own CPU use shows there too.

    python -m bench.adapter_load_gil --preset moondream2 --rank 32 --loads 4

Prints a table; writes ``adapter_load_gil.json`` under ``--out`` (default bench/results/cpu/).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.lora_bench import percentile
from vlm_server.engine.adapter_reader import AdapterReader
from vlm_server.engine.adapters import _SHORT_GIL_SWITCH
from vlm_server.models.lora import files
from vlm_server.models.lora.bank import LoraBank
from vlm_server.models.lora.spec import LoraTargets
from vlm_server.models.lora.writer import write_random
from vlm_server.models.registry import preset


class Ticker:
    """A thread that sleeps ``tick_s`` in a loop, recording when it wakes."""

    def __init__(self, tick_s: float) -> None:
        self.tick_s = tick_s
        self.wakes: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ticker", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            time.sleep(self.tick_s)
            self.wakes.append(time.perf_counter())

    def __enter__(self) -> Ticker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def gaps_ms(self, start: float, end: float) -> list[float]:
        wakes = [t for t in self.wakes if start <= t <= end]
        return [(b - a) * 1e3 for a, b in itertools.pairwise(wakes)]


def decoder_targets(name: str) -> LoraTargets:
    """The preset's adapter targets, from a decoder built on the meta device (no weights)."""
    from vlm_server.models.registry import family_for_preset

    config = preset(name)
    family = family_for_preset(name)
    with torch.device("meta"):
        loaded = family.random_model(config, seed=0, dtype=torch.bfloat16, device="meta",
                                     progress=False)  # fmt: skip
    adapters = loaded.model.capabilities.adapters
    if adapters is None:
        raise SystemExit(f"{name}: the family takes no adapters")
    return adapters.lora_targets


def _summary(gaps: list[float], loads_ms: list[float], cpu_ms: list[float]) -> dict:
    return {
        "loader_cpu_ms": statistics.median(cpu_ms) if cpu_ms else float("nan"),
        "gap_p50_ms": percentile(gaps, 50),
        "gap_p99_ms": percentile(gaps, 99),
        "gap_max_ms": max(gaps, default=float("nan")),
        "ticks": len(gaps),
        "load_p50_ms": statistics.median(loads_ms) if loads_ms else float("nan"),
    }


def measure(
    ticker: Ticker, paths: list[Path], load: Callable[[Path], None]
) -> tuple[list[float], list[float], list[float]]:
    """The ticker's gaps while ``load`` runs over ``paths``; each load's wall time, and the
    loading thread's CPU time (an upper bound of the GIL it held: torch's copies release it)."""
    loads_ms, cpu_ms = [], []
    start = time.perf_counter()
    for path in paths:
        t, cpu = time.perf_counter(), time.thread_time()
        with _SHORT_GIL_SWITCH:
            load(path)
        cpu_ms.append((time.thread_time() - cpu) * 1e3)
        loads_ms.append((time.perf_counter() - t) * 1e3)
    return ticker.gaps_ms(start, time.perf_counter()), loads_ms, cpu_ms


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="moondream2")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--loads", type=int, default=4)
    ap.add_argument("--tick-ms", type=float, default=0.5)
    ap.add_argument("--idle-s", type=float, default=0.5)
    ap.add_argument("--out", type=Path, default=Path("bench/results/cpu"))
    args = ap.parse_args(argv)
    targets = decoder_targets(args.preset)
    bank = LoraBank(targets, 2, args.rank, torch.bfloat16, "cpu")
    reader = AdapterReader(children=1)
    results: dict = {"preset": args.preset, "settings": {k: str(v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory(prefix="adapter-gil-") as folder:
        paths = [
            write_random(Path(folder), f"a{i}", targets, args.rank, seed=i, dtype=torch.bfloat16)
            for i in range(args.loads + 1)
        ]

        def in_process(path: Path) -> None:
            weights = files.load(path, targets, args.rank, path.parent.name)
            bank.write(0, bank.staging(weights), weights.rank)

        def child(path: Path) -> None:
            read = reader.read(path, path.parent.name, bank.layout, bank.dtype)
            try:
                bank.write(0, bank.staging_from(read.packed), read.rank)
            finally:
                read.release()

        try:
            child(paths[-1])  # the child's start-up (its imports) is a one-off
            with Ticker(args.tick_ms / 1e3) as ticker:
                t0 = time.perf_counter()
                time.sleep(args.idle_s)
                results["idle"] = _summary(ticker.gaps_ms(t0, time.perf_counter()), [], [])
                for name, load in (("in-process", in_process), ("child", child)):
                    results[name] = _summary(*measure(ticker, paths[:-1], load))
        finally:
            reader.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "adapter_load_gil.json").write_text(json.dumps(results, indent=2))
    mib = bank.layout.numel * 2 / (1 << 20)
    print(f"\n{args.preset}, rank {args.rank} ({mib:.1f} MiB a slot), tick {args.tick_ms} ms")
    print(f"{'case':>11} {'gap p50':>8} {'gap p99':>8} {'gap max':>8} {'load ms':>8} {'cpu ms':>7}")
    for name in ("idle", "in-process", "child"):
        r = results[name]
        print(
            f"{name:>11} {r['gap_p50_ms']:>8.2f} {r['gap_p99_ms']:>8.2f} "
            f"{r['gap_max_ms']:>8.2f} {r['load_p50_ms']:>8.1f} {r['loader_cpu_ms']:>7.1f}"
        )
    return results


if __name__ == "__main__":
    main()
