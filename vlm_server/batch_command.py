"""``vlm batch``: bulk work without a server.

    vlm batch caption ./photos/ -o captions.jsonl [--length short]
    vlm batch query ./photos/ --question "..." -o answers.jsonl
    vlm batch detect ./photos/ --object car -o boxes.jsonl [--format coco|yolo]
    vlm batch requests.jsonl -o results.jsonl

The engine is built as ``vlm serve`` builds it (the same model, engine and image options, the
same service core), and every line runs through the HTTP door's own route for its url, with
no port bound. The results file (``-o``) is written a line at a time; a run stopped anyway
(Ctrl-C, SIGTERM, a kill) goes on where it stopped when run again with the same output.
docs/bulk.md describes it all.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from vlm_server.bulk.executor import LineRunner
from vlm_server.bulk.exports import answers, export_path, write_coco, write_yolo, yolo_clash
from vlm_server.bulk.folder import PICTURE_TYPES, FolderSource, list_pictures, picture_lines
from vlm_server.bulk.lines import succeeded
from vlm_server.bulk.progress_view import ProgressView, summary
from vlm_server.bulk.request_file import RequestSource, scan
from vlm_server.bulk.results import ResultLog, read_results
from vlm_server.bulk.runner import Item, Progress, run_batch
from vlm_server.chip_features import check_config
from vlm_server.devices import resolve_device
from vlm_server.frontend.metrics import ServiceMetrics
from vlm_server.options.command_line import add_options, config_from
from vlm_server.options.spec import Group, Option
from vlm_server.options.table import OPTIONS, ServerConfig
from vlm_server.server.engines import ENGINES, configure_process, engine_factory
from vlm_server.server.service import decode_executor, service_core

PROG = "vlm batch"
TASKS = {
    "caption": "/v1/caption",
    "query": "/v1/query",
    "point": "/v1/point",
    "detect": "/v1/detect",
    "segment": "/v1/segment",
}
FORMATS = {"point": ("jsonl", "coco"), "detect": ("jsonl", "coco", "yolo")}
OBJECT_TASKS = ("point", "detect", "segment")

EXIT_OK = 0  # every line has a result, and none is an error
EXIT_FAILED = 1  # some line failed or has no result (the engine stopped, or never started)
EXIT_USAGE = 2  # refused before running: a bad flag, input or results file
EXIT_INTERRUPTED = 130  # Ctrl-C or SIGTERM: run the same command again to go on

# A batch binds no port and takes no connection: the doors' options are left out.
_DOOR_GROUPS = (Group.SERVING, Group.SECURITY)
_DOOR_OPTIONS = {"max_message_bytes", "max_http_body_bytes", "metrics_host", "metrics_port"}
_KEPT = {"adapter_api_key"}  # in the security group, but the key of adapter downloads
_LOG_LEVEL = "warning"  # the progress line stands for the access log's line a request
_PLAIN_PROGRESS_S = 10.0  # a progress line this often where stderr is not a terminal


def batch_options() -> list[Option]:
    """The options of ``vlm serve`` that a batch uses: model, engine, limits, images."""
    return [
        o
        for o in OPTIONS
        if (o.group not in _DOOR_GROUPS or o.name in _KEPT) and o.name not in _DOOR_OPTIONS
    ]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} {{{','.join(TASKS)}}} FOLDER -o OUT [flags]\n"
        f"       {PROG} REQUESTS.jsonl -o OUT [flags]",
        description="Run a task over every picture of a folder, or run a file of OpenAI "
        "batch request lines, on an engine of this process (no server). Results go to OUT a "
        "line at a time; run the same command again after a stop to go on (docs/bulk.md).",
        epilog="Model and engine flags are vlm serve's (VLM_* variables too); logs default "
        "to warnings here: the progress line stands for the access log. Exit codes: 0 every "
        "line has a result and none failed, 1 some failed (or the engine stopped), 2 refused "
        "before running, 130 interrupted.",
    )
    parser.add_argument(
        "source",
        nargs="+",
        metavar="TASK FOLDER | REQUESTS",
        help=f"a task ({', '.join(TASKS)}) and a folder of pictures, or a requests .jsonl",
    )
    parser.add_argument(
        "-o", "--output", type=Path, required=True, help="the results file (.jsonl)"
    )
    task = parser.add_argument_group("Folder tasks")
    task.add_argument("--question", help="query: the question asked of every picture")
    task.add_argument(
        "--object",
        action="append",
        default=[],
        help="point, detect, segment: what to find; repeat it for several (a line per "
        "picture and object, custom_id PATH#OBJECT)",
    )
    task.add_argument("--length", choices=["short", "normal", "long"], help="caption length")
    task.add_argument(
        "--format",
        choices=["jsonl", "coco", "yolo"],
        default="jsonl",
        help="also write a dataset from the results: coco (detect, point) to OUT.coco.json, "
        "yolo (detect) to the folder OUT.yolo/ (OUT without its .jsonl)",
    )
    sampling = parser.add_argument_group("Sampling (the body's settings; unset: the defaults)")
    sampling.add_argument("--temperature", type=float)
    sampling.add_argument("--top-p", type=float)
    sampling.add_argument("--max-tokens", type=int)
    sampling.add_argument("--max-objects", type=int)
    sampling.add_argument("--seed", type=int)
    run = parser.add_argument_group("Running")
    run.add_argument(
        "--concurrency",
        type=int,
        help="lines in flight at once (default: twice --max-batch-size, at most --max-queue)",
    )
    for group in Group:
        options = [o for o in batch_options() if o.group is group]
        if options:
            add_options(parser.add_argument_group(group.title, group.description), options)
    return parser


class Source(Protocol):
    """The lines of a batch, in order (a folder's, or a requests file's)."""

    @property
    def ids(self) -> list[str]: ...

    def items(self, done: set[str], executor: Executor, ahead: int) -> AsyncIterator[Item]: ...

    def close(self) -> None: ...


@dataclass
class Plan:
    """What to run, from the command line."""

    source: Source
    output: Path
    concurrency: int
    task: str | None = None  # a folder's task; None: a requests file
    folder: Path | None = None
    objects: tuple[str, ...] = ()
    fmt: str = "jsonl"


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    given = {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "max_tokens": args.max_tokens,
        "max_objects": args.max_objects,
        "seed": args.seed,
    }
    return {k: v for k, v in given.items() if v is not None}


def _check_task_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, task: str) -> None:
    """Each folder task's own flags: given where it takes them, refused elsewhere."""
    if task == "query" and args.question is None:
        parser.error("--question: required by query")
    if task != "query" and args.question is not None:
        parser.error(f"--question: a flag of query, not {task}")
    if task in OBJECT_TASKS and not args.object:
        parser.error(f"--object: required by {task}")
    if task not in OBJECT_TASKS and args.object:
        parser.error(f"--object: a flag of {', '.join(OBJECT_TASKS)}, not {task}")
    if len(set(args.object)) != len(args.object):
        parser.error("--object: the same object twice")
    if args.length is not None and task != "caption":
        parser.error(f"--length: a flag of caption, not {task}")
    formats = FORMATS.get(task, ("jsonl",))
    if args.format not in formats:
        parser.error(f"--format {args.format}: {task} writes {' or '.join(formats)}")


