"""Host time of one scheduler tick, split into commit / finalize / launch, with no model work.

Runs the real `Scheduler` over the real `ModelRuntime` (tiny preset, CPU) on a scripted device:
every copy, event and kernel is a no-op, and each step's sampling is replaced by writing
fixed outputs (a word token, the coord token at an object boundary, constant region values)
into the slot's host buffer. What is left is the Python and numpy the scheduler thread runs
per step, the time that competes with a GPU decode step (~2-3.5 ms at 64 rows) and with the
event loop for the GIL.

Scenarios, each at every row count (all rows running, steady state, then ``--ticks`` measured):
  text         free text queries, sampled (temperature 0.5, top_p 0.3)
  constrained  regex queries: a mask row per step from the constraint's automaton
  region       detect: boundary token, x, y, size per object, greedy
  churn        short text queries (8 tokens) arriving as others finish: mixed steps with
               prompt chunks, admissions and completions in most ticks
  segment      Moondream 3's segment (tiny preset): the box, then SVG path tokens under the
               path grammar's masks; a new request as each one finishes, final events included

    python -m bench.host_tick --rows 1 8 32 64 --ticks 400

Prints a table of median microseconds per tick (best of ``--repeat`` runs), writes JSON and a
PNG plot (default bench/results/cpu_tiny/host_tick.json). The scripted sampling's own time is
subtracted from finalize.

``--events`` says where the events (text deltas, results) go:
  list       appended to a list: the scheduler alone
  batched    to asyncio queues drained by a task on an event loop in another thread, through
             the engine's `EventOutbox` (one thread-safe call per tick), as a server does
  per-event  the same loop, one ``loop.call_soon_threadsafe`` per event (what the engine did
             before it batched them)
Tick totals include the flush at the end of the tick; the split does not.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from decoding.detokenize import StreamDetokenizer
from decoding.grammars import TextGrammar
from decoding.mask_table import NO_MASK, MaskTable
from image_pipeline import prepare_image, sample_image_bytes
from vlm_server.engine.api import GenerationRequest, Task
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.observer import Observer
from vlm_server.engine.core.scheduler import Scheduler
from vlm_server.engine.core.sequence import SeqState, Sequence
from vlm_server.engine.core.step_layout import F_MASK, F_PHASE, RowPhase
from vlm_server.engine.device.runtime import ModelRuntime
from vlm_server.engine.device.streams import CpuEvent
from vlm_server.engine.requests.tasks import TaskCompiler
from vlm_server.models.interface import LoadedModel
from vlm_server.models.registry import preset, random_model

try:
    from vlm_server.engine.core.outputs import output_for
except ImportError:  # an older tree (--baseline): a sequence held its detokenizer
    output_for = None  # type: ignore[assignment]

SCENARIOS = ("text", "constrained", "region", "churn", "segment")
# The preset each scenario runs on: segment needs a family with a path grammar.
PRESET_OF = {"segment": "md3-tiny"}
EVENTS = ("list", "batched", "per-event")
WORD = 300  # a plain word of the tiny vocabulary


class ScriptedDevice:
    """The runtime's device surface with no device: copies, events and kernels do nothing,
    except that a step's sampling writes scripted outputs into the slot's host buffer."""

    is_cuda = False
    compute_stream = None
    copy_stream = None
    prefill_stream = None
    partitioned_prefill_stream = None
    prefill_capture_stream = None
    interactive_prefill_stream = None

    def __init__(self, table: MaskTable, eos_id: int, coord_id: int) -> None:
        self.table = table
        self.eos_id = eos_id
        self.coord_id = coord_id
        self.scripted_s = 0.0  # time spent scripting outputs (not the scheduler's)
        self._host: dict[str, torch.Tensor] = {}
        self._rows: dict[int, int] = {}  # tensor id -> rows of its last host write
        self._token_for_row: dict[int, int] = {}

    def event(self, name: str, blocking: bool = False) -> CpuEvent:
        return CpuEvent()

    def host_buffer(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, slot: int | None = None
    ) -> torch.Tensor:
        self._host[name] = torch.zeros(shape, dtype=dtype)
        return self._host[name]

    def buffer(
        self, name: str, tensor: torch.Tensor, slot: int | None = None, early_read: str = "order"
    ) -> torch.Tensor:
        return tensor

    def kernel(self, stream: object, name: str, fn: Callable[[], None], access: object) -> None:
        if name.startswith("sample slot"):
            t0 = time.perf_counter()
            self._script(int(name.removeprefix("sample slot")))
            self.scripted_s += time.perf_counter() - t0

    def copy(self, stream: object, name: str, fn: Callable[[], None], access: object) -> None:
        pass

    def record(self, event: object, stream: object) -> None:
        pass

    def wait(self, stream: object, event: object) -> None:
        pass

    def host_write(self, buffer: torch.Tensor, values: np.ndarray, start: int = 0) -> None:
        buffer.numpy()[start : start + len(values)] = values
        self._rows[id(buffer)] = start + len(values)

    def host_read(self, buffer: torch.Tensor) -> np.ndarray:
        return buffer.numpy()

    def host_wait(self, event: object) -> None:
        pass

    def _script(self, slot: int) -> None:
        fin_host = self._host[f"slot{slot}.fin_host"]
        fin = fin_host.numpy()[: self._rows[id(fin_host)]]
        out = self._host[f"slot{slot}.out_host"].numpy()
        token = np.array([self._token(int(m)) for m in fin[:, F_MASK]], np.float32)
        boundary = fin[:, F_PHASE] == RowPhase.BOUNDARY
        out[: len(fin), 0] = np.where(boundary, self.coord_id, token)
        out[: len(fin), 1] = 0.5
        out[: len(fin), 2:4] = 0.1

    def _token(self, mask: int) -> int:
        """A token the row's mask allows: the plain word if it can, else the first non-eos."""
        if mask == NO_MASK:
            return WORD
        if mask not in self._token_for_row:
            allowed = self.table.allowed(mask)
            allowed[self.eos_id] = False
            self._token_for_row[mask] = WORD if allowed[WORD] else int(np.argmax(allowed))
        return self._token_for_row[mask]


