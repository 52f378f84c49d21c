"""Server configuration from command-line flags and ``VLM_*`` environment variables.

Precedence: flag, then environment variable, then default. Every option has both forms:
``--max-batch-size 16`` or ``VLM_MAX_BATCH_SIZE=16``. Sizes accept suffixes (``32MiB``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from image_pipeline import ImageLimits

MIB = 1 << 20
ENV_PREFIX = "VLM_"

_SIZE = re.compile(r"^\s*(\d+)\s*([kmg]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes from ``"1048576"``, ``"512KiB"``, ``"32MiB"``, ``"2G"`` (binary multiples)."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (e.g. 33554432, 32MiB)")
    unit = (match.group(2) or "").lower()[:1]
    return int(match.group(1)) * _UNITS[unit]


def _optional_str(text: str) -> str | None:
    return text or None


@dataclass(frozen=True)
class ServerConfig:
    """Everything the server process needs; see `OPTIONS` for the meaning of each field."""

    model: str | None = None
    preset: str | None = None
    tokenizer: str | None = None
    dtype: str | None = None
    device: str | None = None
    engine: str = "batched"
    host: str = "0.0.0.0"
    port: int = 50051
    http_port: int = 2020
    max_batch_size: int = 32
    max_step_tokens: int = 1024
    kv_budget: int = 0
    pipeline_depth: int = 2
    queue_limit: int = 256
    max_image_bytes: int = 32 * MIB
    max_image_pixels: int = 50_000_000
    max_image_side: int = 32_768
    image_cache_bytes: int = 512 * MIB
    max_message_bytes: int = 32 * MIB
    max_http_body_bytes: int = 32 * MIB
    metrics_host: str | None = None
    metrics_port: int = 9464
    grace_period: float = 30.0
    decode_threads: int = 4
    log_format: str = "kv"
    log_level: str = "info"

    def __post_init__(self) -> None:
        positive = (
            "max_batch_size",
            "max_step_tokens",
            "pipeline_depth",
            "queue_limit",
            "max_image_bytes",
            "max_image_pixels",
            "image_cache_bytes",
            "max_message_bytes",
            "max_http_body_bytes",
            "decode_threads",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("port", "metrics_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be in 0..65535 (0 = any free port)")
        if not -1 <= self.http_port <= 65535:
            raise ValueError("http_port must be in -1..65535 (0 = off, -1 = any free port)")
        if self.max_step_tokens <= self.max_batch_size:
            raise ValueError("max_step_tokens must exceed max_batch_size")
        if self.kv_budget < 0 or self.grace_period < 0 or self.max_image_side < 0:
            raise ValueError("kv_budget, grace_period and max_image_side must be >= 0")
        if self.log_format not in ("kv", "json"):
            raise ValueError("log_format must be kv or json")

    @property
    def image_limits(self) -> ImageLimits:
        return ImageLimits(
            max_bytes=self.max_image_bytes,
            max_pixels=self.max_image_pixels,
            max_side=self.max_image_side or None,
        )

    def items(self) -> list[tuple[str, Any]]:
        """(name, value) pairs in declaration order, for printing at start."""
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]


@dataclass(frozen=True)
class _Option:
    name: str
    parse: Callable[[str], Any]
    help: str
    choices: Sequence[str] | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


OPTIONS: tuple[_Option, ...] = (
    _Option(
        "model",
        _optional_str,
        "checkpoint directory, .safetensors file or Hugging Face "
        "repo id (default: the built-in random tiny model)",
    ),
    _Option("preset", _optional_str, "model configuration when the checkpoint carries none"),
    _Option("tokenizer", _optional_str, "tokenizer.json to use instead of the checkpoint's"),
    _Option(
        "dtype",
        _optional_str,
        "weights dtype (default bf16 on CUDA, fp32 on CPU)",
        ("bf16", "fp16", "fp32"),
    ),
    _Option("device", _optional_str, "cpu or cuda[:N] (default: cuda if present)"),
    _Option(
        "engine",
        str,
        "batched (continuous batching) or reference (the same engine at batch 1, blocking)",
    ),
    _Option("host", str, "address to listen on"),
    _Option("port", int, "gRPC port (0 = any free port)"),
    _Option(
        "http_port",
        int,
        "HTTP port of the Moondream and OpenAI-compatible API (0 = off, -1 = any free port)",
    ),
    _Option("max_batch_size", int, "most sequences decoded together (batched engine)"),
    _Option(
        "max_step_tokens",
        int,
        "tokens of one forward: decode rows plus prompt chunks (longer prompts are prefilled "
        "over several steps); above max_batch_size",
    ),
    _Option(
        "kv_budget",
        parse_size,
        "KV cache memory (0 = the engine's default: the "
        "batched engine takes 40%% of free GPU memory)",
    ),
    _Option("pipeline_depth", int, "steps in flight: 2 overlaps host work, 1 is blocking"),
    _Option("queue_limit", int, "requests waiting beyond this are refused (RESOURCE_EXHAUSTED)"),
    _Option("max_image_bytes", parse_size, "largest accepted encoded image"),
    _Option("max_image_pixels", int, "largest accepted width x height"),
    _Option("max_image_side", int, "largest accepted width or height (0 = no limit)"),
    _Option(
        "image_cache_bytes",
        parse_size,
        "memory for images uploaded with EncodeImage (least recently used go first)",
    ),
    _Option("max_message_bytes", parse_size, "largest gRPC message, request or response"),
    _Option("max_http_body_bytes", parse_size, "largest HTTP request body (413 beyond)"),
    _Option("metrics_host", _optional_str, "address of the Prometheus endpoint (default: host)"),
    _Option("metrics_port", int, "Prometheus endpoint port (0 = any free port)"),
    _Option("grace_period", float, "seconds to finish accepted requests after SIGTERM"),
    _Option("decode_threads", int, "threads decoding images"),
    _Option("log_format", str, "log line format", ("kv", "json")),
    _Option("log_level", str, "log level", ("debug", "info", "warning", "error")),
)


def build_parser(prog: str = "vlm-server") -> argparse.ArgumentParser:
    """Flags for every option; defaults come from the environment at parse time."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve a Moondream model over gRPC and HTTP.",
        epilog="Every flag can also be set with an environment variable: --max-batch-size is "
        "VLM_MAX_BATCH_SIZE. Flags win over the environment.",
    )
    defaults = ServerConfig()
    for opt in OPTIONS:
        default = getattr(defaults, opt.name)
        parser.add_argument(
            opt.flag,
            dest=opt.name,
            type=opt.parse,
            choices=opt.choices,
            default=None,
            metavar=opt.name.upper(),
            help=f"{opt.help} [{opt.env}; default {default}]",
        )
    return parser


def load_config(
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    prog: str = "vlm-server",
) -> ServerConfig:
    """Parse flags and environment into a validated config; exits (argparse) on bad input."""
    environ = os.environ if environ is None else environ
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    for opt in OPTIONS:
        value = getattr(args, opt.name)
        if value is None and opt.env in environ:
            raw = environ[opt.env]
            try:
                value = opt.parse(raw)
            except ValueError as err:
                parser.error(f"{opt.env}={raw!r}: {err}")
            if opt.choices and value not in opt.choices:
                parser.error(f"{opt.env}={raw!r}: choose one of {', '.join(opt.choices)}")
        if value is not None:
            values[opt.name] = value
    try:
        return ServerConfig(**values)
    except ValueError as err:
        parser.error(str(err))
        raise  # unreachable: parser.error exits