def _plan(parser: argparse.ArgumentParser, args: argparse.Namespace, config: ServerConfig) -> Plan:
    """Check the command's own arguments (exits naming the flag) and list the lines; a
    folder or requests file that cannot run raises ValueError or OSError."""
    batch = 1 if config.engine == "reference" else config.max_batch_size
    concurrency = args.concurrency
    if concurrency is None:
        concurrency = min(2 * batch, config.max_queue)
    if concurrency < 1:
        parser.error(f"--concurrency: must be >= 1, got {args.concurrency}")
    first, *rest = args.source
    if first not in TASKS:
        if rest:
            parser.error(f"unknown task {first!r}: choose one of {', '.join(TASKS)}")
        own = (("question", args.question), ("object", args.object), ("length", args.length))
        task_flags = [name for name, value in own if value]
        settings = _settings(args)
        if task_flags or settings or args.format != "jsonl":
            named = [*task_flags, *settings, *(["format"] if args.format != "jsonl" else [])]
            parser.error(
                f"--{named[0].replace('_', '-')}: a requests file's lines carry their own "
                "bodies; it is a flag of the folder tasks"
            )
        path = Path(first)
        if args.output.exists() and args.output.samefile(path):
            parser.error("-o: the requests file itself; results go to a file of their own")
        return Plan(RequestSource(path, scan(path)), args.output, concurrency)
    task = first
    if len(rest) != 1:
        parser.error(f"{task} takes one folder of pictures: {PROG} {task} FOLDER -o OUT")
    _check_task_flags(parser, args, task)
    folder = Path(rest[0])
    pictures = list_pictures(folder)
    if not pictures:
        raise ValueError(f"{folder}: no pictures in it ({', '.join(PICTURE_TYPES)})")
    if args.format == "yolo" and (clash := yolo_clash(pictures)) is not None:
        raise ValueError(f"{clash[0]} and {clash[1]} would share one YOLO label file")
    fields: dict[str, Any] = {}
    if args.length is not None:
        fields["length"] = args.length
    if args.question is not None:
        fields["question"] = args.question
    if settings := _settings(args):
        fields["settings"] = settings
    lines = picture_lines(pictures, args.object)
    source = FolderSource(folder, lines, TASKS[task], fields, config.max_image_bytes)
    objects = tuple(args.object)
    return Plan(source, args.output, concurrency, task, folder, objects, args.format)


@dataclass
class Outcome:
    """How a run ended."""

    progress: Progress
    signalled: bool  # stopped by SIGINT or SIGTERM
    engine_failure: str | None = None  # the engine stopped serving mid-run