class TickTimes(Observer):
    """Host seconds per tick (commit, finalize less the scripted sampling, launch)."""

    def __init__(self, device: ScriptedDevice) -> None:
        self.device = device
        self.ticks: list[tuple[float, float, float]] = []
        self.recording = False
        self._scripted = 0.0

    def tick(self, commit_s: float, finalize_s: float, launch_s: float) -> None:
        scripted, self._scripted = self.device.scripted_s - self._scripted, self.device.scripted_s
        if self.recording:
            self.ticks.append((commit_s, finalize_s - scripted, launch_s))


def _request(scenario: str, i: int, image: object) -> GenerationRequest:
    if scenario in ("segment", "region"):
        # A segment's path tokens about a real answer's (each request ends within a run).
        task, limit = (
            (Task.SEGMENT, {"max_tokens": 128})
            if scenario == "segment"
            else (Task.DETECT, {"max_objects": 400})
        )
        return GenerationRequest(
            task,
            image,  # type: ignore[arg-type]
            request_id=str(i),
            object_name="car",
            seed=i,
            **limit,  # type: ignore[arg-type]
        )
    regex = "[a-z ]+" if scenario == "constrained" else None
    max_tokens = 8 if scenario == "churn" else 1900
    return GenerationRequest(
        Task.QUERY,
        None,
        request_id=str(i),
        question=f"what is item {i}?",
        max_tokens=max_tokens,
        temperature=0.5,
        top_p=0.3,
        seed=i,
        regex=regex,
    )


