"""Image pipeline alone: decode + resize/crop (`ImagePreparer`) and normalize, per size,
format, resize mode and thread count.

Each cell runs ``threads`` workers of a ThreadPoolExecutor, each preparing generated pictures
back to back for at least ``--min-seconds`` (and ``--min-calls`` per worker), as the server's
decode threads do. Reports images/s over the wall time and, per image (medians): wall ms,
host CPU ms of the worker thread (decode, hash, and the resize on the CPU or its launches on
a GPU), device ms of upload + resize + crop (CUDA only, from events; src ms: the part until
the pixels are on the device, the upload or the GPU decode; sm ms, one thread only: the time
kernels ran on the SMs, from the profiler, without the gaps where the device waited for the
host's launches or for the JPEG engines), and normalize ms.
``--device cuda`` makes the crops on the GPU as a CUDA server does (the default where CUDA
exists); ``--normalize-device none`` skips normalization; ``--exif-orientation 6`` tags the
JPEGs as phone portrait photos, which the decoder turns upright. ``--gpu-decode-min-pixels N``
decodes JPEGs of at least N pixels on the GPU (``--gpu-decoder``: the JPEG engines through
nvImageCodec or nvJPEG through torchvision, as the server's ``--image-gpu-decode-min-pixels``
and ``--image-gpu-decoder``): the cpu ms column is then the host's whole share.
``--split`` measures the path with an engine process: cpu ms is the server's share (decode
into a pooled shared buffer, hash), eng ms the engine's host share (staging copy, crop
launches), gpu ms the crops on the device; with ``--gpu-decode-min-pixels`` the server's
share is the header checks, the key and the copy of the encoded bytes into shared memory,
and the engine's the GPU decode and crops (``--image-gpu-decode-min-pixels`` with an engine
process).

    python -m bench.image_bench
    python -m bench.image_bench --sizes 800x600 4000x3000 --formats jpeg --threads 1 4
    python -m bench.image_bench --device cuda --resize vips pillow --normalize-device cuda
    python -m bench.image_bench --sizes 800x600 4000x3000 --gpu-decode-min-pixels 4000000
    python -m bench.image_bench --sizes 800x600 4000x3000 --gpu-decode-min-pixels 1 \
        --gpu-decoder nvimgcodec
    python -m bench.image_bench --device cuda --sizes 800x600 --formats jpeg --split
    python -m bench.image_bench --device cuda --sizes 800x600 4000x3000 --formats jpeg --split \
        --gpu-decode-min-pixels 1 --gpu-decoder nvimgcodec

Writes ``image_bench.json`` and ``image_bench.png`` (default bench/results/<device>/) and
prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from bench.synth_images import parse_size, unique_images, with_orientation
from image_pipeline import (
    EncodedImage,
    HostImage,
    ImageLimits,
    ImagePreparer,
    ResizeMode,
    content_hash,
    decode,
    normalize_crops,
    resample,
)
from image_pipeline.crop_graphs import CropGraphs
from image_pipeline.decode import read_header
from image_pipeline.gpu_jpeg import GPU_DECODERS, GpuDecoder, gpu_decoder
from vlm_server.engine.process.shared_pixels import pixel_pool, share

REPO_ROOT = Path(__file__).resolve().parent.parent
# Generous limits: the benchmark measures the pipeline, not the server's input policy.
LIMITS = ImageLimits(
    max_image_bytes=512 << 20,
    max_image_pixels=200_000_000,
    max_image_side=None,
    max_image_pixels_per_byte=None,
)


def run_cell(
    images: Sequence[bytes],
    threads: int,
    min_seconds: float,
    min_calls: int,
    norm_device: str | None,
    dtype: torch.dtype,
    resize: ResizeMode,
    device: str,
    *,
    gpu_decode_min_pixels: int = 0,
    gpu_decoder: GpuDecoder | None = None,
    split: bool = False,
    crop_graphs: int = 0,
    sm_calls: int = 8,
) -> dict[str, Any]:
    """``threads`` workers preparing ``images`` in turn; images/s and per-image medians.

    ``gpu_decode_min_pixels``/``gpu_decoder`` as in :class:`ImagePreparer`. ``split``: the
    path with an engine process: the server's share (header, decode into a pooled shared
    buffer, hash: ``cpu_ms``), then the engine's (staging copy and crop launches:
    ``engine_cpu_ms``; the device's work: ``gpu_ms``), with ``crop_graphs`` picture sizes
    kept as CUDA graphs as the engine does (``--crop-graph-sizes``). ``sm_calls``: images
    prepared under the profiler afterwards, for ``sm_ms`` (one thread on CUDA; 0: not)."""
    lock = threading.Lock()
    prep_ms: list[float] = []
    cpu_ms: list[float] = []
    gpu_ms: list[float] = []
    norm_ms: list[float] = []
    crops: list[int] = []
    engine_cpu_ms: list[float] = []
    sync = norm_device is not None and norm_device.startswith("cuda")
    shared = pixel_pool()
    on_cuda = torch.device(device).type == "cuda"

    source_ms: list[float] = []

    def on_device_time(ms: float) -> None:
        with lock:
            gpu_ms.append(ms)

    def on_source_time(ms: float) -> None:
        with lock:
            source_ms.append(ms)

    preparer = ImagePreparer(
        LIMITS,
        resize=resize,
        device=device,
        gpu_decode_min_pixels=gpu_decode_min_pixels,
        gpu_decoder=gpu_decoder,
        on_device_time=on_device_time,
        on_source_time=on_source_time,
    )
    per_thread = threading.local()

    def crop_maker() -> Callable[[HostImage], torch.Tensor]:
        if not (on_cuda and crop_graphs):
            return preparer.crops_of
        graphs = getattr(per_thread, "graphs", None)
        if graphs is None:
            graphs = per_thread.graphs = CropGraphs(preparer, crop_graphs)
        return graphs.crops

    # The pictures of a cell share size and format: the first says which path they take.
    on_gpu = preparer.decodes_on_gpu(read_header(images[0], LIMITS))

    def engine_share(host: HostImage) -> torch.Tensor:
        """What the engine process does with a host-decoded image (CUDA: on a stream of this
        thread, waited for and timed)."""
        e0 = time.thread_time()
        if not on_cuda:
            made = preparer.crops_of(host)
            with lock:
                engine_cpu_ms.append((time.thread_time() - e0) * 1e3)
            return made
        start = torch.cuda.Event(enable_timing=True)
        done = torch.cuda.Event(enable_timing=True, blocking=True)
        with torch.cuda.stream(preparer._stream()):
            start.record()
            made = crop_maker()(host)
            done.record()
        e1 = time.thread_time()
        done.synchronize()
        with lock:
            engine_cpu_ms.append((e1 - e0) * 1e3)
            gpu_ms.append(start.elapsed_time(done))
        return made

    def engine_decodes(encoded: EncodedImage) -> torch.Tensor:
        """What the engine process does with a JPEG left encoded: decode and crop it (its
        device work is timed inside, as for the whole path)."""
        e0 = time.thread_time()
        made = preparer.prepare_encoded(encoded).crops
        with lock:
            engine_cpu_ms.append((time.thread_time() - e0) * 1e3)
        return made

    def crops_of(data: bytes) -> tuple[torch.Tensor, int, float]:
        """The crops, their count, and the thread's CPU ms for the host's share."""
        c0 = time.thread_time()
        if split and on_gpu:
            # The server's share: header checks, the key, the bytes into shared memory.
            encoded = preparer.encoded(data, gpu_decode_min_pixels)
            assert encoded is not None  # the cell's pictures all take the same path
            held = dataclasses.replace(encoded, data=share(np.frombuffer(data, np.uint8), shared))
            c1 = time.thread_time()
            return engine_decodes(held), held.num_crops, (c1 - c0) * 1e3
        if split:
            host = preparer.decode_host(data, alloc=shared.array)
            c1 = time.thread_time()
            return engine_share(host), host.num_crops, (c1 - c0) * 1e3
        prepared = preparer.prepare(data)
        return prepared.crops, prepared.num_crops, (time.thread_time() - c0) * 1e3

    def one(data: bytes) -> tuple[float, float, float, int]:
        t0 = time.perf_counter()
        made, n_crops, c_ms = crops_of(data)
        t1 = time.perf_counter()
        if norm_device is not None:
            normalize_crops(made, dtype=dtype, device=norm_device)
            if sync:
                torch.cuda.synchronize()
        return ((t1 - t0) * 1e3, c_ms, (time.perf_counter() - t1) * 1e3, n_crops)

    def worker(k: int, deadline: float) -> int:
        done = 0
        while done < min_calls or time.perf_counter() < deadline:
            p, c, n, k_crops = one(images[(k + done * threads) % len(images)])
            done += 1
            with lock:
                prep_ms.append(p)
                cpu_ms.append(c)
                norm_ms.append(n)
                crops.append(k_crops)
        return done

    # The host's share that stays on the CPU when crops are made on a GPU: header, decode,
    # hash (one thread, back to back). Not measured for GPU-decoded pictures: there cpu_ms
    # is that share, decode call included.
    decode_cpu: list[float] = []
    for data in images if not on_gpu else ():
        c0 = time.thread_time()
        decoded = decode(data, LIMITS, target=preparer._canvas_for)
        content_hash(decoded.pixels, (decoded.height, decoded.width))
        decode_cpu.append((time.thread_time() - c0) * 1e3)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, images[:threads]))  # warm-up: codecs, weights, allocator, kernels
        with lock:
            gpu_ms.clear()
            source_ms.clear()
            engine_cpu_ms.clear()
        start = time.perf_counter()
        calls = sum(pool.map(worker, range(threads), [start + min_seconds] * threads))
        wall = time.perf_counter() - start
        sm_ms = None
        if on_cuda and threads == 1 and sm_calls > 0:
            # On the worker's thread (its stream, its crop graphs); these calls report device
            # times too, which the medians below must not see.
            with lock:
                timed = list(gpu_ms), list(source_ms), list(engine_cpu_ms)
            sm_ms = pool.submit(
                kernel_ms, lambda k: crops_of(images[k % len(images)]), sm_calls
            ).result()
            gpu_ms[:], source_ms[:], engine_cpu_ms[:] = timed
    total = [p + n for p, n in zip(prep_ms, norm_ms, strict=True)]
    return {
        "threads": threads,
        "calls": calls,
        "wall_s": wall,
        "images_per_s": calls / wall,
        "ms_per_image": statistics.median(total),
        "prepare_ms": statistics.median(prep_ms),
        "cpu_ms": statistics.median(cpu_ms),
        "decode_cpu_ms": statistics.median(decode_cpu) if decode_cpu else None,
        "split": split,
        "crop_graphs": crop_graphs if split and on_cuda else 0,
        "engine_cpu_ms": statistics.median(engine_cpu_ms) if engine_cpu_ms else None,
        "gpu_decode": on_gpu,
        "gpu_ms": statistics.median(gpu_ms) if gpu_ms else None,
        # Of gpu_ms, until the pixels are on the device: the upload, or the GPU decode.
        "source_ms": statistics.median(source_ms) if source_ms else None,
        # Of gpu_ms, the SMs' share: kernels only, per image (one thread).
        "sm_ms": sm_ms,
        "normalize_ms": statistics.median(norm_ms) if norm_device is not None else None,
        "crops": statistics.median(crops),
    }


def kernel_ms(work: Callable[[int], object], calls: int) -> float:
    """Milliseconds per call that CUDA kernels ran, with ``work(k)`` called ``calls`` times
    under the profiler: the union of the kernels' intervals (copies and the JPEG engines'
    decode are not kernels), so launch gaps and waits do not count."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for k in range(calls):
            work(k)
        torch.cuda.synchronize()
    spans = [
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
        and not e.name.startswith(("Memcpy", "Memset"))
    ]
    return busy_us(spans) / 1e3 / calls


