"""What an option is: its group in ``--help``, how its text parses, its help; and the parsers.

An option is a field of `ServerConfig` declared with `option`, which keeps its group, help and
parser in the field's metadata. Its flag and environment variable are spelled from the field's
name (``max_batch_size``: ``--max-batch-size``, ``VLM_MAX_BATCH_SIZE``), so one name runs from
the command line to the component that uses the value.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vlm_server.chips import profile

ENV_PREFIX = "VLM_"
_SPEC = "option"

_SIZE = re.compile(r"^\s*(\d+)\s*([kmg]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes from ``"1048576"``, ``"512KiB"``, ``"32MiB"``, ``"2G"`` (binary multiples)."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (e.g. 33554432, 32MiB)")
    unit = (match.group(2) or "").lower()[:1]
    return int(match.group(1)) * _UNITS[unit]


def format_size(value: int) -> str:
    """The shortest exact spelling `parse_size` reads back: ``33554432`` -> ``"32MiB"``."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value and value % size == 0:
            return f"{value // size}{unit}"
    return str(value)


def parse_bool(text: str) -> bool:
    """``true``/``false`` (also ``1``/``0``, ``yes``/``no``, ``on``/``off``)."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r} (true or false)")


def parse_auto_switch(text: str) -> str:
    """``auto``, ``on`` or ``off`` (a boolean's words too: ``true`` is ``on``), as kept."""
    value = text.strip().lower()
    if value == "auto":
        return value
    try:
        return "on" if parse_bool(value) else "off"
    except ValueError:
        raise ValueError(f"not auto, on or off: {text!r}") from None


def parse_prefill_sms(text: str) -> str:
    """``auto``, or a count of SMs (0: no partition), as the text it is kept as."""
    value = text.strip().lower()
    if value == "auto":
        return value
    if not value.isdigit():
        raise ValueError(f"not auto or a count of SMs: {text!r}")
    return str(int(value))


def parse_auto_count(text: str) -> str:
    """``auto``, or a count (0 or more), as the text it is kept as."""
    value = text.strip().lower()
    if value == "auto":
        return value
    if not value.isdigit():
        raise ValueError(f"not auto or a count: {text!r}")
    return str(int(value))


def parse_chip_profile(text: str) -> str | None:
    """A chip of the table (`vlm_server.chips.profile`), or None for an empty text."""
    if not text:
        return None
    profile(text)  # raises naming the chips known
    return text


def parse_optional_str(text: str) -> str | None:
    """The text, or None for an empty one (an unset optional path)."""
    return text or None


def parse_key_list(text: str) -> tuple[str, ...]:
    """``"k1,k2"`` -> ``("k1", "k2")``; blanks dropped."""
    return tuple(k.strip() for k in text.split(",") if k.strip())


class Group(enum.Enum):
    """The sections of ``--help`` and docs/configuration.md, in their order."""

    MODEL = ("Model", "What is served, and where it runs.")
    SERVING = ("Serving", "Where the server listens, and how it stops.")
    LIMITS = (
        "Limits",
        "What one request may ask for. Beyond a limit a request is refused with an error that "
        "names the field at fault; GetModelInfo reports them.",
    )
    IMAGES = ("Image path", "How images are decoded, resized, cropped and kept.")
    PERFORMANCE = ("Performance", "Batching, memory, and where the engine and its work run.")
    SECURITY = ("Security", "TLS and API keys (both doors).")
    OBSERVABILITY = ("Observability", "Metrics and logs.")
    ADVANCED = (
        "Advanced",
        "Tuning knobs whose defaults were measured (docs/performance.md); each says what its "
        "default was measured to buy. Change them to reproduce or extend a measurement.",
    )

    def __init__(self, title: str, description: str) -> None:
        self.title = title
        self.description = description


@dataclass(frozen=True)
class _Spec:
    group: Group
    help: str
    parse: Callable[[str], Any] | None
    choices: tuple[str, ...] | None


def option(
    default: Any,
    group: Group,
    help: str,
    *,
    parse: Callable[[str], Any] | None = None,
    choices: Sequence[str] | None = None,
) -> Any:
    """A `ServerConfig` field that is also a flag and an environment variable.

    ``parse`` turns the flag's text into the value; by default it follows the default's type
    (bool, int, float, str; None: an optional string; a tuple: a comma-separated list)."""
    shown = tuple(str(c) for c in choices) if choices is not None else None  # StrEnum -> str
    spec = _Spec(group, help, parse, shown)
    return dataclasses.field(default=default, metadata={_SPEC: spec})


def _parser_for(default: Any) -> Callable[[str], Any]:
    if isinstance(default, bool):  # before int: bool is an int
        return parse_bool
    if default is None:
        return parse_optional_str
    if isinstance(default, tuple):
        return parse_key_list
    return type(default)


@dataclass(frozen=True)
class Option:
    """One row of the option table, read from a `ServerConfig` field."""

    name: str
    default: Any
    group: Group
    help: str
    parse: Callable[[str], Any]
    choices: tuple[str, ...] | None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def shown_default(self) -> str:
        """The default as one would type it (sizes as given in bytes, lists comma-separated)."""
        if isinstance(self.default, tuple):
            return ",".join(self.default) or "none"
        if isinstance(self.default, bool):
            return str(self.default).lower()
        if self.parse is parse_size:
            return format_size(self.default)
        return "none" if self.default is None else str(self.default)

    @property
    def choices_text(self) -> str:
        return f" (one of: {', '.join(self.choices)})" if self.choices else ""


def options_of(cls: type) -> tuple[Option, ...]:
    """The options of a dataclass whose fields were declared with `option`, in order."""
    out = []
    for f in dataclasses.fields(cls):
        spec: _Spec = f.metadata[_SPEC]
        parse = spec.parse or _parser_for(f.default)
        out.append(Option(f.name, f.default, spec.group, spec.help, parse, spec.choices))
    return tuple(out)
