"""Where a decode step's GPU time goes: per-kernel CUDA time of one eager decode forward
(torch.profiler), and graph-replay time per batch bucket, on a random moondream2-size model.

    python -m bench.profile_decode [--preset moondream2] [--batch 1 8 32] [--context 760]
    python -m bench.profile_decode --preset moondream3-preview --fp8-experts --also-prefix
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from decoding.mask_table import MaskTable
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.pages import PageAllocator
from vlm_server.engine.device.graphs import GraphSet
from vlm_server.engine.device.runtime import ModelRuntime
from vlm_server.models.capabilities import need
from vlm_server.models.registry import LoadedModel, preset, random_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="moondream2")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=760)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument(
        "--vision",
        action="store_true",
        help="time the vision tower (eager and graphed) per crop count instead",
    )
    ap.add_argument(
        "--prefix",
        action="store_true",
        help="profile the BOS + image forward of one image (eager) instead",
    )
    ap.add_argument(
        "--also-prefix",
        action="store_true",
        help="after the decode steps, profile the BOS + image forward too (one model build)",
    )
    ap.add_argument(
        "--fp8-experts",
        action="store_true",
        help="hold a mixture-of-experts model's expert weights in FP8 (as its checkpoints do)",
    )
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="time graph replays for attention variants instead of profiling",
    )
    args = ap.parse_args()
    rt, pages_per_row, loaded = decode_runtime(
        args.preset, args.fp8_experts, max(args.batch), args.context
    )
    if args.sweep:
        sweep(rt, args)
        return
    if args.vision:
        vision(rt, loaded.config.vision)
        return
    if args.prefix:
        prefix(rt, args)
        return
    decode(rt, args, pages_per_row)
    if args.also_prefix:
        prefix(rt, args)


def decode_runtime(
    preset_name: str, fp8_experts: bool, rows: int, context: int
) -> tuple[ModelRuntime, int, LoadedModel]:
    """A runtime over a random ``preset_name`` model in bf16 on CUDA (its experts in FP8 where
    asked), whose first ``rows`` rows each hold pages for ``context`` positions; also the
    pages per row and the loaded model."""
    loaded = random_model(preset(preset_name), dtype=torch.bfloat16, device="cuda")
    if fp8_experts:
        need(loaded.model.capabilities.fp8_experts, "fp8_experts", loaded.model).use_fp8_experts()
    # Few and small mixed-step and prefix graphs: these probes replay decode graphs only.
    cfg = EngineConfig(
        max_batch_size=rows, kv_budget_bytes=8 << 30, max_step_tokens=rows + 64,
        max_prefill_batch=1,
    )  # fmt: skip
    rt = ModelRuntime(loaded.model, cfg, MaskTable(loaded.config.text.vocab_size, 4))
    mirror = rt.block_table
    pages = PageAllocator(
        rt.kv_pages, cfg.page_size, cfg.max_rows, mirror.shape[1], block_table=mirror
    )
    pages_per_row = -(-context // cfg.page_size) + 1
    for row in range(rows):
        pages.assign(row, pages.allocate(pages_per_row))
    rt.pool.block_dev.copy_(rt.pool.block_host)
    return rt, pages_per_row, loaded


def prefix(rt: ModelRuntime, args: argparse.Namespace) -> None:
    """The BOS + image forward of one image, eager, kernel by kernel."""
    with torch.inference_mode():
        for _ in range(2):
            rt.prefill.prefix_forward(0, 1)
        torch.cuda.synchronize()
        eager = _ms(lambda: rt.prefill.prefix_forward(0, 1))
        print(f"BOS + image forward, eager: median {eager:.3f} ms")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            rt.prefill.prefix_forward(0, 1)
            torch.cuda.synchronize()
    print("\n=== BOS + image forward, one image: eager kernels ===")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top))


def decode(rt: ModelRuntime, args: argparse.Namespace, pages_per_row: int) -> None:
    """Each batch's decode forward, eager kernel by kernel, and its graph replay."""
    rt.capture_graphs(progress=False)
    for b in args.batch:
        buf = rt.buffers.slots[0]
        buf.launch_dev[:b, 0] = torch.arange(b)
        buf.launch_dev[:b, 1] = args.context
        with torch.cuda.stream(rt.dev.compute_stream):
            for _ in range(3):
                rt.steps.decode_forward(buf, b, pages_per_row)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            with torch.cuda.stream(rt.dev.compute_stream):
                rt.steps.decode_forward(buf, b, pages_per_row)
            torch.cuda.synchronize()
        print(f"\n=== batch {b}, context {args.context}: eager forward kernels ===")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top))
        if (0, b) in rt.steps.decode_graphs:
            print(f"graph replay, batch {b}: median {_replay_ms(rt, b):.3f} ms")