def busy_us(spans: Sequence[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total = 0.0
    end = -math.inf
    for s, e in sorted(spans):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def device_label(norm_device: str | None) -> str:
    if norm_device is not None and norm_device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(norm_device))
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "cpu"


def plot(rows: Sequence[dict[str, Any]], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in dict.fromkeys((r["size"], r["format"], r["resize"]) for r in rows):
        pts = sorted(
            (r["threads"], r["images_per_s"])
            for r in rows
            if (r["size"], r["format"], r["resize"]) == key
        )
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            "o-" if key[1] == "jpeg" else "s--",
            label=" ".join(key),
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("threads")
    ax.set_ylabel("images/s")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["640x480", "800x600", "1920x1080", "4000x3000"])
    ap.add_argument("--formats", nargs="+", default=["jpeg", "png"], choices=["jpeg", "png"])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--images", type=int, default=8, help="distinct pictures per size/format")
    ap.add_argument("--min-seconds", type=float, default=1.0, help="per cell")
    ap.add_argument("--min-calls", type=int, default=2, help="per worker and cell")
    ap.add_argument(
        "--sm-calls",
        type=int,
        default=8,
        metavar="N",
        help="one-thread cells on CUDA: images prepared under the profiler for the sm ms "
        "column (kernel time alone); 0: skip",
    )
    ap.add_argument(
        "--normalize-device", default="cpu", help="cpu, cuda[:N] or none (skip normalization)"
    )
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--resize", nargs="+", default=["vips"], choices=[m.value for m in ResizeMode])
    ap.add_argument(
        "--device",
        default=None,
        help="where crops are made: cpu or cuda[:N] (default: cuda where present)",
    )
    ap.add_argument(
        "--exif-orientation",
        type=int,
        default=1,
        choices=range(1, 9),
        metavar="1..8",
        help="EXIF orientation tag of the JPEG pictures (6: a phone's portrait photo, turned "
        "on decoding)",
    )
    ap.add_argument(
        "--gpu-decode-min-pixels",
        type=int,
        default=0,
        metavar="N",
        help="decode JPEGs of at least N pixels on the GPU (needs --device cuda); 0: off",
    )
    ap.add_argument(
        "--gpu-decoder",
        choices=GPU_DECODERS,
        default="auto",
        help="with --gpu-decode-min-pixels: nvimgcodec (the JPEG engines), torchvision "
        "(nvJPEG on the SMs), auto (the first that works)",
    )
    ap.add_argument(
        "--crop-graphs",
        type=int,
        default=4,
        metavar="N",
        help="with --split on CUDA: picture sizes kept as crop graphs, as the engine does "
        "(--crop-graph-sizes); 0: eager crops",
    )
    ap.add_argument(
        "--split",
        action="store_true",
        help="the path with an engine process: the server decodes into shared memory (cpu ms), "
        "the engine makes the crops (eng ms of CPU, gpu ms)",
    )
    ap.add_argument(
        "--resample-products",
        default="half",
        choices=["half", "fp32"],
        help="on CUDA: resize stages as float16 products where exact (the default), or all in "
        "float32 (image_pipeline.resample.HALF_PRODUCTS)",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    norm = None if args.normalize_device == "none" else args.normalize_device
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    decoder: GpuDecoder | None = None
    if args.gpu_decode_min_pixels < 0:
        ap.error("--gpu-decode-min-pixels must be >= 0")
    if args.gpu_decode_min_pixels > 0:
        # Measuring the host path while asking for the GPU one would mislead: refuse.
        if not args.device.startswith("cuda"):
            ap.error("--gpu-decode-min-pixels needs --device cuda")
        try:
            decoder = gpu_decoder(torch.device(args.device), args.gpu_decoder)
        except RuntimeError as err:
            ap.error(f"--gpu-decode-min-pixels: {err}")
    previous_threads, previous_products = torch.get_num_threads(), resample.HALF_PRODUCTS
    resample.HALF_PRODUCTS = args.resample_products == "half"
    if norm == "cpu" or args.device == "cpu":
        # One intra-op thread per worker: otherwise torch's own pool oversubscribes the cores
        # and the thread-count axis stops meaning anything.
        torch.set_num_threads(1)
    try:
        return _run(args, norm, dtype, decoder)
    finally:
        torch.set_num_threads(previous_threads)
        resample.HALF_PRODUCTS = previous_products


def _run(
    args: argparse.Namespace, norm: str | None, dtype: torch.dtype, decoder: GpuDecoder | None
) -> int:
    """Generate the pictures, measure every cell, write and print the results."""
    name = device_label(norm)
    cores = os.cpu_count() or 1
    gen_threads = min(8, cores)
    rows: list[dict[str, Any]] = []
    cells = [(s, f) for s in args.sizes for f in args.formats]
    total = len(cells) * len(args.resize) * len(args.threads)
    bar = tqdm(total=total, desc="image bench", unit="cell")
    for size_text, fmt in cells:
        w, h = parse_size(size_text)
        images = unique_images(w, h, range(args.images), fmt=fmt, threads=gen_threads)
        if fmt == "jpeg" and args.exif_orientation != 1:
            images = [with_orientation(data, args.exif_orientation) for data in images]
        mean_bytes = sum(map(len, images)) / len(images)
        for mode in args.resize:
            for threads in args.threads:
                cell = run_cell(
                    images,
                    threads,
                    args.min_seconds,
                    args.min_calls,
                    norm,
                    dtype,
                    ResizeMode(mode),
                    args.device,
                    gpu_decode_min_pixels=args.gpu_decode_min_pixels,
                    gpu_decoder=decoder,
                    split=args.split,
                    crop_graphs=args.crop_graphs,
                    sm_calls=args.sm_calls,
                )
                rows.append(
                    {"size": f"{w}x{h}", "format": fmt, "resize": mode, "bytes": mean_bytes} | cell
                )
                bar.update(1)
    bar.close()
    out = args.out or REPO_ROOT / "bench" / "results" / name.replace(" ", "_")
    out.mkdir(parents=True, exist_ok=True)
    cpu_name = _cpu_model()
    result = {
        "device": name,
        "cpu": cpu_name,
        "cpu_count": cores,
        "image_device": args.device,
        "normalize_device": args.normalize_device,
        "dtype": args.dtype,
        "exif_orientation": args.exif_orientation,
        "gpu_decode_min_pixels": args.gpu_decode_min_pixels,
        "gpu_decoder": args.gpu_decoder if args.gpu_decode_min_pixels else None,
        "split": args.split,
        "resample_products": args.resample_products,
        "torch_threads": torch.get_num_threads(),
        "rows": rows,
    }
    path = out / "image_bench.json"
    path.write_text(json.dumps(result, indent=2))
    print(
        f"\nimage pipeline on {cpu_name} ({cores} cores), crops on {args.device}, normalize "
        f"on {args.normalize_device} {args.dtype}"
        + (f", JPEG EXIF orientation {args.exif_orientation}" if args.exif_orientation != 1 else "")
        + (
            f", JPEGs from {args.gpu_decode_min_pixels} pixels decoded on the GPU"
            f" ({args.gpu_decoder})"
            if args.gpu_decode_min_pixels
            else ""
        )
        + (", split as with an engine process" if args.split else "")
        + (
            f" ({args.crop_graphs} crop graphs)"
            if args.split and args.device.startswith("cuda")
            else ""
        )
    )
    print(
        f"{'size':>10} {'fmt':>5} {'dec':>4} {'resize':>6} {'KB':>7} {'crops':>5} {'thr':>4} "
        f"{'img/s':>8} {'ms/img':>8} {'prep ms':>8} {'cpu ms':>8} {'dec ms':>7} {'eng ms':>7} "
        f"{'gpu ms':>8} {'src ms':>7} {'sm ms':>7} {'norm ms':>8}"
    )
    for r in rows:
        print(
            f"{r['size']:>10} {r['format']:>5} {'gpu' if r['gpu_decode'] else 'host':>4} "
            f"{r['resize']:>6} {r['bytes'] / 1024:>7.0f} "
            f"{r['crops']:>5.0f} {r['threads']:>4} {r['images_per_s']:>8.1f} "
            f"{r['ms_per_image']:>8.2f} {r['prepare_ms']:>8.2f} {r['cpu_ms']:>8.2f} "
            f"{_fmt(r['decode_cpu_ms'], '7.2f'):>7} {_fmt(r['engine_cpu_ms'], '7.2f'):>7} "
            f"{_fmt(r['gpu_ms'], '8.3f'):>8} {_fmt(r['source_ms'], '7.3f'):>7} "
            f"{_fmt(r['sm_ms'], '7.3f'):>7} {_fmt(r['normalize_ms'], '8.2f'):>8}"
        )
    png = out / "image_bench.png"
    wrote = plot(rows, png, f"image pipeline, {cpu_name}")
    print(f"\nwrote {path}" + (f", {png}" if wrote else ""))
    return 0


def _cpu_model() -> str:
    """The CPU's model name where the platform tells it (Linux), else the architecture."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.machine() or "cpu"


if __name__ == "__main__":
    sys.exit(main())