async def _run(config: ServerConfig, plan: Plan, log: ResultLog, view: ProgressView) -> Outcome:
    """Build the engine as ``vlm serve`` does, run the lines not in ``log``, stop it."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        stop.set()
        loop.remove_signal_handler(sig)  # a second one ends the process at once

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    total, skipped = len(plan.source.ids), len(log.done & set(plan.source.ids))
    decoders = decode_executor(config)
    readers = ThreadPoolExecutor(min(4, plan.concurrency), thread_name_prefix="batch-read")
    core = service_core(config, decoders, ServiceMetrics())
    try:
        # Off the loop: an in-process engine loads the model in its factory.
        engine = await asyncio.to_thread(engine_factory(config))
        await engine.start()  # one that fails to start has nothing to close (as vlm serve)
        try:
            progress = Progress(total=total, skipped=skipped)  # timed from here
            if stop.is_set():  # a signal while the model loaded
                progress.interrupted = True
                return Outcome(progress, signalled=True)
            core.engine = engine
            items = plan.source.items(log.done, readers, plan.concurrency)
            async with contextlib.aclosing(items):
                progress = await run_batch(
                    items,
                    LineRunner(core, priority=None),  # no interactive traffic to yield to
                    log,
                    plan.concurrency,
                    progress,
                    view.update,
                    stop,
                )
            return Outcome(progress, stop.is_set(), None if stop.is_set() else engine.failure())
        finally:
            await engine.close()
    finally:
        readers.shutdown(wait=False, cancel_futures=True)
        decoders.shutdown(wait=False, cancel_futures=True)


def _finish(plan: Plan, config: ServerConfig, outcome: Outcome, view: ProgressView) -> int:
    """Summary, dataset files, exit code."""
    p = outcome.progress
    view.end(summary(p))
    if outcome.signalled:
        view.end(f"interrupted: run the same command again to go on (results: {plan.output})")
        return EXIT_INTERRUPTED
    results = {r["custom_id"]: r for r in read_results(plan.output)}
    ids = plan.source.ids
    missing = sum(1 for i in ids if i not in results)
    errors = sum(1 for i in ids if i in results and not succeeded(results[i]))
    if missing:
        reason = outcome.engine_failure or "the engine stopped"
        view.end(f"{missing} lines have no result ({reason}): run the same command again")
        return EXIT_FAILED
    if plan.fmt != "jsonl":
        assert isinstance(plan.source, FolderSource) and plan.task is not None
        assert plan.folder is not None
        found = answers(plan.source.lines, results)
        where = export_path(plan.output, plan.fmt)
        try:
            if plan.fmt == "coco":
                limits = config.image_limits
                n = write_coco(where, plan.folder, found, plan.objects, plan.task, limits)
            else:
                n = write_yolo(where, found, plan.objects)
        except OSError as err:
            view.end(f"error: cannot write the {plan.fmt} files: {_reason(err)}")
            return EXIT_FAILED
        view.end(f"{plan.fmt}: {n} pictures in {where}")
    if errors:
        view.end(f"{errors} of {len(ids)} results are errors (see {plan.output})")
        return EXIT_FAILED
    return EXIT_OK


def _reason(err: Exception) -> str:
    """An error as one line: a file's error names the file first."""
    if isinstance(err, OSError) and err.filename is not None:
        return f"{err.filename}: {err.strerror or err}"
    return str(err)


def main(argv: Sequence[str] | None = None) -> int:
    """``vlm batch``; ``argv`` as for argparse (None: sys.argv[2:])."""
    parser = _parser()
    args = parser.parse_args(sys.argv[2:] if argv is None else argv)
    environ = os.environ
    if args.log_level is None and "VLM_LOG_LEVEL" not in environ:
        args.log_level = _LOG_LEVEL
    config = config_from(parser, args, environ, batch_options())
    if config.engine not in ENGINES:
        parser.error(f"--engine: unknown engine {config.engine!r}")
    try:
        resolve_device(config.device)
        check_config(config)  # chip-gated flags: one line naming the flag
        plan = _plan(parser, args, config)
    except (ValueError, OSError) as err:
        print(f"{PROG}: error: {_reason(err)}", file=sys.stderr)
        return EXIT_USAGE
    configure_process(config)
    log = ResultLog(plan.output)
    try:
        try:
            log.open()
        except (ValueError, OSError) as err:
            print(f"{PROG}: error: {_reason(err)}", file=sys.stderr)
            return EXIT_USAGE
        view = ProgressView(sys.stderr, sys.stderr.isatty(), _PLAIN_PROGRESS_S, f"{PROG}: ")
        try:
            outcome = asyncio.run(_run(config, plan, log, view))
        except (ValueError, OSError, RuntimeError) as err:  # the model or engine cannot start
            print(f"{PROG}: error: the engine did not start: {_reason(err)}", file=sys.stderr)
            return EXIT_FAILED
        finally:
            log.close()
        return _finish(plan, config, outcome, view)
    except KeyboardInterrupt:  # a second Ctrl-C: what is written stays written
        return EXIT_INTERRUPTED
    finally:
        plan.source.close()
