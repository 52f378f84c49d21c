"""Where an adapter batch's decode time goes, block by block: the fused decode products of
every layer of a Moondream 2-size decoder (attention left out) with and without adapter
deltas, each captured in a CUDA graph and replayed, then the CUDA time of every kernel.

    python -m bench.lora_block_probe --rows 32 --adapters 8 --rank 32

Cases: ``off`` (the block's products and norm, no adapters) and one per ``--variants`` entry:
a `products.FC2_SHRINK` value, then optional knobs, e.g. ``apart,step=0,bn=64,st=4`` (``step=0``:
the per-slot kernels of models/common/lora_kernel.py instead of the decode step's; their
expand's columns per program ``bn`` and warps ``w``, their shrink's stages ``st`` and most
splits ``sp``; the step kernels' ``p`` expand programs, ``sw`` warps, ``sst`` shrink stages).
Prints the time per layer of each case, its excess over ``off``, each adapter launch timed
alone (a graph of that launch for every layer), and per kernel the mean CUDA time per layer;
writes ``lora_block_probe.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from vlm_server.models.common import fused_products, lora_kernel, lora_step
from vlm_server.models.common.layers import LayerNorm
from vlm_server.models.lora import products
from vlm_server.models.lora.bank import LoraBank, LoraBatch
from vlm_server.models.lora.spec import LoraTargets

DIM, QKV, FF = 2048, 6144, 8192


def _blocks(layers: int) -> tuple[list[fused_products.BlockProducts], list[LayerNorm]]:
    prods, norms = [], []
    for _ in range(layers):
        lin = [nn.Linear(i, o, dtype=torch.bfloat16, device="cuda") for i, o in
               ((DIM, QKV), (DIM, FF), (DIM, DIM), (FF, DIM))]  # fmt: skip
        prods.append(fused_products.stack_block(*lin))
        norms.append(LayerNorm(DIM).to("cuda", torch.bfloat16))
    return prods, norms


def _lora(layers: int, rows: int, adapters: int, rank: int) -> LoraBatch:
    targets = LoraTargets(
        layers,
        {"qkv": (DIM, QKV), "proj": (DIM, DIM), "fc1": (DIM, FF), "fc2": (FF, DIM)},
        shared=(("qkv", "proj", "fc1"),),
    )
    bank = LoraBank(targets, adapters, rank, torch.bfloat16, "cuda")
    bank.flat.normal_(0, 0.02)
    index = (torch.arange(rows, device="cuda", dtype=torch.int32) % adapters).contiguous()
    return LoraBatch(bank, index)


def _forward(
    prods: list[fused_products.BlockProducts],
    norms: list[LayerNorm],
    lora: LoraBatch | None,
    x: torch.Tensor,
    attn: torch.Tensor,
) -> Callable[[], None]:
    def run() -> None:
        h, r = norms[0](x), x
        for i, prod in enumerate(prods):
            if lora is None:
                _, hidden = prod.qkv_and_hidden(h)
                parts, delta = prod.branch_parts(attn, hidden), None
            else:
                _, hidden, shrinks = products.block_inputs(prod, lora, i, h)
                parts, delta = products.branch_and_delta(prod, lora, i, attn, hidden, shrinks)
            r, h = prod.add_parts_and_norm(r, parts, norms[(i + 1) % len(norms)], delta)

    return run


# knob: (module, name); "step=0" runs the per-slot kernels where the step's would run.
KNOBS = {
    "bn": (lora_kernel, "EXPAND_BLOCK_N"),
    "w": (lora_kernel, "EXPAND_WARPS"),
    "st": (lora_kernel, "STAGES"),
    "sp": (lora_kernel, "SPLITS_MAX"),
    "p": (lora_step, "PROGRAMS"),
    "sw": (lora_step, "WARPS"),
    "sst": (lora_step, "STAGES"),
}
DEFAULTS = {(m, name): getattr(m, name) for m, name in KNOBS.values()}


def _set(variant: str, lora: LoraBatch) -> None:
    where, *knobs = variant.split(",")
    products.FC2_SHRINK = where  # type: ignore[assignment]
    for (module, name), value in DEFAULTS.items():
        setattr(module, name, value)
    lora.step = lora_step
    for knob in knobs:
        key, value = knob.split("=")
        if key == "step":
            lora.step = lora_step if int(value) else None
            continue
        module, name = KNOBS[key]
        setattr(module, name, int(value))


def _pieces(
    prods: list[fused_products.BlockProducts],
    lora: LoraBatch,
    h: torch.Tensor,
    attn: torch.Tensor,
    reps: int,
) -> dict[str, float]:
    """Each launch of the `apart` path alone, us per layer: its inputs made first, then a
    graph of that launch for every layer."""
    per_layer = []
    for i, prod in enumerate(prods):
        fold = lora.shrink_weights(i, products.SHARED)
        assert fold is not None
        qkv, fc1, sums = prod.qkv_and_fc1_shrunk(h, fold[1])
        shared = lora.shrunk(h, fold[0], sums)
        qkv, hidden = lora.expand(i, [(shared, "qkv", qkv), (shared, "fc1", fc1)], True)
        fc2 = lora.shrink(i, hidden, ("fc2",))
        parts = prod.branch_parts(attn, hidden)
        per_layer.append((prod, fold, qkv, fc1, shared, hidden, fc2, parts))
    launches: dict[str, Callable[[int], object]] = {
        "product+shrink": lambda i: per_layer[i][0].qkv_and_fc1_shrunk(h, per_layer[i][1][1]),
        "product": lambda i: per_layer[i][0].qkv_and_fc1(h),
        "expand qkv,fc1": lambda i: lora.expand(
            i, [(per_layer[i][4], t, per_layer[i][j]) for t, j in (("qkv", 2), ("fc1", 3))], True
        ),
        "shrink fc2": lambda i: lora.shrink(i, per_layer[i][5], ("fc2",)),
        "branch": lambda i: per_layer[i][0].branch_parts(attn, per_layer[i][5]),
        "expand proj+fc2": lambda i: lora.expand_sum(
            i, [(per_layer[i][4], "proj"), (per_layer[i][6], "fc2")], per_layer[i][7][0]
        ),
    }
    out = {}
    for name, launch in launches.items():

        def run(launch: Callable[[int], object] = launch) -> None:
            for i in range(len(prods)):
                launch(i)

        out[name] = _time(_graph(run), reps) * 1000 / len(prods)
    return out


def _graph(run: Callable[[], None]) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile and warm outside the capture
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


def _time(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()  # the timing needs the replays done
    return start.elapsed_time(end) / reps


def _kernels(graph: torch.cuda.CUDAGraph, reps: int, layers: int) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    per = {}
    for ev in prof.key_averages():
        us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        if us > 0:
            per[ev.key[:60]] = us / reps / layers
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--variants", nargs="+", default=["apart", "branch", "expand"])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    prods, norms = _blocks(args.layers)
    lora = _lora(args.layers, args.rows, args.adapters, args.rank)
    x = torch.randn(args.rows, DIM, device="cuda", dtype=torch.bfloat16)
    attn = torch.randn(args.rows, DIM, device="cuda", dtype=torch.bfloat16)
    cases: dict[str, LoraBatch | None] = {"off": None} | {v: lora for v in args.variants}
    times: dict[str, float] = {}
    kernels: dict[str, dict[str, float]] = {}
    pieces: dict[str, dict[str, float]] = {}
    h = norms[0](x)
    for case, batch in cases.items():
        if batch is not None:
            _set(case, batch)
            if case.startswith("apart"):
                pieces[case] = _pieces(prods, batch, h, attn, args.reps)
        graph = _graph(_forward(prods, norms, batch, x, attn))
        times[case] = _time(graph, args.reps) * 1000 / args.layers
        kernels[case] = _kernels(graph, 10, args.layers)
    gpu = torch.cuda.get_device_name()
    out = args.out or Path("bench/results") / gpu.replace(" ", "_")
    out.mkdir(parents=True, exist_ok=True)
    result = {"device": gpu, "settings": vars(args) | {"out": None}, "us_per_layer": times,
              "kernels_us_per_layer": kernels, "launches_alone_us_per_layer": pieces}  # fmt: skip
    (out / "lora_block_probe.json").write_text(json.dumps(result, indent=2))
    print(f"{gpu}: {args.rows} rows over {args.adapters} rank-{args.rank} adapters, per layer")
    for case, us in times.items():
        print(f"\n{case}: {us:.2f} us/layer (+{us - times['off']:.2f} over off)")
        for name, k in kernels[case].items():
            print(f"  {k:8.2f}  {name}")
        for name, k in pieces.get(case, {}).items():
            print(f"  {k:8.2f}  alone: {name}")
    print(f"\n{'case':>36} {'us/layer':>9} {'excess':>7}")
    for case, us in times.items():
        print(f"{case:>36} {us:9.2f} {us - times['off']:7.2f}")


if __name__ == "__main__":
    main()
