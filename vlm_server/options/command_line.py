"""Flags and ``VLM_*`` variables -> a checked `ServerConfig`; ``--help`` in the table's groups.

Parsing only turns text into values; every check is `ServerConfig`'s (or the component's it
builds), whose errors name fields. On the command line an error names what the user wrote
instead: the flag, or the variable the value came from.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NoReturn

from vlm_server.options.spec import ENV_PREFIX, Group, Option
from vlm_server.options.table import OPTIONS, ServerConfig

# Options renamed to the name of the field they set. An old spelling is refused naming the
# new one: an old VLM_ variable would otherwise be ignored, and its default served silently.
RENAMED = {
    "queue_limit": "max_queue",
    "kv_budget": "kv_budget_bytes",
    "image_crop_graphs": "crop_graph_sizes",
}

_DESCRIPTION = "Serve a Moondream model over gRPC and HTTP."
_EPILOG = (
    "Every flag can also be set with an environment variable: --max-batch-size is "
    "VLM_MAX_BATCH_SIZE. Flags win over the environment. Sizes take suffixes (32MiB)."
)


def add_options(
    parser: argparse.ArgumentParser | Any, options: Iterable[Option], environment: bool = True
) -> None:
    """One argument per option on ``parser`` (or an argument group); unset flags are None.
    ``environment``: the help names each option's variable (off where none is read)."""
    for opt in options:
        where = f"{opt.env}; " if environment else ""
        text = f"{opt.help}{opt.choices_text} [{where}default {opt.shown_default}]"
        parser.add_argument(
            opt.flag,
            dest=opt.name,
            type=opt.parse,
            default=None,
            metavar=opt.name.upper(),
            help=text.replace("%", "%%"),  # argparse formats help with %
        )


def build_parser(prog: str = "vlm-server") -> argparse.ArgumentParser:
    """Flags for every option, in the table's groups."""
    parser = argparse.ArgumentParser(prog=prog, description=_DESCRIPTION, epilog=_EPILOG)
    for group in Group:
        section = parser.add_argument_group(group.title, group.description)
        add_options(section, (opt for opt in OPTIONS if opt.group is group))
    return parser


def config_from(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    environ: Mapping[str, str],
    options: Iterable[Option] = OPTIONS,
) -> ServerConfig:
    """The config of parsed flags, then ``environ``, then defaults; exits (argparse) on bad
    input, naming the flag or variable at fault."""
    values: dict[str, Any] = {}
    given: dict[str, str] = {}  # option -> what set it (a flag or a variable)
    for opt in options:
        value = getattr(args, opt.name)
        if value is not None:
            given[opt.name] = opt.flag
        elif opt.env in environ:
            raw = environ[opt.env]
            try:
                value = opt.parse(raw)
            except ValueError as err:
                parser.error(f"{opt.env}={raw!r}: {err}")
            given[opt.name] = opt.env
        if value is not None:
            values[opt.name] = value
    try:
        return ServerConfig(**values)
    except ValueError as err:
        parser.error(as_given(str(err), given))


def load_config(
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    prog: str = "vlm-server",
) -> ServerConfig:
    """Parse flags and environment into a checked config; exits (argparse) on bad input."""
    environ = os.environ if environ is None else environ
    parser = build_parser(prog)
    _refuse_renamed(parser, argv if argv is not None else [], environ)
    return config_from(parser, parser.parse_args(argv), environ)


_BY_LENGTH = sorted(OPTIONS, key=lambda o: -len(o.name))
_NAMES = re.compile(r"(?<![\w-])(" + "|".join(re.escape(o.name) for o in _BY_LENGTH) + r")\b")
_FLAGS = {opt.name: opt.flag for opt in OPTIONS}


def as_given(message: str, given: Mapping[str, str]) -> str:
    """``message`` with the fields it names spelled as the user set them (``--max-queue``,
    ``VLM_MAX_QUEUE``). One-word names are replaced only where they start the message:
    elsewhere "port" or "device" may be plain words."""

    def spell(match: re.Match[str]) -> str:
        name = match.group(1)
        if "_" not in name and match.start() != 0:
            return name
        return given.get(name, _FLAGS[name])

    return _NAMES.sub(spell, message)


def _refuse_renamed(
    parser: argparse.ArgumentParser, argv: Sequence[str], environ: Mapping[str, str]
) -> None:
    for old, new in RENAMED.items():
        old_flag, new_flag = "--" + old.replace("_", "-"), "--" + new.replace("_", "-")
        if any(arg == old_flag or arg.startswith(old_flag + "=") for arg in argv):
            _renamed(parser, old_flag, new_flag)
        if ENV_PREFIX + old.upper() in environ:
            _renamed(parser, ENV_PREFIX + old.upper(), ENV_PREFIX + new.upper())


def _renamed(parser: argparse.ArgumentParser, old: str, new: str) -> NoReturn:
    parser.error(f"{old} is now {new} (the name of the field it sets)")