def _replay_ms(rt: ModelRuntime, b: int) -> float:
    times = []
    for _ in range(50):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(rt.dev.compute_stream)
        with torch.cuda.stream(rt.dev.compute_stream):
            rt.steps.decode_graphs.replay((0, b))
        e.record(rt.dev.compute_stream)
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def _ms(fn: object, iters: int = 20) -> float:
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()  # type: ignore[operator]
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def vision(rt: ModelRuntime, vc: object) -> None:
    """The vision tower per crop count (eager), and the whole image path per tiling (uint8
    crops to BOS + image embeddings) eager and graph-replayed. ``vc``: the vision config."""
    rt.capture_vision_graphs(progress=False)
    entry, prefill = rt.entry, rt.prefill
    size = vc.crop_size  # type: ignore[attr-defined]
    print(f"{'crops':>5} {'tower ms':>9} {'path eager':>11} {'path graph':>11}")
    for tiling in ((1, 1), (2, 2), (2, 4), (3, 4)):
        n = 1 + tiling[0] * tiling[1]
        x = torch.randn(n, 3, size, size, device="cuda", dtype=entry.dtype)
        u8 = torch.randint(0, 256, (n, size, size, 3), dtype=torch.uint8)
        u8 = u8.to("cuda")
        with torch.inference_mode():
            tower = _ms(lambda x=x: entry.vision_encode(x))
            eager = _ms(lambda u=u8, t=tiling: prefill.image_embedding(u, t))
            prefill.image_inputs[n].copy_(u8)
            graphed = _ms(lambda t=tiling: prefill.image_graphs.replay(t))
        print(f"{n:>5} {tower:>9.3f} {eager:>11.3f} {graphed:>11.3f}", flush=True)
    x = torch.randn(9, 3, size, size, device="cuda", dtype=entry.dtype)
    with torch.inference_mode():
        entry.vision_encode(x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            entry.vision_encode(x)
            torch.cuda.synchronize()
    print("\n=== vision tower, 9 crops: eager kernels ===")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    attention_backends(rt, vc)


def attention_backends(rt: ModelRuntime, vc: object) -> None:
    """The tower's attention alone (9 crops), per SDPA backend."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads = vc.enc_n_heads  # type: ignore[attr-defined]
    hd = vc.enc_dim // heads  # type: ignore[attr-defined]
    q, k, v = (
        torch.randn(9, heads, vc.n_patches, hd, device="cuda", dtype=rt.entry.dtype)  # type: ignore[attr-defined]
        for _ in range(3)
    )
    print(f"\nattention [9, {heads}, {vc.n_patches}, {hd}]:")  # type: ignore[attr-defined]
    for backend in (
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.MATH,
    ):
        try:
            with sdpa_kernel([backend]), torch.inference_mode():
                ms = _ms(lambda: F.scaled_dot_product_attention(q, k, v))
            layers = vc.enc_n_layers  # type: ignore[attr-defined]
            print(f"  {backend.name:<20} {ms:.3f} ms (x{layers} layers: {layers * ms:.2f} ms)")
        except RuntimeError as err:
            print(f"  {backend.name:<20} unavailable: {str(err).splitlines()[0][:80]}")


def sweep(rt: ModelRuntime, args: argparse.Namespace) -> None:
    """Graph-replay time of the decode forward for attention split targets and block sizes."""
    from vlm_server.engine.device.kernels import triton_attention as ta

    original = ta.paged_decode_attention
    print(f"{'target':>6} {'block_n':>7} " + " ".join(f"{'b' + str(b):>7}" for b in args.batch))
    for target in (512, 2048, 4096):
        for block_n in (32, 64, 128):

            def variant(
                *a: object, _t: int = target, _n: int = block_n, **k: object
            ) -> torch.Tensor:
                splits = ta.split_count(a[0].shape[0], a[0].shape[1], _t)
                return original(*a, block_n=_n, splits=splits)

            ta.paged_decode_attention = variant
            rt.steps.decode_graphs = GraphSet("decode")
            rt.capture_graphs(progress=False)
            for b in args.batch:
                buf = rt.buffers.slots[0]
                buf.launch_dev[:b, 0] = torch.arange(b)
                buf.launch_dev[:b, 1] = args.context
            times = [_replay_ms(rt, b) for b in args.batch]
            print(f"{target:>6} {block_n:>7} " + " ".join(f"{t:>7.3f}" for t in times), flush=True)
    ta.paged_decode_attention = original


if __name__ == "__main__":
    main()