class LoopThread:
    """An event loop in its own thread with one task draining a queue, standing in for a
    server's request streams."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.queue: asyncio.Queue[object] = asyncio.Queue()
        self.received = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._drain())

    async def _drain(self) -> None:
        while await self.queue.get() is not None:
            self.received += 1

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)
        self._thread.join()
        self.loop.close()


def _emitter(
    events: str, sink: list[object]
) -> tuple[Callable[[object], None], dict[str, object], LoopThread | None]:
    """Where the scheduler's events go (``--events``): the emit function, the scheduler's
    extra arguments, and the loop thread to close (None: appended to ``sink``)."""
    if events == "list":
        return sink.append, {}, None
    loop_thread = LoopThread()
    loop, put = loop_thread.loop, loop_thread.queue.put_nowait
    if events == "per-event":

        def emit(event: object) -> None:
            loop.call_soon_threadsafe(put, event)

        return emit, {}, loop_thread
    from vlm_server.server.in_process import EventOutbox

    outbox = EventOutbox()

    def push(event: object) -> None:
        outbox.push(loop, put, event)

    return push, {"flush_events": outbox.flush}, loop_thread


def _sequence(tasks: TaskCompiler, req: GenerationRequest) -> Sequence:
    """``req``'s sequence, as the engine builds it."""
    built = tasks.build(req)
    seq = Sequence(req, built.prompt, built.grammar, built.prefix_len, on_release=built.release)
    if output_for is not None:
        seq.output = output_for(built.grammar, tasks.vocab)
    elif isinstance(built.grammar, TextGrammar):
        seq.detok = StreamDetokenizer(tasks.vocab)  # type: ignore[attr-defined]
    return seq


def run_case(
    loaded: LoadedModel, scenario: str, rows: int, ticks: int, image: object, events: str = "list"
) -> dict[str, float | int | str]:
    # ~120 pages of 16 KiB per row (tiny model, ~1900 positions); zeroed pools cost time.
    cfg = EngineConfig(
        max_batch_size=rows, kv_budget_bytes=(16 + 3 * rows) << 20, cuda_graphs=False
    )
    mc = loaded.config
    contract = mc.tokens
    assert contract.coord_id is not None
    tasks = TaskCompiler(mc, loaded.tokenizer, cfg.mask_table_rows, cfg.constraint_limits)
    device = ScriptedDevice(tasks.table, contract.eos_id, contract.coord_id)
    rt = ModelRuntime(loaded.model, cfg, tasks.table, device=device)  # type: ignore[arg-type]
    obs = TickTimes(device)
    sink: list[object] = []
    emit, extra, loop_thread = _emitter(events, sink)
    if extra and "flush_events" not in inspect.signature(Scheduler).parameters:
        raise SystemExit("this tree's scheduler does not batch events: use --events list")
    sched = Scheduler(rt, cfg, contract.eos_id, mc.image_prefix_len, observer=obs, **extra)
    made = 0

    def submit() -> None:
        nonlocal made
        req = _request(scenario, made, image)
        made += 1
        seq = _sequence(tasks, req)
        seq.emit = emit
        sched.waiting.append(seq)

    refill = {"churn": rows + 2, "segment": rows}.get(scenario)  # kept submitted, if any

    def top_up() -> None:
        while refill is not None and len(sched.running) + len(sched.waiting) < refill:
            submit()

    for _ in range(rows):
        submit()
    warm = 0
    while warm < 20 or any(s.state is not SeqState.RUNNING for s in sched.running):
        sched.tick()
        warm += 1
        top_up()
        if warm > 10_000:
            raise RuntimeError(f"{scenario} at {rows} rows never reached steady state")
        if refill is not None and warm >= 50:
            break
    totals: list[float] = []
    gc.collect()
    obs.recording = True
    for _ in range(ticks):
        top_up()
        t0 = time.perf_counter()
        sched.tick()
        totals.append(time.perf_counter() - t0)
        sink.clear()
    obs.recording = False
    if loop_thread is not None:
        loop_thread.close()
    if refill is None and len(sched.running) != rows:
        raise RuntimeError(f"{scenario}: rows finished during the measured ticks")
    commit, finalize, launch = zip(*obs.ticks, strict=True)

    def us(xs: tuple[float, ...] | list[float]) -> float:
        return statistics.median(xs) * 1e6

    return {
        "scenario": scenario,
        "events": events,
        "rows": rows,
        "ticks": ticks,
        "commit_us": us(commit),
        "finalize_us": us(finalize),
        "launch_us": us(launch),
        "tick_us": us(totals),
        "tick_mean_us": statistics.fmean(totals) * 1e6,
        "tick_p99_us": float(np.percentile(totals, 99)) * 1e6,
        "completed": made - len(sched.running) - len(sched.waiting),
    }


