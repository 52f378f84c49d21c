"""The option table's performance section: how the engine batches, prefills and schedules.
`ServerConfig` (options/table.py) inherits these fields, so they are options like the rest
(same flags, variables and checks)."""

from __future__ import annotations

from dataclasses import dataclass

from vlm_server.engine.config import (
    BACKGROUND_YIELD,
    DEFAULT_RESERVED_ROWS,
    KV_DTYPES,
    LAUNCH_OVERLAP_MODES,
    EngineConfig,
)
from vlm_server.options.spec import (
    Group,
    option,
    parse_auto_count,
    parse_auto_switch,
    parse_prefill_sms,
    parse_size,
)

_ENGINE = EngineConfig()
G = Group


@dataclass(frozen=True)
class PerformanceOptions:
    """The performance options (a base of `ServerConfig`)."""

    # --- performance ------------------------------------------------------------------------
    engine_process: str = option(
        "auto",
        G.PERFORMANCE,
        "run the engine in a process of its own, so that its scheduler never waits for the "
        "GIL behind the gRPC and HTTP event loop (auto = on when the model runs on CUDA)",
        choices=("auto", "on", "off"),
    )
    max_batch_size: int = option(
        _ENGINE.max_batch_size, G.PERFORMANCE, "most sequences decoded together"
    )
    background_reserved_rows: str = option(
        "auto",
        G.PERFORMANCE,
        "headroom for interactive requests (priority >= 0) over background work (priority "
        "below 0, e.g. batch jobs): background requests run in at most --max-batch-size minus "
        "this many rows, and leave free the KV pages of this many new picture requests, so "
        "that an interactive request arriving later is admitted at once (0 = no headroom; "
        f"auto = {DEFAULT_RESERVED_ROWS}, or --max-batch-size minus 1 when that is fewer)",
        parse=parse_auto_count,
    )
    background_prefill_batch: int = option(
        _ENGINE.background_prefill_batch,
        G.PERFORMANCE,
        "most new pictures in a batch of image prefixes that holds background pictures; "
        "background pictures use one of the --prefill-batches slots at most, so an "
        "interactive picture waits behind one such small batch at most",
    )
    interactive_prefill_batch: int = option(
        _ENGINE.interactive_prefill_batch,
        G.PERFORMANCE,
        "while background work runs, new interactive pictures take a prefill lane of their "
        "own, ahead of the decode steps and of background pictures, in batches of at most "
        "this many (0 = no such lane: interactive pictures queue behind background ones; "
        "the lane's graphs take start-up time and memory)",
    )
    background_yield: str = option(
        _ENGINE.background_yield,
        G.PERFORMANCE,
        "what background work yields while interactive requests run: steps = a step with "
        "interactive rows to carry carries only those (it ends sooner without the background "
        "rows' KV reads); prefill = no background picture batch starts while an interactive "
        "picture is on its lane; all = both; off = neither",
        choices=BACKGROUND_YIELD,
    )
    background_pace_ms: float = option(
        _ENGINE.background_pace_ms,
        G.PERFORMANCE,
        "while an interactive picture is on its lane, start a decode step that carries only "
        "background rows at most every this many ms (0 = back to back): the picture's prefix "
        "gets the GPU time between, the background's streams pause that much at most",
    )
    batch_concurrency: int = option(
        0,
        G.PERFORMANCE,
        "lines of a Batch API job in flight at once (0 = --max-batch-size)",
    )
    max_step_tokens: int = option(
        _ENGINE.max_step_tokens,
        G.PERFORMANCE,
        "tokens of one forward: decode rows plus prompt chunks (longer prompts are prefilled "
        "over several steps); above --max-batch-size. The default let five new images into a "
        "step: 30.7 req/s of unique 800x600 queries at 64 clients on an H100, against 23.8 at "
        "2048; lower it to bound inter-token stalls",
    )
    kv_budget_bytes: int = option(
        0,
        G.PERFORMANCE,
        "KV cache memory (0 = the engine's default: 40% of free GPU memory on CUDA, 256 MiB "
        "on the CPU)",
        parse=parse_size,
    )
    kv_dtype: str = option(
        _ENGINE.kv_dtype,
        G.PERFORMANCE,
        "the KV cache's element type: auto (the activations' dtype, bf16 on CUDA: exact), "
        "bf16, fp8 (e4m3, compute capability 8.9+) or int8; fp8 and int8 store one byte an "
        "element plus an fp32 scale per position and KV head, about half of bf16's bytes a "
        "token, so about twice the tokens fit the same --kv-budget-bytes (docs/kv_cache.md)",
        choices=KV_DTYPES,
    )
    gpu_memory_bytes: int = option(
        0,
        G.PERFORMANCE,
        "GPU memory the engine may allocate (0 = all of it): PyTorch's allocator is capped "
        "there (e.g. 24GiB to run as on a 24 GB card, or to share a GPU), and the default KV "
        "budget is 40% of what is free under the cap after loading",
        parse=parse_size,
    )
    vision_fp8: str = option(
        "auto",
        G.PERFORMANCE,
        "run the vision tower's QKV and MLP products in FP8 (CUDA, compute capability 8.9+): a "
        "faster image path whose features differ from the bf16 tower's by a few percent. "
        "auto: on for an FP8 build (Moondream 3's FP8 experts) on a chip with FP8 units and "
        "an exact --vision-weights, as FP8 models are served; off elsewhere",
        parse=parse_auto_switch,
        choices=("auto", "on", "off"),
    )
    experts_fp8_activations: str = option(
        "auto",
        G.PERFORMANCE,
        "Moondream 3 with FP8 experts: run the expert products of wide steps (image prefixes, "
        "prompt chunks of 256+ tokens) with FP8 activations, one scale per row, on the FP8 "
        "matrix units: faster new images, answers differ slightly from the 16-bit path's. "
        "auto: on where the experts are held in FP8 on CUDA (as FP8 models are served)",
        parse=parse_auto_switch,
        choices=("auto", "on", "off"),
    )
    decode_pace_ms: float = option(
        _ENGINE.decode_pace_ms,
        G.PERFORMANCE,
        "while new pictures run on the image path, start a decode step at most "
        "every this many ms (0 = back to back): running streams give GPU time to new requests' "
        "first tokens, each of their chunks coming that much later at most",
    )
    compile_threads: str = option(
        "0",
        G.PERFORMANCE,
        "threads that compile the decode and mixed steps' Triton kernels at start, ahead of "
        "the graphs' warm-ups, which otherwise meet them one by one (a cold Triton cache spent "
        "26 of 45 s of an H100's graph captures compiling). 0 = the warm-ups compile; auto = "
        "one per CPU core, at most 16",
        parse=parse_auto_count,
    )
    fused_decode: bool = option(
        _ENGINE.fused_decode,
        G.PERFORMANCE,
        "run each decoder block's four matrix products as two fused Triton products in steps "
        "of few rows, and Moondream 3's tau scaling as two kernels per layer (CUDA; false: "
        "cuBLAS and PyTorch ops)",
    )
    launch_overlap: str = option(
        _ENGINE.launch_overlap,
        G.PERFORMANCE,
        "launch each of the decode step's Triton kernels while the one before it finishes "
        "(programmatic dependent launch; CUDA compute capability 9.0+, ignored elsewhere), "
        "for shorter steps: always; idle (decode steps only while no new image's prefill is "
        "in flight, which early launches would slow; mixed steps also beside one in the "
        "--prefill-sms partition); off",
        choices=LAUNCH_OVERLAP_MODES,
    )
    prefill_sm_carveout: int = option(
        _ENGINE.prefill_sm_carveout,
        G.PERFORMANCE,
        "SMs the image-prefix path's matrix products leave to the decode steps running beside "
        "it (CUDA; 0 = none): bounds how much a new image slows running streams, at the cost "
        "of a slower image path",
    )
    prefill_sms: str = option(
        "auto",
        G.PERFORMANCE,
        "SMs the whole image-prefix path may use while requests stream (a CUDA green "
        "context; 0 = all): every kernel of a new image stays off the other SMs, so running "
        "streams keep them, and new images wait longer. auto: 96 of an H100's 132 (the same "
        "share elsewhere, in groups of 8), none without green contexts or under 64 SMs "
        "(docs/performance.md)",
        parse=parse_prefill_sms,
    )
    prefill_sms_when_streaming: int = option(
        _ENGINE.prefill_sms_when_streaming,
        G.PERFORMANCE,
        "with a --prefill-sms partition: use it only while a running request still has at "
        "least this many tokens to stream, else give new images the whole GPU (0 = always "
        "partitioned)",
    )
