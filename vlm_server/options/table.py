"""The option table: every setting of the server process, with its flag, variable and help.

Each field of `ServerConfig` is an option: ``--max-batch-size 16`` or ``VLM_MAX_BATCH_SIZE=16``
sets ``max_batch_size``, and the component that uses it (EngineConfig, ImageLimits,
ConstraintLimits) has a field of that same name. Precedence: flag, then environment variable,
then default. Sizes accept suffixes (``32MiB``). Each value is checked once: by the component
that owns it (built here, in `ServerConfig.__post_init__`), or here when the server itself uses
it. docs/configuration.md is generated from this table (``python -m vlm_server.options
--markdown``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from decoding.limits import ConstraintLimits
from image_pipeline import DEFAULT_LIMITS, ImageLimits, ResizeMode
from image_pipeline.gpu_jpeg import GPU_DECODERS
from vlm_server.chips import profile
from vlm_server.engine.config import (
    RESERVED_ROWS_AUTO,
    VISION_WEIGHTS,
    EngineConfig,
)
from vlm_server.options import components
from vlm_server.options.checks import MIB, check_server_values
from vlm_server.options.performance import PerformanceOptions
from vlm_server.options.spec import (
    Group,
    Option,
    option,
    options_of,
    parse_auto_count,
    parse_chip_profile,
    parse_prefill_sms,
    parse_size,
)

# Defaults of the values other components own come from those components.
_ENGINE = EngineConfig()
_CONSTRAINTS = ConstraintLimits()

G = Group


@dataclass(frozen=True)
class ServerConfig(PerformanceOptions):
    """Everything the server process needs; each field is an option (see the module's doc)."""

    # --- model ------------------------------------------------------------------------------
    model: str | None = option(
        None,
        G.MODEL,
        "checkpoint directory, .safetensors file or Hugging Face repo id (default: the "
        "built-in random tiny model)",
    )
    preset: str | None = option(
        None, G.MODEL, "model configuration when the checkpoint carries none (e.g. moondream2)"
    )
    tokenizer: str | None = option(
        None, G.MODEL, "tokenizer.json to use instead of the checkpoint's"
    )
    dtype: str | None = option(
        None,
        G.MODEL,
        "weights dtype (default bf16 on CUDA, fp32 on CPU)",
        choices=("bf16", "fp16", "fp32"),
    )
    weights: str = option(
        "auto",
        G.MODEL,
        "weights: auto (the most exact format that holds --max-batch-size picture requests "
        "on this card, under --gpu-memory-bytes; one start-up line says which and the bytes), "
        "bf16 (the checkpoint's values, in --dtype), int8 (the decoder's linears, Moondream "
        "3's experts included, a scale per output channel), int4 (one per 128 input columns), "
        "fp8 (Moondream 3's experts in FP8, on chips with FP8 units), quantized at load; a vlm "
        "quantize directory is served in its own format. A format that cannot hold the model "
        "is refused at start",
        choices=("auto", "bf16", "int8", "int4", "fp8"),
    )
    vision_weights: str = option(
        _ENGINE.vision_weights,
        G.MODEL,
        "the vision tower's block linears: exact (as the checkpoint holds them), int8 (a scale "
        "per output channel) or int4 (one per 128 input columns; a linear whose inputs are "
        "not a multiple of 128 stays 16-bit), quantized at load whatever --weights is; not "
        "with --vision-fp8",
        choices=VISION_WEIGHTS,
    )
    device: str | None = option(None, G.MODEL, "cpu or cuda[:N] (default: cuda if present)")
    chip_profile: str | None = option(
        None,
        G.MODEL,
        "run the GPU as another chip of docs/hardware.md would (e.g. rtx3090, rtx4090, a100): "
        "its compute capability, SM count and limits for every launch choice and feature, "
        "its memory as the cap unless --gpu-memory-bytes is set; for testing that chip's paths "
        "(not its speed)",
        parse=parse_chip_profile,
    )
    engine: str = option(
        "batched",
        G.MODEL,
        "batched (continuous batching) or reference (the same engine at batch 1, blocking)",
        choices=("batched", "reference"),
    )

    # --- serving ----------------------------------------------------------------------------
    host: str = option(
        "0.0.0.0",
        G.SERVING,
        "address the gRPC and HTTP ports listen on: 0.0.0.0 is every IPv4 interface "
        "(reachable from other machines: use TLS and API keys there), 127.0.0.1 this machine "
        "only",
    )
    port: int = option(50051, G.SERVING, "gRPC port (0 = any free port); a port in use is an error")
    http_port: int = option(
        2020,
        G.SERVING,
        "HTTP port of the Moondream and OpenAI-compatible API (0 = off, -1 = any free port); "
        "it listens on --host and takes the same API keys",
    )
    grace_period: float = option(
        30.0, G.SERVING, "seconds to finish accepted requests after SIGTERM"
    )
    data_dir: str | None = option(
        None,
        G.SERVING,
        "folder of the Batch API's files, jobs and results (/v1/files, /v1/batches; "
        "docs/bulk.md): jobs run there and resume after a restart. Unset: the Batch API "
        "is off",
    )

    # --- limits -----------------------------------------------------------------------------
    max_queue: int = option(
        _ENGINE.max_queue,
        G.LIMITS,
        "requests waiting beyond this are refused (RESOURCE_EXHAUSTED); with an engine "
        "process, as many more may wait for their JPEG's GPU decode",
    )
    max_message_bytes: int = option(
        32 * MIB, G.LIMITS, "largest gRPC message, request or response", parse=parse_size
    )
    max_http_body_bytes: int = option(
        32 * MIB, G.LIMITS, "largest HTTP request body (413 beyond)", parse=parse_size
    )
    max_image_bytes: int = option(
        DEFAULT_LIMITS.max_image_bytes, G.LIMITS, "largest accepted encoded image", parse=parse_size
    )
    max_image_pixels: int = option(
        DEFAULT_LIMITS.max_image_pixels, G.LIMITS, "largest accepted width x height"
    )
    max_image_side: int = option(
        DEFAULT_LIMITS.max_image_side or 0,
        G.LIMITS,
        "largest accepted width or height (0 = no limit)",
    )
    max_image_pixels_per_byte: int = option(
        DEFAULT_LIMITS.max_image_pixels_per_byte or 0,
        G.LIMITS,
        "images beyond --image-free-pixels need one encoded byte per this many pixels "
        "(decompression-bomb sanity rule; 0 = off)",
    )
    image_free_pixels: int = option(
        DEFAULT_LIMITS.image_free_pixels,
        G.LIMITS,
        "pixels exempt from --max-image-pixels-per-byte",
    )
    max_batch_file_bytes: int = option(
        200 * MIB,
        G.LIMITS,
        "largest file uploaded to the Batch API (/v1/files; 413 beyond)",
        parse=parse_size,
    )
    max_batch_lines: int = option(
        50_000, G.LIMITS, "most request lines of one Batch API input file (413 beyond)"
    )
    max_object_chars: int = option(
        256, G.LIMITS, "longest object name (point, detect, segment; characters)"
    )
    max_question_chars: int = option(16_384, G.LIMITS, "longest question of a query (characters)")
    max_spatial_refs: int = option(
        _ENGINE.max_spatial_refs,
        G.LIMITS,
        "most spatial references (points, boxes) of one request; each sequence row reserves "
        "device memory for three embeddings per reference",
    )
    max_choices: int = option(
        _CONSTRAINTS.max_choices, G.LIMITS, "most choices of one constrained query"
    )
    max_choice_chars: int = option(
        _CONSTRAINTS.max_choice_chars,
        G.LIMITS,
        "longest choice of a constrained query (characters)",
    )
    max_regex_chars: int = option(
        _CONSTRAINTS.max_regex_chars,
        G.LIMITS,
        "longest regex of a constrained query (characters)",
    )
    max_constraint_states: int = option(
        _CONSTRAINTS.max_constraint_states,
        G.LIMITS,
        "most automaton states a choices / regex constraint may compile to",
    )
    constraint_compile_seconds: float = option(
        _CONSTRAINTS.constraint_compile_seconds,
        G.LIMITS,
        "time budget of compiling one choices / regex constraint (RESOURCE_EXHAUSTED beyond)",
    )

    # --- image path -------------------------------------------------------------------------
    image_device: str = option(
        "auto",
        G.IMAGES,
        "where images are resized and cropped: auto (the model's device), cpu, cuda[:N]",
    )
    image_resize: str = option(
        "vips",
        G.IMAGES,
        "resizer the crops replicate bit for bit: vips (the moondream reference with pyvips) "
        "or pillow (its Pillow fallback)",
        choices=tuple(ResizeMode),
    )
    image_reduced_decode: bool = option(
        True,
        G.IMAGES,
        "decode large JPEGs at 1/2, 1/4 or 1/8 scale when that still covers the crops "
        "(faster; pixels differ from a full decode)",
    )
    image_decode_budget: int = option(
        1024 * MIB,
        G.IMAGES,
        "decoded image bytes in flight across decode threads; larger decodes wait, an image "
        "needing more than all of it is refused",
        parse=parse_size,
    )
    decode_threads: int = option(4, G.IMAGES, "threads decoding images")
    image_gpu_decode_min_pixels: int = option(
        0,
        G.IMAGES,
        "JPEGs of at least this many pixels are decoded on the GPU (--image-gpu-decoder) when "
        "images are cropped on CUDA, by the engine's process when it has one (the server then "
        "only checks their headers): much less host CPU, pixels differ slightly from "
        "libjpeg-turbo's (0 = off)",
    )
    image_gpu_decoder: str = option(
        "auto",
        G.IMAGES,
        "the GPU JPEG decoder: nvimgcodec (the chip's JPEG engines through nvImageCodec; "
        "pixels within 1 of libjpeg-turbo's, no SM time), torchvision (nvJPEG on the SMs), "
        "or auto (the first of those that works here)",
        choices=GPU_DECODERS,
    )
    image_cache_bytes: int = option(
        512 * MIB,
        G.IMAGES,
        "memory for images uploaded with EncodeImage (least recently used go first)",
        parse=parse_size,
    )
    image_cache_client_bytes: int = option(
        128 * MIB,
        G.IMAGES,
        "share of the image cache one client (API key, else peer address) may hold; its own "
        "oldest images go first, so no client can flush the others'",
        parse=parse_size,
    )

    # --- security ---------------------------------------------------------------------------
    tls_cert: str | None = option(None, G.SECURITY, "PEM certificate chain: serve gRPC over TLS")
    tls_key: str | None = option(None, G.SECURITY, "PEM private key of --tls-cert")
    tls_client_ca: str | None = option(
        None,
        G.SECURITY,
        "PEM CA bundle: clients must present a certificate it signed (mutual TLS)",
    )
    api_keys: tuple[str, ...] = option(
        (),
        G.SECURITY,
        "comma-separated API keys; calls must send 'authorization: Bearer KEY' (health stays "
        "open). Prefer the environment variable or --api-keys-file: flags show in ps",
    )
    api_keys_file: str | None = option(
        None, G.SECURITY, "file of API keys, one a line (# comments)"
    )

    # --- observability ----------------------------------------------------------------------
    metrics_host: str = option(
        "127.0.0.1",
        G.OBSERVABILITY,
        "address of the Prometheus endpoint (loopback: 0.0.0.0 lets other machines scrape)",
    )
    segment_refiner: str | None = option(
        None,
        G.MODEL,
        "Moondream 3's segmentation refiner: its weights file (model.pt), a folder holding "
        "it, or a Hugging Face repo id (moondream/SegHeadRefiner). Each segment's final path "
        "and box then come from one more vision-tower pass over the box and five rounds of "
        "the refiner's head; the streamed path stays the decoded one. Unset: the decoded path "
        "is the answer",
    )
    adapters_dir: str | None = option(
        None,
        G.MODEL,
        "folder of finetune adapters (LoRA) requests may name: <id>/final.pt or <id>.pt (the "
        "moondream reference's format; Moondream 3: the cloud finetunes' checkpoints), "
        "<id>.safetensors or <id>/adapter.safetensors; downloads are saved here too",
    )
    adapter_endpoint: str | None = option(
        None,
        G.MODEL,
        "base URL adapters missing from --adapters-dir are downloaded from "
        "(<url>/v1/variants/<id>/download, as the moondream reference does; Moondream 3: "
        "<url>/v1/tuning/finetunes/<id>/checkpoints/<step>/download, then its presigned URL); "
        "unset: none are",
    )
    adapter_api_key: str | None = option(
        None,
        G.SECURITY,
        "key sent to --adapter-endpoint as X-Moondream-Auth (default: $MOONDREAM_API_KEY)",
    )
    max_adapters: int = option(
        _ENGINE.max_adapters,
        G.LIMITS,
        "adapters resident on the device at once; a request whose adapter needs a slot while "
        "running requests use every one waits (--adapter-wait-s)",
    )
    max_adapter_rank: int = option(
        _ENGINE.max_adapter_rank,
        G.LIMITS,
        "largest LoRA rank an adapter may have (each slot is allocated at this rank)",
    )
    adapter_wait_s: float = option(
        _ENGINE.adapter_wait_s,
        G.LIMITS,
        "seconds a request may wait for an adapter slot (RESOURCE_EXHAUSTED beyond)",
    )
    adapter_download_bytes: int = option(
        _ENGINE.adapter_download_bytes,
        G.LIMITS,
        "largest adapter file a download may bring",
        parse=parse_size,
    )
    adapter_download_timeout_s: float = option(
        _ENGINE.adapter_download_timeout_s, G.LIMITS, "seconds one adapter download may take"
    )
    metrics_port: int = option(
        9464, G.OBSERVABILITY, "Prometheus endpoint port (0 = any free port)"
    )
    log_format: str = option("kv", G.OBSERVABILITY, "log line format", choices=("kv", "json"))
    log_level: str = option(
        "info", G.OBSERVABILITY, "log level", choices=("debug", "info", "warning", "error")
    )
    step_trace: str = option(
        "",
        G.OBSERVABILITY,
        "write the engine's last --step-trace-steps steps (host and device times, garbage "
        "collections, whether an image prefix ran beside) to this JSON file when the server "
        "stops, for bench/step_gaps.py (empty = off; costs CUDA events and host time per step)",
    )
    step_trace_steps: int = option(
        100_000, G.OBSERVABILITY, "steps the --step-trace file keeps (the most recent)"
    )

    # --- advanced ---------------------------------------------------------------------------
    # Each help ends with what its default was measured to buy.
    pipeline_depth: int = option(
        _ENGINE.pipeline_depth,
        G.ADVANCED,
        "decode steps in flight: 2 overlaps the host's work with the GPU's, 1 is blocking. "
        "Measured (H100): 2 took a step from 1.96 to 1.73 ms for one stream, from 3.71 to "
        "3.11 ms for 32",
    )
    max_prefill_batch: int = option(
        _ENGINE.max_prefill_batch,
        G.ADVANCED,
        "requests admitted in one step, so new images whose prefixes run as one batch (one "
        "text forward over all of them, and steps after it that carry all their rows): more "
        "shares each weight read among more images, at the cost of a longer wait for a full "
        "batch's first token. Measured (H100, unique 800x600 queries at 64 clients): 8 -> 16 "
        "took Moondream 3 from 58.4-58.6 to 60.4-60.6 req/s (24: 61.1) and moondream2 from "
        "57.8 to 59.0",
    )
    prefill_batches: int = option(
        _ENGINE.prefill_batches,
        G.ADVANCED,
        "batches of new images queued on the device's image path at once: more keeps it busy "
        "while the scheduler waits on a step, at the cost of pages and rows held early. "
        "Measured (H100): 2, 3 and 4 all gave 57.8-57.9 req/s of unique images at 64 clients, "
        "so 2 holds the least for the same throughput",
    )
    prefix_prompt_tokens: int = option(
        _ENGINE.prefix_prompt_tokens,
        G.ADVANCED,
        "prompt tokens that may ride a batch of new images' prefix forward (0 = none): the "
        "first request for a new image then needs no prompt step of its own. Measured (H100): "
        "about 1 ms off a new image's latency at one client",
    )
    crop_graph_sizes: int = option(
        _ENGINE.crop_graph_sizes,
        G.ADVANCED,
        "picture sizes whose crop path is kept as a CUDA graph (a size seen twice is "
        "captured; 0 = off): one launch instead of dozens per picture. Measured (H100): an "
        "800x600 picture's crops from 2.5 to 0.4 ms of engine host time, 2.3 to 0.7 ms of GPU",
    )
    gil_switch_interval_ms: float = option(
        5.0,
        G.ADVANCED,
        "how long a Python thread may hold the GIL while another waits for it "
        "(sys.setswitchinterval): it bounds the stall a busy event loop adds to the "
        "scheduler thread. Measured (H100) against 0.5: the same throughput, and 0.5 halved "
        "the p99 of event delivery without new images but not with them, so the default "
        "stays Python's own",
    )
    malloc_arena_max: int = option(
        2,
        G.ADVANCED,
        "glibc malloc arenas (0 = glibc's default of 8 per core): fewer keeps the memory that "
        "decode threads free reusable instead of stranded per thread. Measured (CPU, tiny "
        "model, 150 s soak) with the three memory options at their defaults: 1.3 GiB peak and "
        "0.87 GiB after idle, against 2.0 and 1.8 GiB with all three off",
    )
    malloc_mmap_threshold: int = option(
        MIB,
        G.ADVANCED,
        "glibc malloc: blocks this large or larger are mapped apart and returned to the "
        "system when freed (0 = glibc's default, which raises itself and then keeps freed "
        "image buffers; at most 32MiB). Measured: see --malloc-arena-max",
        parse=parse_size,
    )
    memory_trim_interval: float = option(
        10.0,
        G.ADVANCED,
        "seconds between collecting the reference cycles ended requests leave and returning "
        "free heap memory to the system (0 = never). Measured: see --malloc-arena-max",
    )

    def __post_init__(self) -> None:
        try:  # the flag's own parser, for values given in code
            parse_prefill_sms(str(self.prefill_sms))
        except ValueError as err:
            raise ValueError(f"prefill_sms must be auto or a count of SMs: {err}") from None
        for name in ("background_reserved_rows", "compile_threads"):
            try:
                parse_auto_count(str(getattr(self, name)))
            except ValueError as err:
                raise ValueError(f"{name} must be auto or a count: {err}") from None
        for opt in OPTIONS:
            value = getattr(self, opt.name)
            if opt.choices and value is not None and value not in opt.choices:
                raise ValueError(f"{opt.name} must be one of {', '.join(opt.choices)}")
        check_server_values(self)
        # The values other components use are checked by those components, once: building
        # them here refuses a bad value before the server starts.
        _ = self.engine_config, self.image_limits

    @property
    def engine_config(self) -> EngineConfig:
        """The batched engine's configuration (``--engine reference`` narrows it)."""
        return components.engine_config(self)

    @property
    def reserved_rows_value(self) -> int:
        """``background_reserved_rows`` as EngineConfig takes it (auto: RESERVED_ROWS_AUTO)."""
        text = str(self.background_reserved_rows)
        return RESERVED_ROWS_AUTO if text == "auto" else int(text)

    @property
    def memory_cap_bytes(self) -> int:
        """The engine's GPU memory cap: --gpu-memory-bytes, else the chip profile's memory (0:
        none)."""
        if self.gpu_memory_bytes or self.chip_profile is None:
            return self.gpu_memory_bytes
        return profile(self.chip_profile).memory_bytes

    @property
    def constraint_limits(self) -> ConstraintLimits:
        """The engine's bounds on client constraints (choices / regex)."""
        return components.constraint_limits(self)

    @property
    def image_limits(self) -> ImageLimits:
        """The checks of every uploaded image (0 turns the side and ratio rules off)."""
        return components.image_limits(self)

    @property
    def client_cache_bytes(self) -> int:
        """The image-cache share of one client (never more than the whole cache)."""
        return min(self.image_cache_client_bytes, self.image_cache_bytes)

    def items(self) -> list[tuple[str, Any]]:
        """(name, value) pairs in declaration order, for printing at start; keys redacted."""
        pairs = [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]
        pairs = [(n, "<set>" if n == "adapter_api_key" and v else v) for n, v in pairs]
        return [(n, f"<{len(v)} keys>" if n == "api_keys" else v) for n, v in pairs]


OPTIONS: tuple[Option, ...] = options_of(ServerConfig)
