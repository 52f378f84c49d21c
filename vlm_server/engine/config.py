"""Engine configuration (frozen; derived sizes are computed, never written back)."""

from __future__ import annotations

from dataclasses import dataclass, field

from decoding.limits import ConstraintLimits

# EngineConfig.launch_overlap's values.
LAUNCH_OVERLAP_MODES = ("off", "idle", "always")
BACKGROUND_YIELD = ("off", "steps", "prefill", "all")
# EngineConfig.prefill_sms: a share of the chip's SMs where green contexts work, else none
# (chip_features.auto_prefill_sms); the server's default.
PREFILL_SMS_AUTO = -1
# EngineConfig.background_reserved_rows: DEFAULT_RESERVED_ROWS, or max_batch_size - 1 when
# that is fewer (a batch of one reserves none), so that every batch size has a default.
RESERVED_ROWS_AUTO = -1
DEFAULT_RESERVED_ROWS = 4
# EngineConfig.compile_threads: one per CPU core, at most AUTO_COMPILE_THREADS (the server's
# default is auto; a library engine compiles in its warm-ups unless asked).
COMPILE_THREADS_AUTO = -1
AUTO_COMPILE_THREADS = 16
# EngineConfig.kv_dtype's values: auto keeps keys and values in the activations' dtype (bf16
# on CUDA, exact); fp8 (e4m3, compute capability 8.9+) and int8 store 8 bits an element and a
# scale per position and KV head (docs/kv_cache.md).
KV_DTYPES = ("auto", "bf16", "fp8", "int8")
# EngineConfig.vision_weights's values: exact (the tower as loaded), or its block linears
# quantized at load (docs/quantization.md).
VISION_WEIGHTS = ("exact", "int8", "int4")


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 32  # running sequences per decode step
    page_size: int = 16  # KV positions per page
    kv_budget_bytes: int | None = None  # None: 256 MiB on the CPU, 40% of free memory on CUDA
    # The KV pages' format (KV_DTYPES): auto, the activations' dtype, for now.
    kv_dtype: str = "auto"
    # The GPU memory the engine process may allocate (None: all); see devices.cap_memory.
    gpu_memory_bytes: int | None = None
    pipeline_depth: int = 2  # 1 = blocking, 2 = pipelined
    max_queue: int = 256  # waiting requests before RESOURCE_EXHAUSTED
    # Requests admitted (first prefill chunk) in one step, so new images whose prefixes one
    # batch runs together: one text forward over all of them, and the steps after it carry
    # their rows together (each step reads the decoder's weights once for all of them). 8
    # against 16 (H100, 32 streamed captions on new pictures): chunk gap p99 8.3 -> 4.8 ms,
    # first token p90 794 -> 558 ms, start-up 4-5 s shorter (half the prefix graphs); unique
    # c=64 queries 1-3% fewer (docs/performance.md).
    max_prefill_batch: int = 8
    # Tokens of one step's forward: its decode rows plus prefill chunks (core/step_plan.py).
    # An image prefix (730 positions for moondream2) cannot be split, so this sets how many
    # new images one step admits: 4096 (five) measured best on an H100 for unique 800x600
    # queries at 64 clients (30.7 req/s, against 23.8 at 2048 and 14.0 at 1024), at the cost
    # of longer mixed steps. Lower it to bound inter-token stalls.
    max_step_tokens: int = 4096
    # While new pictures run on the image path, a decode step (no prompt in it)
    # starts at most every this many ms: running streams give GPU time to first tokens. With
    # the image path the bottleneck, a closed loop's first tokens take what decoding leaves of
    # each cycle (docs/performance.md, "First tokens under load"). 0: back to back.
    decode_pace_ms: float = 0.0
    prefix_cache_entries: int = 64  # image prefixes kept for reuse
    mask_table_rows: int = 1024  # device mask-table capacity (rows of vocab-wide bools)
    cuda_graphs: bool = True  # capture decode forwards per batch bucket (CUDA only)
    # Threads that compile the decode and mixed steps' Triton kernels ahead of their graphs'
    # warm-ups (engine/device/precompile.py; a cold Triton cache spent 26 of 45 s of an
    # H100's captures compiling one kernel after another). 0 or 1: the warm-ups compile;
    # COMPILE_THREADS_AUTO: one per core, at most AUTO_COMPILE_THREADS.
    compile_threads: int = 0
    # SMs the image-prefix path's GEMMs leave free (cuBLAS SM count target, baked into its
    # graphs): the prefill stream runs beside decode steps, and cuBLAS's persistent GEMM
    # kernels otherwise hold every SM for their whole length, stalling the steps' kernels.
    prefill_sm_carveout: int = 0
    # SMs the prefill stream's kernels may use (a CUDA green context holds the stream; graphs
    # captured on it keep the partition). Unlike the carveout it binds every kernel (Triton,
    # cuDNN, cuBLAS), so the steps always find the other SMs free. 0: no partition;
    # PREFILL_SMS_AUTO: chosen from the chip at start (the server's default; a library
    # engine asks for nothing it did not name).
    prefill_sms: int = 0
    # With a partition: it serves a batch of new images only while some running request
    # still has at least this many tokens to stream; otherwise the batch gets the whole GPU
    # (its own graphs, captured on an unpartitioned stream). Streams keep their inter-token
    # tail, bursts of short queries their throughput. 0: always partitioned. Without a
    # partition it is not read.
    prefill_sms_when_streaming: int = 16
    # Batches of new image prefixes queued on the prefill stream at once. The scheduler
    # blocks on step results; work queued ahead keeps the image path busy meanwhile.
    prefill_batches: int = 2
    # Prompt tokens that may ride one batch of new image prefixes (core/prefix_jobs.py): the
    # first request for a new image then needs no prompt step. 0: prompts always run in steps.
    prefix_prompt_tokens: int = 64
    # Picture sizes whose crops (of host-decoded images) run as a CUDA graph: a size seen
    # twice is captured (image_pipeline/crop_graphs.py). 0: always eager.
    crop_graph_sizes: int = 4
    # The vision tower's QKV / fc1 / fc2 as FP8 GEMMs (models/common/fp8_vision.py): faster image
    # path, features within a few percent of the bf16 tower's. CUDA with FP8 units only.
    # None (auto, the server's default): on where the experts are held in FP8 on a chip with
    # FP8 units and the tower's weights are exact (device/model_entry.py `fp8_vision_choice`).
    vision_fp8: bool | None = False
    # The vision tower's block linears in 8 or 4 bits (VISION_WEIGHTS), quantized when the
    # model loads; the memory plan counts them so. Not with vision_fp8 (which quantizes the
    # 16-bit weights).
    vision_weights: str = "exact"
    # Moondream 3: the expert products of steps of 256 tokens or more (image prefixes, long
    # prompt chunks) with FP8 activations beside the FP8 expert weights (FP8 x FP8 on the
    # matrix units; models/moondream3/act_quant.py). Answers differ from the 16-bit path's.
    # None (auto, the server's default): on where the experts are held in FP8 on CUDA
    # (device/model_entry.py `fp8_activations_choice`); a library engine asks for nothing.
    experts_fp8_activations: bool | None = False
    # Decode steps (few rows) run each decoder block's four matrix products as two fused
    # skinny products (models/common/fused_products.py), where the family offers them (CUDA).
    fused_decode: bool = True
    # The decode step's Triton kernels launch while their predecessor finishes (programmatic
    # dependent launch, models/common/launch_overlap.py), compute capability 9.0+ only:
    # "always"; "idle": only steps launched while no image prefill is in flight (the early
    # programs hold SMs a prefill beside the steps would use), from a second set of decode
    # graphs; "off".
    launch_overlap: str = "idle"
    # Headroom for interactive requests (priority >= 0) over background work (below 0,
    # core/headroom.py): background sequences hold at most max_batch_size minus this many
    # rows, and leave the KV pages of this many new picture requests free (0: no headroom;
    # RESERVED_ROWS_AUTO: see there).
    background_reserved_rows: int = RESERVED_ROWS_AUTO
    # New pictures of a prefix batch holding background ones (such a batch takes one of the
    # prefill_batches slots at most): an interactive picture waits behind no more than one
    # batch of this many background pictures on the prefill stream.
    background_prefill_batch: int = 2
    # While background work runs, new interactive pictures take a prefill lane of their own
    # (engine/device/prefill.py): a stream ahead of the steps, with its own graphs, so they
    # wait behind no background picture and no decode step. Pictures in one batch there;
    # 0: no such lane (interactive pictures queue behind background ones).
    interactive_prefill_batch: int = 4
    # What background work yields while interactive requests run (BACKGROUND_YIELD):
    # "steps": a step that has interactive rows to carry carries only those (a decode step's
    # time grows with its rows' KV reads); "prefill": no background picture batch starts
    # while an interactive picture is on the lane; "all": both; "off": neither.
    background_yield: str = "all"
    # While an interactive picture is on its lane, a decode step carrying background rows
    # only starts at most every this many ms (the picture gets the GPU time between): an
    # interactive request's image prefix competes with the background's steps, not only its
    # pictures. 0: back to back.
    background_pace_ms: float = 0.0
    # Spatial references one request may carry: every sequence row reserves the embeddings
    # of this many boxes (three positions each) on the device.
    max_spatial_refs: int = 8
    # Caps and time budget of client constraints (choices / regex), see decoding/limits.py.
    constraint_limits: ConstraintLimits = field(default_factory=ConstraintLimits)
    # Finetune adapters (LoRA, models/lora/): a folder of adapter files and/or an endpoint
    # to download them from. Neither: requests naming an adapter are refused.
    adapters_dir: str | None = None
    adapter_endpoint: str | None = None
    adapter_api_key: str | None = None  # None: the MOONDREAM_API_KEY environment variable
    max_adapters: int = 8  # adapters resident on the device at once (slots)
    max_adapter_rank: int = 32  # every slot's rank: its memory, and the LoRA kernels' width
    adapter_wait_s: float = 30.0  # a request waits this long for a slot, then is refused
    adapter_download_bytes: int = 1 << 30
    adapter_download_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        # Each message starts with the field's name: the server's flag of the same name.
        for name in (
            "max_batch_size",
            "max_queue",
            "max_prefill_batch",
            "background_prefill_batch",
            "prefill_batches",
            "page_size",
            "max_adapters",
            "max_adapter_rank",
            "adapter_download_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.compile_threads < COMPILE_THREADS_AUTO:
            raise ValueError(f"compile_threads must be >= 0 or auto, got {self.compile_threads}")
        if self.prefill_sms < PREFILL_SMS_AUTO:
            raise ValueError(f"prefill_sms must be >= 0 or auto, got {self.prefill_sms}")
        nonnegative = (
            "prefill_sm_carveout",
            "prefill_sms_when_streaming",
            "prefix_prompt_tokens",
            "crop_graph_sizes",
            "max_spatial_refs",
            "interactive_prefill_batch",
        )
        for name in nonnegative:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        reserved = self.background_reserved_rows
        if reserved < RESERVED_ROWS_AUTO:
            raise ValueError(f"background_reserved_rows must be >= 0 or auto, got {reserved}")
        if reserved >= self.max_batch_size:
            raise ValueError(
                f"background_reserved_rows must be below max_batch_size ({self.max_batch_size}): "
                f"background work needs a row, got {reserved}"
            )
        if self.max_step_tokens <= self.max_batch_size:
            raise ValueError(
                "max_step_tokens must exceed max_batch_size: every step takes all its "
                "decode rows and at least one prefill token"
            )
        if self.background_yield not in BACKGROUND_YIELD:
            raise ValueError(
                f"background_yield must be one of {', '.join(BACKGROUND_YIELD)}, "
                f"not {self.background_yield!r}"
            )
        if self.launch_overlap not in LAUNCH_OVERLAP_MODES:
            raise ValueError(
                f"launch_overlap must be one of {', '.join(LAUNCH_OVERLAP_MODES)}, "
                f"not {self.launch_overlap!r}"
            )
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(
                f"kv_dtype must be one of {', '.join(KV_DTYPES)}, not {self.kv_dtype!r}"
            )
        if self.vision_weights not in VISION_WEIGHTS:
            raise ValueError(
                f"vision_weights must be one of {', '.join(VISION_WEIGHTS)}, "
                f"not {self.vision_weights!r}"
            )
        if self.vision_weights != "exact" and self.vision_fp8:
            raise ValueError(
                f"vision_weights {self.vision_weights}: not with vision_fp8, which quantizes "
                "the tower's 16-bit weights; choose one"
            )
        for name in ("decode_pace_ms", "background_pace_ms"):
            if not 0 <= getattr(self, name) <= 1000:
                raise ValueError(f"{name} must be in 0..1000, got {getattr(self, name)}")
        if self.pipeline_depth not in (1, 2):
            raise ValueError("pipeline_depth must be 1 (blocking) or 2 (pipelined)")
        if self.kv_budget_bytes is not None and self.kv_budget_bytes <= 0:
            raise ValueError("kv_budget_bytes must be positive")
        for name in ("adapter_wait_s", "adapter_download_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def adapters_enabled(self) -> bool:
        """Whether requests may name an adapter (a folder or an endpoint is configured)."""
        return bool(self.adapters_dir or self.adapter_endpoint)

    @property
    def reserved_rows(self) -> int:
        """The rows background work leaves to interactive requests (`background_reserved_rows`
        with auto resolved)."""
        if self.background_reserved_rows == RESERVED_ROWS_AUTO:
            return min(DEFAULT_RESERVED_ROWS, self.max_batch_size - 1)
        return self.background_reserved_rows

    @property
    def max_rows(self) -> int:
        """Sequence rows: running ones plus as many zombies still in flight."""
        return 2 * self.max_batch_size
