"""The expert layer's routing alone (CUDA): `moe_routing.route_align` per chunk size, warp count,
one-program bound and program cap against the PyTorch `route` + `align` it replaces, by CUDA-
graph replay, each checked to group the same pairs.

    python -m bench.moe_routing_probe [--tokens 1 8 32 64 730 2048 5840] [--json OUT]
    python -m bench.moe_routing_probe --plot-from OUT.json     # the plot again, from saved rows

Prints, per token count, the time of each setting (us) and the best; Moondream 3's widths (64
experts, top-8). With ``--json``, the rows and a plot beside them (``OUT.png``: per token count,
PyTorch's, the module's settings and the fastest).
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench import plotting
from bench.tower_probe import replay_us
from vlm_server.models.moondream3 import moe_routing
from vlm_server.models.moondream3.moe import route
from vlm_server.models.moondream3.moe_triton import align, pick_tiles

CHUNKS = (64, 128, 256)
WARPS = (4, 8)
SINGLES = (64, 16)  # SINGLE_MAX_TOKENS
PROGRAMS = (32, 128, 1024)  # MAX_PROGRAMS (1024: one chunk a program up to 8192 tokens)
SWEPT = ("CHUNK_PAIRS", "ROUTE_WARPS", "SINGLE_MAX_TOKENS", "MAX_PROGRAMS")


def _groups(pair_ids: torch.Tensor, used: torch.Tensor, ids: torch.Tensor) -> list[list[int]]:
    """Each expert's pairs, as sets of rows: the grouping's content, whatever its order."""
    flat = ids.reshape(-1).tolist()
    rows = [p for p in pair_ids[: int(used)].tolist() if p < len(flat)]
    out: list[list[int]] = [[] for _ in range(int(ids.max()) + 1)]
    for p in rows:
        out[flat[p]].append(p)
    return [sorted(g) for g in out]


def default_setting() -> str:
    """The name of the setting `moe_routing` launches with."""
    m = moe_routing
    return f"c{m.CHUNK_PAIRS}w{m.ROUTE_WARPS}s{m.SINGLE_MAX_TOKENS}p{m.MAX_PROGRAMS}"


def plot(out: dict | list, path: str) -> bool:
    """Per token count: PyTorch's route + align, the module's setting and the fastest (log
    scale); False without matplotlib. Takes the JSON this probe writes (older runs: a list)."""
    rows = out["rows"] if isinstance(out, dict) else out
    bars = {
        "PyTorch": [r["torch_us"] for r in rows],
        "module's setting": [r["us"].get(r.get("default", default_setting()), 0) for r in rows],
        "fastest swept": [r["us"].get(r["best"], 0) for r in rows],
    }
    device = out.get("device", "") if isinstance(out, dict) else ""
    return plotting.grouped_bars(
        bars, [str(r["tokens"]) for r in rows], path, xlabel="tokens",
        ylabel="us (route + grouping)", title=f"Moondream 3 routing {device}".strip(), log=True,
    )  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 730, 2048, 5840])
    ap.add_argument("--json", default=None, help="write every row here (and a plot beside)")
    ap.add_argument("--plot-from", default=None, help="only plot these saved rows")
    args = ap.parse_args()
    if args.plot_from:
        return plotting.replot(args.plot_from, plot)
    if not torch.cuda.is_available():
        print("moe_routing_probe needs a CUDA device")
        return 1
    default = default_setting()
    saved = {k: getattr(moe_routing, k) for k in SWEPT}
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    settings = {
        f"c{c}w{w}s{m}p{p}": (c, w, m, p)
        for c in CHUNKS
        for w in WARPS
        for m in SINGLES
        for p in PROGRAMS
    }
    names = list(settings)
    print(f"{'tokens':>6} {'torch':>8} " + " ".join(f"{m:>9}" for m in names))
    for n in args.tokens:
        logits = torch.randn(n, 64, device="cuda", generator=gen).bfloat16()
        bm = pick_tiles(n).bm
        legacy = replay_us(lambda lg=logits, b=bm: align(route(lg, 8)[1], 64, b))
        times = {}
        for name in names:
            chunk, warps, single, programs = settings[name]
            moe_routing.CHUNK_PAIRS, moe_routing.ROUTE_WARPS = chunk, warps
            moe_routing.SINGLE_MAX_TOKENS, moe_routing.MAX_PROGRAMS = single, programs
            try:
                _w, ids, r = moe_routing.route_align(logits, 8, bm)
                # The same pairs per expert as PyTorch's grouping of the kernel's ids
                # (the ids themselves may differ from topk's at bf16 ties).
                want = _groups(*align(ids, 64, bm)[::2], ids)
                ok = _groups(r.pair_ids, r.used, ids) == want
                us = replay_us(lambda lg=logits, b=bm: moe_routing.route_align(lg, 8, b))
            except Exception as err:  # a setting that does not build: recorded, not fatal
                print(f"  n={n} {name}: {type(err).__name__}", file=sys.stderr)
                ok, us = False, float("nan")
            times[name] = us if ok else float("nan")
        best = min(((v, k) for k, v in times.items() if v == v), default=(float("nan"), "-"))
        rows.append({"tokens": n, "torch_us": legacy, "us": times, "best": best[1],
                     "default": default})  # fmt: skip
        cells = " ".join(f"{times[m]:>9.1f}" for m in names)
        print(f"{n:>6} {legacy:>8.1f} {cells}   best {best[1]} {best[0]:.1f}", flush=True)
    for k, v in saved.items():
        setattr(moe_routing, k, v)
    if args.json:
        out = {"device": torch.cuda.get_device_name(), "rows": rows}
        plotting.write_rows(args.json, out, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