ROOT = Path(__file__).resolve().parents[1]


def _model(models: dict[str, LoadedModel], scenario: str) -> LoadedModel:
    """The random model of ``scenario``'s preset (`PRESET_OF`, else tiny), made once."""
    name = PRESET_OF.get(scenario, "tiny")
    if name not in models:
        models[name] = random_model(preset(name), seed=0, dtype=torch.float32, progress=False)
    return models[name]


class Worker:
    """This script in a subprocess that imports the engine from ``root`` (a checkout), so two
    trees can be measured case by case, alternately, on the same machine in the same run."""

    def __init__(self, root: Path) -> None:
        env = dict(os.environ, PYTHONPATH=str(root))
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=root,
        )
        if self._line() != "ready":
            raise RuntimeError(f"the worker for {root} did not start")

    def _line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def run(self, scenario: str, rows: int, ticks: int, events: str) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{scenario} {rows} {ticks} {events}\n")
        self.proc.stdin.flush()
        return json.loads(self._line())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


def _serve_cases() -> None:
    """The worker's loop: one ``scenario rows ticks events`` line in, one JSON row out."""
    torch.set_num_threads(1)
    models: dict[str, LoadedModel] = {}
    image = prepare_image(sample_image_bytes())
    print("ready", flush=True)
    for line in sys.stdin:
        scenario, rows, ticks, events = line.split()
        loaded = _model(models, scenario)
        print(json.dumps(run_case(loaded, scenario, int(rows), int(ticks), image, events)))
        sys.stdout.flush()


