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

from image_pipeline import ImageLimits, ResizeMode
from image_pipeline.gpu_jpeg import GPU_DECODERS

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


def _key_list(text: str) -> tuple[str, ...]:
    """``"k1,k2"`` -> ``("k1", "k2")``; blanks dropped."""
    return tuple(k.strip() for k in text.split(",") if k.strip())


def parse_bool(text: str) -> bool:
    """``true``/``false`` (also ``1``/``0``, ``yes``/``no``, ``on``/``off``)."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r} (true or false)")


@dataclass(frozen=True)
class ServerConfig:
    """Everything the server process needs; see `OPTIONS` for the meaning of each field."""

    model: str | None = None
    preset: str | None = None
    tokenizer: str | None = None
    dtype: str | None = None
    device: str | None = None
    engine: str = "batched"
    engine_process: str = "auto"
    host: str = "0.0.0.0"
    port: int = 50051
    http_port: int = 2020
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    api_keys: tuple[str, ...] = ()
    api_keys_file: str | None = None
    max_batch_size: int = 32
    max_step_tokens: int = 4096
    kv_budget: int = 0
    pipeline_depth: int = 2
    queue_limit: int = 256
    max_image_bytes: int = 32 * MIB
    max_image_pixels: int = 50_000_000
    max_image_side: int = 32_768
    max_image_pixels_per_byte: int = 256
    image_free_pixels: int = 4 * MIB
    image_decode_budget: int = 1024 * MIB
    image_resize: str = "vips"
    image_device: str = "auto"
    image_reduced_decode: bool = True
    image_gpu_decode_min_pixels: int = 0
    image_gpu_decoder: str = "auto"
    image_cache_bytes: int = 512 * MIB
    image_cache_client_bytes: int = 128 * MIB
    max_message_bytes: int = 32 * MIB
    max_http_body_bytes: int = 32 * MIB
    max_object_chars: int = 256
    max_question_chars: int = 16_384
    # Client constraints (Query choices / regex): sizes and compile time (decoding/limits.py).
    max_choices: int = 1024
    max_choice_chars: int = 1024
    max_regex_chars: int = 1024
    max_constraint_states: int = 4096
    constraint_compile_seconds: float = 2.0
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9464
    grace_period: float = 30.0
    decode_threads: int = 4
    gil_switch_interval_ms: float = 5.0
    prefill_sm_carveout: int = 0
    prefill_sms: int = 0
    prefill_sms_when_streaming: int = 0
    prefill_batches: int = 2
    prefix_prompt_tokens: int = 64
    image_crop_graphs: int = 4
    vision_fp8: bool = False
    malloc_arena_max: int = 2
    malloc_mmap_threshold: int = MIB
    memory_trim_interval: float = 10.0
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
            "image_cache_client_bytes",
            "max_message_bytes",
            "max_http_body_bytes",
            "max_object_chars",
            "max_question_chars",
            "max_choices",
            "max_choice_chars",
            "max_regex_chars",
            "max_constraint_states",
            "decode_threads",
            "image_decode_budget",
            "prefill_batches",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prefill_sms_when_streaming and not self.prefill_sms:
            raise ValueError("prefill_sms_when_streaming needs prefill_sms (the partition)")
        if not self.constraint_compile_seconds > 0:
            raise ValueError("constraint_compile_seconds must be > 0")
        if not 0.01 <= self.gil_switch_interval_ms <= 100:
            raise ValueError(
                f"gil_switch_interval_ms must be in 0.01..100, got {self.gil_switch_interval_ms}"
            )
        for name in ("port", "metrics_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be in 0..65535 (0 = any free port)")
        if not -1 <= self.http_port <= 65535:
            raise ValueError("http_port must be in -1..65535 (0 = off, -1 = any free port)")
        nonnegative = (
            "kv_budget",
            "prefill_sm_carveout",
            "prefill_sms",
            "prefill_sms_when_streaming",
            "prefix_prompt_tokens",
            "image_crop_graphs",
            "grace_period",
            "max_image_side",
            "malloc_arena_max",
            "malloc_mmap_threshold",
            "memory_trim_interval",
        )
        for name in nonnegative:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca needs tls_cert and tls_key (mutual TLS is TLS)")
        if self.malloc_mmap_threshold > 32 * MIB:
            raise ValueError("malloc_mmap_threshold must be at most 32MiB (glibc's ceiling)")
        if self.max_image_pixels_per_byte < 0 or self.image_free_pixels < 0:
            raise ValueError("max_image_pixels_per_byte and image_free_pixels must be >= 0")
        if self.image_gpu_decode_min_pixels < 0:
            raise ValueError(
                "--image-gpu-decode-min-pixels must be >= 0 (0 = off), "
                f"got {self.image_gpu_decode_min_pixels}"
            )
        if self.image_gpu_decoder not in GPU_DECODERS:
            raise ValueError(f"image_gpu_decoder must be one of {', '.join(GPU_DECODERS)}")
        if self.image_resize not in tuple(ResizeMode):
            raise ValueError(f"image_resize must be one of {', '.join(ResizeMode)}")
        if self.max_step_tokens <= self.max_batch_size:
            raise ValueError("max_step_tokens must exceed max_batch_size")
        if self.log_format not in ("kv", "json"):
            raise ValueError("log_format must be kv or json")

    @property
    def image_limits(self) -> ImageLimits:
        return ImageLimits(
            max_image_bytes=self.max_image_bytes,
            max_image_pixels=self.max_image_pixels,
            max_image_side=self.max_image_side or None,
            max_image_pixels_per_byte=self.max_image_pixels_per_byte or None,
            image_free_pixels=self.image_free_pixels,
        )

    @property
    def client_cache_bytes(self) -> int:
        """The image-cache share of one client (never more than the whole cache)."""
        return min(self.image_cache_client_bytes, self.image_cache_bytes)

    def items(self) -> list[tuple[str, Any]]:
        """(name, value) pairs in declaration order, for printing at start; keys redacted."""
        pairs = [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]
        return [(n, f"<{len(v)} keys>" if n == "api_keys" else v) for n, v in pairs]


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
        ("batched", "reference"),
    ),
    _Option(
        "engine_process",
        str,
        "run the engine in a process of its own, so that its scheduler never waits for the "
        "GIL behind the gRPC and HTTP event loop (auto = on when the model runs on CUDA)",
        ("auto", "on", "off"),
    ),
    _Option(
        "host",
        str,
        "address the gRPC port listens on: 0.0.0.0 is every IPv4 interface (reachable from "
        "other machines: use TLS and API keys there), 127.0.0.1 this machine only",
    ),
    _Option("port", int, "gRPC port (0 = any free port); a port in use is an error"),
    _Option(
        "http_port",
        int,
        "HTTP port of the Moondream and OpenAI-compatible API (0 = off, -1 = any free port); "
        "it listens on --host and takes the same API keys",
    ),
    _Option("tls_cert", _optional_str, "PEM certificate chain: serve gRPC over TLS"),
    _Option("tls_key", _optional_str, "PEM private key of --tls-cert"),
    _Option(
        "tls_client_ca",
        _optional_str,
        "PEM CA bundle: clients must present a certificate it signed (mutual TLS)",
    ),
    _Option(
        "api_keys",
        _key_list,
        "comma-separated API keys; calls must send 'authorization: Bearer KEY' (health "
        "stays open). Prefer the environment variable or --api-keys-file: flags show in ps",
    ),
    _Option("api_keys_file", _optional_str, "file of API keys, one a line (# comments)"),
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
    _Option(
        "prefill_sm_carveout",
        int,
        "SMs the image-prefix path's matrix products leave to the decode steps running beside "
        "it (CUDA; 0 = none): bounds how much a new image slows running streams, at the cost "
        "of a slower image path",
    ),
    _Option(
        "prefill_sms",
        int,
        "SMs the whole image-prefix path may use (a CUDA green context; 0 = all): every kernel "
        "of a new image stays off the other SMs, so running streams keep them; the image path "
        "is slower (see the README)",
    ),
    _Option(
        "prefill_sms_when_streaming",
        int,
        "with --prefill-sms: use the partition only while a running request still has at "
        "least this many tokens to stream, else give new images the whole GPU (0 = always "
        "partitioned)",
    ),
    _Option(
        "prefill_batches",
        int,
        "batches of new images queued on the device's image path at once: more keeps it "
        "busy while the scheduler waits on a step, at the cost of pages and rows held early",
    ),
    _Option(
        "prefix_prompt_tokens",
        int,
        "prompt tokens that may ride a batch of new images' prefix forward (0 = none): the "
        "first request for a new image then needs no prompt step of its own",
    ),
    _Option(
        "image_crop_graphs",
        int,
        "picture sizes whose crop path is kept as a CUDA graph (a size seen twice is "
        "captured; 0 = off): one launch instead of dozens per picture",
    ),
    _Option("pipeline_depth", int, "steps in flight: 2 overlaps host work, 1 is blocking"),
    _Option(
        "queue_limit",
        int,
        "requests waiting beyond this are refused (RESOURCE_EXHAUSTED); with an engine "
        "process, as many more may wait for their JPEG's GPU decode",
    ),
    _Option("max_image_bytes", parse_size, "largest accepted encoded image"),
    _Option("max_image_pixels", int, "largest accepted width x height"),
    _Option("max_image_side", int, "largest accepted width or height (0 = no limit)"),
    _Option(
        "max_image_pixels_per_byte",
        int,
        "images beyond --image-free-pixels need one encoded byte per this many pixels "
        "(decompression-bomb sanity rule; 0 = off)",
    ),
    _Option("image_free_pixels", int, "pixels exempt from --max-image-pixels-per-byte"),
    _Option(
        "image_decode_budget",
        parse_size,
        "decoded image bytes in flight across decode threads; larger decodes wait, an "
        "image needing more than all of it is refused",
    ),
    _Option(
        "image_resize",
        str,
        "resizer the crops replicate bit for bit: vips (the moondream reference with "
        "pyvips) or pillow (its Pillow fallback)",
        tuple(ResizeMode),
    ),
    _Option(
        "image_device",
        str,
        "where images are resized and cropped: auto (the model's device), cpu, cuda[:N]",
    ),
    _Option(
        "vision_fp8",
        parse_bool,
        "run the vision tower's QKV and MLP products in FP8 (CUDA, compute capability 8.9+): "
        "a faster image path whose features differ from the bf16 tower's by a few percent",
    ),
    _Option(
        "image_reduced_decode",
        parse_bool,
        "decode large JPEGs at 1/2, 1/4 or 1/8 scale when that still covers the crops "
        "(faster; pixels differ from a full decode)",
    ),
    _Option(
        "image_gpu_decode_min_pixels",
        int,
        "JPEGs of at least this many pixels are decoded on the GPU (--image-gpu-decoder) "
        "when images are cropped on CUDA, by the engine's process when it has one (the "
        "server then only checks their headers): much less host CPU, pixels differ "
        "slightly from libjpeg-turbo's (0 = off)",
    ),
    _Option(
        "image_gpu_decoder",
        str,
        "the GPU JPEG decoder: nvimgcodec (the chip's JPEG engines through nvImageCodec; "
        "pixels within 1 of libjpeg-turbo's, no SM time), torchvision (nvJPEG on the SMs), "
        "or auto (the first of those that works here)",
        GPU_DECODERS,
    ),
    _Option(
        "image_cache_bytes",
        parse_size,
        "memory for images uploaded with EncodeImage (least recently used go first)",
    ),
    _Option(
        "image_cache_client_bytes",
        parse_size,
        "share of the image cache one client (API key, else peer address) may hold; its "
        "own oldest images go first, so no client can flush the others'",
    ),
    _Option("max_message_bytes", parse_size, "largest gRPC message, request or response"),
    _Option("max_http_body_bytes", parse_size, "largest HTTP request body (413 beyond)"),
    _Option("max_object_chars", int, "longest object name (point, detect, segment)"),
    _Option("max_question_chars", int, "longest question of a query (characters)"),
    _Option("max_choices", int, "most choices of one constrained query"),
    _Option("max_choice_chars", int, "longest choice of a constrained query (characters)"),
    _Option("max_regex_chars", int, "longest regex of a constrained query (characters)"),
    _Option(
        "max_constraint_states",
        int,
        "most automaton states a choices / regex constraint may compile to",
    ),
    _Option(
        "constraint_compile_seconds",
        float,
        "time budget of compiling one choices / regex constraint (RESOURCE_EXHAUSTED beyond)",
    ),
    _Option(
        "metrics_host",
        str,
        "address of the Prometheus endpoint (loopback: 0.0.0.0 lets other machines scrape)",
    ),
    _Option("metrics_port", int, "Prometheus endpoint port (0 = any free port)"),
    _Option("grace_period", float, "seconds to finish accepted requests after SIGTERM"),
    _Option("decode_threads", int, "threads decoding images"),
    _Option(
        "gil_switch_interval_ms",
        float,
        "how long a Python thread may hold the GIL while another waits for it "
        "(sys.setswitchinterval): the engine's scheduler thread waits up to this long "
        "behind the event loop, so it bounds the stall a busy loop adds to a decode step",
    ),
    _Option(
        "malloc_arena_max",
        int,
        "glibc malloc arenas (0 = glibc's default of 8 per core): fewer keeps the memory "
        "that decode threads free reusable instead of stranded per thread",
    ),
    _Option(
        "malloc_mmap_threshold",
        parse_size,
        "glibc malloc: blocks this large or larger are mapped apart and returned to the "
        "system when freed (0 = glibc's default, which raises itself and then keeps freed "
        "image buffers; at most 32MiB)",
    ),
    _Option(
        "memory_trim_interval",
        float,
        "seconds between collecting the reference cycles ended requests leave and returning "
        "free heap memory to the system (0 = never)",
    ),
    _Option("log_format", str, "log line format", ("kv", "json")),
    _Option("log_level", str, "log level", ("debug", "info", "warning", "error")),
)


def _choices_text(opt: _Option) -> str:
    return f" (one of: {', '.join(opt.choices)})" if opt.choices else ""


def _shown(default: Any) -> Any:
    if isinstance(default, tuple):
        return ",".join(default) or "none"
    return default


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
            help=f"{opt.help}{_choices_text(opt)} [{opt.env}; default {_shown(default)}]",
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
