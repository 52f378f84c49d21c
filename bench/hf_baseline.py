"""Hugging Face transformers baselines on a decoder of moondream2's text size.

What a user would run instead of this server: ``PhiForCausalLM`` with moondream2's text
dimensions (hidden 2048, 24 layers, 32 heads, MLP 8192, vocab 51200, half the head dims
rotary), random weights, on a prompt of ``--prompt-len`` random tokens:

    dynamic   ``generate`` with the default dynamic cache
    static    ``generate`` with ``cache_implementation="static"``; on CUDA transformers
              compiles the decode step (torch.compile), reported as warm-up seconds apart
    batch     ``generate_batch`` (continuous batching, paged cache), when the installed
              transformers has it: N requests x T tokens, tokens/s and total seconds

Per decode step ms is (time for 1 + T new tokens - time for 1 new token) / T, so the prefill
drops out; "ms/token" divides the whole call by its tokens, prefill included. Every sequence
generates exactly its token budget (no end-of-sequence token is set).

    python -m bench.hf_baseline                 # CUDA, bf16, moondream2 text size
    python -m bench.hf_baseline --tiny          # small fp32 model on the CPU (smoke test)

transformers is not a dependency of the server: ``pip install -e '.[bench]'``. Writes
``hf_baseline.json`` and ``hf_baseline.png`` (default bench/results/<device>/) and prints a
table.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parent.parent

# moondream2's text decoder (preset "moondream2").
FULL_DIMS = {
    "hidden_size": 2048,
    "num_hidden_layers": 24,
    "num_attention_heads": 32,
    "intermediate_size": 8192,
    "vocab_size": 51200,
    "max_position_embeddings": 2048,
}
TINY_DIMS = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 256,
    "vocab_size": 1024,
    "max_position_embeddings": 512,
}


def build_model(tiny: bool, device: torch.device, dtype: torch.dtype) -> Any:
    """A randomly initialised PhiForCausalLM of the chosen size on ``device``."""
    from transformers import PhiConfig, PhiForCausalLM

    dims = TINY_DIMS if tiny else FULL_DIMS
    # No eos/bos: every sequence runs to its token budget, as the server benchmarks do.
    config = PhiConfig(
        **dims, partial_rotary_factor=0.5, eos_token_id=None, bos_token_id=None, pad_token_id=0
    )
    # A private RNG stream: the same weights every run, and the caller's RNG state untouched.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        with torch.device(device):
            model = PhiForCausalLM(config)
    model = model.to(dtype).eval().requires_grad_(False)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gen_config(new_tokens: int, **extra: Any) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        **extra,
    )


def timed_generate(model: Any, ids: torch.Tensor, new_tokens: int, **extra: Any) -> float:
    """Seconds for one ``generate`` call of ``new_tokens`` tokens per sequence."""
    mask = torch.ones_like(ids)
    _sync(ids.device)
    start = time.perf_counter()
    out = model.generate(
        input_ids=ids, attention_mask=mask, generation_config=_gen_config(new_tokens, **extra)
    )
    _sync(ids.device)
    elapsed = time.perf_counter() - start
    if out.shape[1] != ids.shape[1] + new_tokens:
        raise RuntimeError(f"generated {out.shape[1] - ids.shape[1]} tokens, not {new_tokens}")
    return elapsed


def generate_case(
    model: Any, ids: torch.Tensor, new_tokens: int, repeats: int, static: bool
) -> dict[str, Any]:
    """Decode step and per-token figures of ``generate`` at one batch size."""
    extra: dict[str, Any] = {}
    if static:
        extra["cache_implementation"] = "static"
        # One cache length for the long and the short call, so both reuse the shapes (and the
        # compiled graph) of the warm-up; releases without the option get the long call first,
        # after which transformers keeps the largest static cache length it has seen.
        from transformers import GenerationConfig

        if hasattr(GenerationConfig(), "max_cache_len"):
            extra["max_cache_len"] = ids.shape[1] + new_tokens + 1
    start = time.perf_counter()
    timed_generate(model, ids, new_tokens + 1, **extra)
    timed_generate(model, ids, new_tokens + 1, **extra)
    warmup = time.perf_counter() - start
    longs, shorts = [], []
    for _ in range(repeats):
        longs.append(timed_generate(model, ids, new_tokens + 1, **extra))
        shorts.append(timed_generate(model, ids, 1, **extra))
    steps = [(a - b) / new_tokens for a, b in zip(longs, shorts, strict=True)]
    return {
        "batch": ids.shape[0],
        "prompt_len": ids.shape[1],
        "new_tokens": new_tokens + 1,
        "warmup_s": warmup,
        "decode_step_ms": statistics.median(steps) * 1e3,
        "prefill_ms": statistics.median(shorts) * 1e3,
        "ms_per_token": statistics.median(longs) / (new_tokens + 1) * 1e3,
        "tokens_per_s": ids.shape[0] * (new_tokens + 1) / statistics.median(longs),
    }


def _supported_kwargs(fn: Callable[..., Any], **kwargs: Any) -> dict[str, Any]:
    """Only the keyword arguments ``fn`` declares (the API moves between releases)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def batch_case(
    model: Any, prompts: list[list[int]], new_tokens: int, runs: int, tiny: bool
) -> dict[str, Any]:
    """Continuous batching through ``generate_batch``; each run timed whole."""
    if not hasattr(model, "generate_batch"):
        return {
            "status": "unavailable",
            "reason": "this transformers has no generate_batch (continuous batching)",
        }
    from transformers import GenerationConfig

    gen = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    extra: dict[str, Any] = {}
    if tiny:
        # On the CPU the default cache sizing allocates for seconds; a small cache suffices.
        try:
            from transformers.generation.configuration_utils import ContinuousBatchingConfig

            extra = _supported_kwargs(
                model.generate_batch,
                continuous_batching_config=ContinuousBatchingConfig(
                    num_blocks=64, max_batch_tokens=512, page_size=16
                ),
            )
        except (ImportError, TypeError):
            extra = {}
    seconds, generated = [], []
    for _ in range(runs):
        _sync(model.device)
        start = time.perf_counter()
        out = model.generate_batch(prompts, generation_config=gen, **extra)
        _sync(model.device)
        seconds.append(time.perf_counter() - start)
        generated.append(sum(len(o.generated_tokens) for o in out.values()))
    return {
        "status": "ok",
        "requests": len(prompts),
        "prompt_len": len(prompts[0]),
        "new_tokens": new_tokens,
        "run_seconds": seconds,
        "generated_tokens": generated[-1],
        "total_s": seconds[-1],
        "tokens_per_s": generated[-1] / seconds[-1],
        "first_run_tokens_per_s": generated[0] / seconds[0],
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
    }


def plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.38
    for k, mode in enumerate(("dynamic", "static")):
        rows = [r for r in result.get(mode) or [] if "decode_step_ms" in r]
        xs = [i + (k - 0.5) * width for i in range(len(rows))]
        ax.bar(xs, [r["decode_step_ms"] for r in rows], width, label=f"{mode} cache")
        ax.set_xticks(range(len(rows)), [f"batch {r['batch']}" for r in rows])
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"transformers {result['transformers']} generate, {result['device']}", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="small fp32 model (CPU smoke test)")
    ap.add_argument("--device", default=None, help="default: cuda if present, else cpu")
    ap.add_argument(
        "--dtype",
        default=None,
        choices=["bf16", "fp32"],
        help="default bf16 on CUDA, fp32 on the CPU or with --tiny",
    )
    ap.add_argument(
        "--modes",
        nargs="+",
        default=["dynamic", "static", "batch"],
        choices=["dynamic", "static", "batch"],
    )
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="default 1 8")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 760 (tiny: 48)")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 64 (tiny: 8)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cb-requests", type=int, default=None, help="default 32 (tiny: 4)")
    ap.add_argument("--cb-tokens", type=int, default=None, help="default 64 (tiny: 8)")
    ap.add_argument("--cb-runs", type=int, default=2, help="first run includes set-up")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        import transformers
    except ImportError:
        print(
            "hf_baseline needs Hugging Face transformers, which the server does not: "
            "pip install 'transformers>=4.45' (or pip install -e '.[bench]')",
            file=sys.stderr,
        )
        return 2
    transformers.logging.set_verbosity_error()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype_name = args.dtype or ("fp32" if args.tiny or device.type == "cpu" else "bf16")
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    batches = args.batches or ([1, 2] if args.tiny else [1, 8])
    prompt_len = args.prompt_len or (48 if args.tiny else 760)
    new_tokens = args.new_tokens or (8 if args.tiny else 64)
    cb_requests = args.cb_requests or (4 if args.tiny else 32)
    cb_tokens = args.cb_tokens or (8 if args.tiny else 64)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"

    start = time.perf_counter()
    model = build_model(args.tiny, device, dtype)
    build_s = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def prompt(batch: int) -> torch.Tensor:
        # Ids above 100 keep clear of any special tokens.
        return torch.randint(100, vocab, (batch, prompt_len), generator=gen).to(device)

    result: dict[str, Any] = {
        "device": name,
        "dtype": dtype_name,
        "tiny": args.tiny,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "params": params,
        "dims": TINY_DIMS if args.tiny else FULL_DIMS,
        "build_s": build_s,
        "auto_compile": device.type == "cuda",
    }
    cases = [(m, b) for m in ("dynamic", "static") if m in args.modes for b in batches]
    out = args.out or REPO_ROOT / "bench" / "results" / name.replace(" ", "_")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "hf_baseline.json"

    def save() -> None:
        # After every case: a step cut short by a time limit keeps what it measured.
        path.write_text(json.dumps(result, indent=2))

    for mode, batch in tqdm(cases, desc="hf generate", unit="case"):
        try:
            row = generate_case(
                model, prompt(batch), new_tokens, args.repeats, static=mode == "static"
            )
        except Exception as err:  # a failing mode must not lose the others' figures
            row = {"batch": batch, "error": f"{type(err).__name__}: {err}"}
        result.setdefault(mode, []).append(row)
        save()
    if "batch" in args.modes:
        prompts = [prompt(1)[0].tolist() for _ in range(cb_requests)]
        try:
            result["batch"] = batch_case(model, prompts, cb_tokens, args.cb_runs, args.tiny)
        except Exception as err:
            result["batch"] = {"status": "failed", "reason": f"{type(err).__name__}: {err}"}
    save()
    print(
        f"\ntransformers {transformers.__version__}, PhiForCausalLM {params / 1e9:.2f} B "
        f"params, {dtype_name} on {name}, prompt {prompt_len} tokens"
    )
    print(
        f"{'path':>8} {'batch':>5} {'step ms':>8} {'ms/tok':>7} {'prefill':>8} "
        f"{'tok/s':>8} {'warm-up s':>9}"
    )
    for mode in ("dynamic", "static"):
        for r in result.get(mode, []):
            if "error" in r:
                print(f"{mode:>8} {r['batch']:>5}  failed: {r['error']}")
                continue
            print(
                f"{mode:>8} {r['batch']:>5} {r['decode_step_ms']:>8.2f} "
                f"{r['ms_per_token']:>7.2f} {r['prefill_ms']:>8.1f} "
                f"{r['tokens_per_s']:>8.1f} {r['warmup_s']:>9.1f}"
            )
    cb = result.get("batch")
    if cb is not None:
        if cb.get("status") == "ok":
            print(
                f"generate_batch: {cb['requests']} requests x {cb['new_tokens']} tokens: "
                f"{cb['tokens_per_s']:.1f} tokens/s, {cb['total_s']:.2f} s "
                f"(first run {cb['run_seconds'][0]:.2f} s)"
            )
        else:
            print(f"generate_batch: {cb['status']} ({cb.get('reason', '')})")
    png = out / "hf_baseline.png"
    wrote = plot(result, png) if any(m in result for m in ("dynamic", "static")) else False
    print(f"\nwrote {path}" + (f", {png}" if wrote else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