def compare(args: argparse.Namespace) -> list[dict]:
    """Every case on ``args.baseline`` and on this tree, alternating (ABBA) ``args.repeat``
    times; the best run of each side is kept."""
    sides = {"before": Worker(args.baseline), "after": Worker(ROOT)}
    results = []
    try:
        for scenario in args.scenarios:
            for rows in args.rows:
                best: dict[str, dict] = {}
                for i in range(args.repeat):
                    for side in ("before", "after") if i % 2 == 0 else ("after", "before"):
                        row = sides[side].run(scenario, rows, args.ticks, args.events)
                        if side not in best or row["tick_us"] < best[side]["tick_us"]:
                            best[side] = row
                row = {**best["after"], "before": best["before"], "repeats": args.repeat}
                row["ratio"] = row["tick_us"] / best["before"]["tick_us"]
                results.append(row)
                print(
                    f"  {scenario:<12} {rows:>3} rows: {best['before']['tick_us']:8.1f} -> "
                    f"{row['tick_us']:8.1f} us/tick ({row['ratio']:.2f}x)",
                    flush=True,
                )
    finally:
        for worker in sides.values():
            worker.close()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--ticks", type=int, default=400)
    ap.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="runs per case; the one with the lowest median "
        "tick is kept (other processes on the machine only ever add time)",
    )
    ap.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    ap.add_argument("--events", choices=EVENTS, default="list", help="see the module doc")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--label", default="", help="suffix of the output files (host_tick_LABEL)")
    ap.add_argument(
        "--baseline",
        type=Path,
        help="another checkout of the project (e.g. `git worktree add /tmp/base BASE`): run "
        "every case there and here, alternately, and report both and their ratio",
    )
    ap.add_argument(
        "--baseline-name", help="what the JSON calls the baseline (default: its folder's name)"
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _serve_cases()
        return 0
    if args.baseline is not None:
        return _report_comparison(args, compare(args))
    torch.set_num_threads(1)
    models: dict[str, LoadedModel] = {}
    image = prepare_image(sample_image_bytes())
    results = []
    for scenario in args.scenarios:
        loaded = _model(models, scenario)
        for rows in args.rows:
            t0 = time.perf_counter()
            runs = [
                run_case(loaded, scenario, rows, args.ticks, image, args.events)
                for _ in range(args.repeat)
            ]
            row = min(runs, key=lambda r: r["tick_us"])
            row["repeats"] = args.repeat
            results.append(row)
            print(
                f"  {scenario:<12} {rows:>3} rows: {row['tick_us']:8.1f} us/tick "
                f"({time.perf_counter() - t0:.1f} s)",
                flush=True,
            )
    _report(args, results)
    return 0


def _report(args: argparse.Namespace, results: list[dict]) -> None:
    name = platform.processor() or platform.machine() or "cpu"
    out = args.out or Path("bench/results") / "cpu_tiny"
    out.mkdir(parents=True, exist_ok=True)
    stem = f"host_tick_{args.label}" if args.label else "host_tick"
    (out / f"{stem}.json").write_text(
        json.dumps(
            {
                "machine": name,
                "python": platform.python_version(),
                "events": args.events,
                "rows": results,
            },
            indent=2,
        )
    )
    print(
        f"\nhost us per tick (median of {args.ticks} ticks, best of {args.repeat}), "
        f"events: {args.events}, {name}"
    )
    print(
        f"{'scenario':<12} {'rows':>4} {'commit':>8} {'finalize':>8} {'launch':>8} "
        f"{'tick':>8} {'mean':>8} {'p99':>8}"
    )
    for r in results:
        print(
            f"{r['scenario']:<12} {r['rows']:>4} {r['commit_us']:>8.1f} {r['finalize_us']:>8.1f} "
            f"{r['launch_us']:>8.1f} {r['tick_us']:>8.1f} {r['tick_mean_us']:>8.1f} "
            f"{r.get('tick_p99_us', float('nan')):>8.1f}"
        )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for scenario in args.scenarios:
            pts = [(r["rows"], r["tick_us"]) for r in results if r["scenario"] == scenario]
            ax.plot(*zip(*pts, strict=True), marker="o", label=scenario)
        ax.set_xlabel("running rows")
        ax.set_ylabel("host us per tick (median)")
        ax.set_title("scheduler host time, no model work")
        ax.legend()
        fig.savefig(out / f"{stem}.png", dpi=120, bbox_inches="tight")
    except ImportError:
        pass


def _report_comparison(args: argparse.Namespace, results: list[dict]) -> int:
    name = platform.processor() or platform.machine() or "cpu"
    out = args.out or Path("bench/results") / "cpu_tiny"
    out.mkdir(parents=True, exist_ok=True)
    stem = f"host_tick_{args.label}" if args.label else "host_tick_compare"
    meta = {"machine": name, "python": platform.python_version(), "events": args.events}
    meta["baseline"] = args.baseline_name or args.baseline.name
    (out / f"{stem}.json").write_text(json.dumps({**meta, "rows": results}, indent=2))
    print(
        f"\nhost us per tick, before ({args.baseline}) -> after (this tree): median of "
        f"{args.ticks} ticks, best of {args.repeat} alternating runs, events: {args.events}, {name}"
    )
    print(
        f"{'scenario':<12} {'rows':>4} {'commit':>15} {'finalize':>15} {'launch':>15} "
        f"{'tick':>15} {'ratio':>6}"
    )
    for r in results:
        b = r["before"]
        cells = " ".join(
            f"{b[k]:>7.1f}>{r[k]:<7.1f}" for k in ("commit_us", "finalize_us", "launch_us")
        )
        print(
            f"{r['scenario']:<12} {r['rows']:>4} {cells} {b['tick_us']:>7.1f}>{r['tick_us']:<7.1f} "
            f"{r['ratio']:>6.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
