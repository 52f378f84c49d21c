"""``vlm compare``: two models' answers over a folder of pictures, side by side.

    vlm compare --model A --model B ./photos/ [--tasks caption,query,detect,point] [--json]

Each model runs in this process in turn, on an engine built as ``vlm serve`` builds it (the
same engine and image flags, given once for both; `batch_command` runs the lines), and the
answers are scored per task (compare_scores.py): the share of identical answers, the mean box
IoU and the mean point distance. The way to check a quantized model against its 16-bit
checkpoint on one's own pictures (docs/quantization.md). Exit status 0, 1 when a model failed
on some picture, 2 on bad input."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vlm_server.batch_command import TASKS, Plan, ProgressView, _reason, batch_options
from vlm_server.batch_command import _run as run_lines
from vlm_server.bulk.folder import FolderSource, list_pictures, picture_lines
from vlm_server.bulk.lines import succeeded
from vlm_server.bulk.results import ResultLog, read_results
from vlm_server.compare_scores import ANSWER_KEYS, TaskScore, score_task
from vlm_server.options.command_line import add_options, config_from
from vlm_server.options.spec import Group
from vlm_server.options.table import ServerConfig
from vlm_server.server.engines import configure_process

PROG = "vlm compare"
COMPARED = tuple(ANSWER_KEYS)
_MODEL_FLAGS = {"model"}  # given twice here, as --model A --model B


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a folder of pictures")
    parser.add_argument(
        "--model", action="append", default=[], required=True, help="a model, twice: A then B"
    )
    parser.add_argument(
        "--tasks",
        default=",".join(COMPARED),
        help=f"the tasks compared, comma-separated (of {', '.join(COMPARED)}) [default: all]",
    )
    parser.add_argument("--question", default="What is in this picture?", help="query's question")
    parser.add_argument("--object", default="person", help="detect's and point's object")
    parser.add_argument(
        "--max-tokens", type=int, help="each answer's token budget [default: the task's]"
    )
    parser.add_argument("--json", action="store_true", help="print the scores as JSON")
    options = [o for o in batch_options() if o.name not in _MODEL_FLAGS]
    for group in Group:
        chosen = [o for o in options if o.group is group]
        if chosen:
            add_options(parser.add_argument_group(group.title, group.description), chosen)
    return parser


def _tasks(text: str) -> list[str]:
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in COMPARED]
    if unknown or not tasks:
        named = ", ".join(unknown) or repr(text)
        raise ValueError(f"--tasks: {named} not of {', '.join(COMPARED)}")
    return tasks


def _fields(task: str, args: argparse.Namespace) -> tuple[dict[str, Any], tuple[str, ...]]:
    """A task's body members and its object, as ``vlm batch`` sends them (greedy answers)."""
    settings: dict[str, Any] = {"temperature": 0.0}
    if args.max_tokens is not None:
        settings["max_tokens"] = args.max_tokens
    fields: dict[str, Any] = {"settings": settings}
    if task == "query":
        fields["question"] = args.question
    objects = (args.object,) if task in ("detect", "point") else ()
    return fields, objects


async def answers(
    config: ServerConfig,
    folder: Path,
    pictures: list[str],
    tasks: Sequence[str],
    args: argparse.Namespace,
    scratch: Path,
) -> dict[str, dict[str, dict[str, Any]]]:
    """``config``'s model's answers: task -> picture -> the answer's body (failed: absent).
    One engine per task (each run is `vlm batch`'s, its results in ``scratch``)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    view = ProgressView(sys.stderr, False, 1e9, f"{PROG}: ")
    for task in tasks:
        fields, objects = _fields(task, args)
        lines = picture_lines(pictures, objects)
        source = FolderSource(folder, lines, TASKS[task], fields, config.max_image_bytes)
        path = scratch / f"{task}.jsonl"
        plan = Plan(source, path, max(1, 2 * config.max_batch_size), task, folder, objects)
        log = ResultLog(path)
        log.open()
        try:
            await run_lines(config, plan, log, view)
        finally:
            log.close()
            source.close()
        results = {r["custom_id"]: r for r in read_results(path)}
        out[task] = {
            line.picture: results[line.custom_id]["response"]["body"]
            for line in lines
            if line.custom_id in results and succeeded(results[line.custom_id])
        }
    return out


def compare(
    configs: Sequence[ServerConfig], folder: Path, tasks: Sequence[str], args: argparse.Namespace
) -> list[TaskScore]:
    """Both models' answers, scored per task."""
    pictures = list_pictures(folder)
    if not pictures:
        raise ValueError(f"{folder}: no pictures in it")
    found = []
    with tempfile.TemporaryDirectory(prefix="vlm-compare-") as tmp:
        for i, config in enumerate(configs):
            scratch = Path(tmp) / str(i)
            scratch.mkdir()
            found.append(asyncio.run(answers(config, folder, pictures, tasks, args, scratch)))
    a, b = found
    return [score_task(t, a[t], b[t], len(pictures)) for t in tasks]


def _lines(scores: Sequence[TaskScore], models: Sequence[str]) -> list[str]:
    out = [f"A: {models[0]}", f"B: {models[1]}"]
    for s in scores:
        line = f"{s.task:<8} {s.pictures} pictures, identical {100 * s.identical:.1f}%"
        if s.mean_iou is not None:
            line += f", mean box IoU {s.mean_iou:.3f}"
        if s.mean_point_distance is not None:
            line += f", mean point distance {s.mean_point_distance:.4f}"
        if s.task == "point":
            line += f", {s.unmatched_points} points unmatched"
        if s.failed:
            line += f", {s.failed} failed"
        out.append(line)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(sys.argv[2:] if argv is None else argv)
    if len(args.model) != 2:
        parser.error(f"--model: give two models (A and B), got {len(args.model)}")
    if args.log_level is None:
        args.log_level = "warning"
    options = [o for o in batch_options() if o.name not in _MODEL_FLAGS]
    base = config_from(parser, args, {}, options)
    try:
        tasks = _tasks(args.tasks)
        configs = [dataclasses.replace(base, model=m) for m in args.model]
    except ValueError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    configure_process(base)
    try:
        scores = compare(configs, args.folder, tasks, args)
    except (ValueError, OSError, RuntimeError) as err:
        print(f"{PROG}: error: {_reason(err)}", file=sys.stderr)
        return 2
    if args.json:
        out = {"models": args.model, "tasks": [dataclasses.asdict(s) for s in scores]}
        print(json.dumps(out, indent=2))
    else:
        print("\n".join(_lines(scores, args.model)))
    return 1 if any(s.failed for s in scores) else 0
