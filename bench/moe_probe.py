"""Moondream 3's expert layer on the GPU, tile by tile (CUDA only).

    python -m bench.moe_probe [--json OUT.json] [--tokens 1 8 32 64 730 2048] [--weights fp8 bf16]

At full size (dim 2048, 64 experts of width 1024, top-8, bf16 activations), for each token
count and expert weight format, times by CUDA-graph replay (median; bench/tower_probe.py's
`replay_us`):

- ``layer``: one expert layer as `MoeMLP.forward` runs it, router to combine;
- ``grouped``: the two grouped kernels alone (with split-K: and their reduces), on a
  grouping made beforehand;

for the main branch's path (``legacy``: PyTorch route, `align` and combine, the one 64 x 64
tile) and for each candidate tile (the new path: routing and combine kernels). Every variant
is checked against the plain path (`experts_loop` on the dequantized weights, the tolerance
of tests/test_moondream3_gpu.py). Also per token count: the bandwidth floor, the bytes of the
chosen experts' weights read once over a measured device-to-device copy bandwidth. The table
comes last, then the winners as `moe_triton.TILES` rows to paste.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator

import torch

from bench.tower_probe import replay_us
from vlm_server.models.moondream3 import moe_routing, moe_triton
from vlm_server.models.moondream3.config import MoeConfig
from vlm_server.models.moondream3.moe import MoeMLP, combine_slots, experts_loop, route
from vlm_server.models.moondream3.moe_triton import ExpertTiles, Tile, experts_fused

DIM = 2048
TOKENS = (1, 8, 32, 64, 730, 2048)
TOL = 3e-2

# Candidates by regime (the table's own choice is always added): decode reads the chosen
# experts' weights once and wants every SM busy; prefill is a grouped GEMM.
DECODE = (
    ExpertTiles(16, Tile(64, 128, 4, 4), Tile(64, 128, 4, 4)),
    ExpertTiles(16, Tile(64, 128, 4, 4, 2), Tile(64, 128, 4, 4, 2)),
    ExpertTiles(16, Tile(32, 128, 4, 4, 4), Tile(32, 128, 4, 4, 4)),
    ExpertTiles(16, Tile(32, 256, 4, 3), Tile(32, 256, 4, 3)),
    ExpertTiles(16, Tile(64, 256, 8, 3), Tile(64, 256, 8, 3)),
    ExpertTiles(16, Tile(128, 128, 8, 3), Tile(128, 128, 8, 3)),
)
PREFILL = (
    ExpertTiles(32, Tile(64, 64, 4, 4), Tile(64, 64, 4, 4)),
    ExpertTiles(64, Tile(64, 128, 4, 3), Tile(64, 128, 4, 3)),
    ExpertTiles(64, Tile(128, 64, 4, 4), Tile(128, 64, 4, 4)),
    ExpertTiles(64, Tile(128, 64, 8, 3), Tile(128, 64, 8, 3)),
    ExpertTiles(64, Tile(128, 64, 8, 4), Tile(128, 128, 8, 3)),
    ExpertTiles(128, Tile(128, 64, 8, 3), Tile(128, 64, 8, 3)),
    # Wider K steps and wider tiles: fewer, longer programs for image prefixes
    ExpertTiles(128, Tile(128, 128, 8, 3), Tile(128, 128, 8, 3)),
    ExpertTiles(128, Tile(256, 64, 8, 3), Tile(256, 64, 8, 3)),
    ExpertTiles(128, Tile(128, 64, 8, 4), Tile(128, 128, 8, 3)),
    ExpertTiles(64, Tile(128, 128, 8, 3), Tile(128, 128, 8, 3)),
    ExpertTiles(128, Tile(64, 128, 4, 4), Tile(64, 128, 4, 4)),
    ExpertTiles(128, Tile(128, 128, 8, 4), Tile(128, 128, 8, 4)),
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def table(tiles: ExpertTiles, name: str = "TILES") -> Iterator[None]:
    """The table `moe_triton.<name>` as this one entry (graphs keep what they captured)."""
    saved = getattr(moe_triton, name)
    setattr(moe_triton, name, ((1 << 62, tiles),))
    try:
        yield
    finally:
        setattr(moe_triton, name, saved)


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write of 1 GiB)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = replay_us(lambda: dst.copy_(src), calls=2, reps=10)
    return 2 * src.numel() / (us * 1e-6)


def make_layer(fp8: bool) -> MoeMLP:
    torch.manual_seed(0)
    with torch.device("cuda"):
        mlp = MoeMLP(DIM, MoeConfig())
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(std=0.02)
    mlp = mlp.bfloat16()
    if fp8:
        mlp.fc1.use_fp8()
        mlp.fc2.use_fp8()
    return mlp


def legacy_tiles(n_pairs: int, n_experts: int) -> ExpertTiles:
    """The single tile the fused path used before the table: 64 x 64, Triton's default warps
    and stages, rows per block by load (16 when experts see 16 pairs or fewer each, 32 up to
    64, else 64)."""
    per_expert = n_pairs / n_experts
    bm = 16 if per_expert <= 16 else (32 if per_expert <= 64 else 64)
    return ExpertTiles(bm, Tile(), Tile())


def legacy_layer(mlp: MoeMLP, x: torch.Tensor) -> torch.Tensor:
    """The main branch's fused path: PyTorch route, `align` and combine, one fixed tile."""
    weights, ids = route(mlp.router(x), mlp.top_k)
    tiles = legacy_tiles(ids.numel(), mlp.fc1.weight.shape[0])
    routing = moe_routing.Routing(
        *moe_routing.align(ids, mlp.fc1.weight.shape[0], tiles.bm), tiles.bm
    )
    y = _experts(mlp, x, ids, tiles, routing)
    return combine_slots(y, weights)


def _experts(
    mlp: MoeMLP, x: torch.Tensor, ids: torch.Tensor, tiles: ExpertTiles, routing: object
) -> torch.Tensor:
    w1, w2 = mlp.fc1, mlp.fc2
    return experts_fused(
        x, ids, w1.weight, w2.weight, w1.scale, w2.scale, tiles=tiles, routing=routing
    )  # type: ignore[arg-type]


def launches(fn: Callable[[], torch.Tensor]) -> int:
    """GPU kernels one call launches (profiler count)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def err(
    got: torch.Tensor, want: torch.Tensor, rows: torch.Tensor | None = None
) -> tuple[float, bool]:
    """Max absolute error and whether ``got`` passes the GPU tests' tolerance (on ``rows``)."""
    g, w = got.float(), want.float()
    if rows is not None:
        g, w = g[rows], w[rows]
    ok = bool(torch.isclose(g, w, atol=TOL, rtol=TOL).all())
    return float((g - w).abs().max()), ok


def probe(mlp: MoeMLP, fmt: str, n: int, bw: float, candidates: list[ExpertTiles]) -> list[dict]:
    fp8 = fmt == "fp8"
    k, n_experts = mlp.top_k, mlp.fc1.weight.shape[0]
    x = torch.randn(n, DIM, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        weights, ids = route(mlp.router(x), k)
        d1, d2 = mlp.fc1.values(torch.float32), mlp.fc2.values(torch.float32)
        y_want = experts_loop(x.float(), ids, d1, d2)
        want = combine_slots(y_want, weights.float())
        del d1, d2
        # bf16 logits tie now and then: a tie at the k-th place may pick another expert than
        # torch.topk does (the kernel takes the lower id); such tokens are counted, not checked
        mine = moe_routing.route_align(mlp.router(x), k, 16)[1]
        same = (mine.sort(1).values == ids.sort(1).values).all(1)
    chosen = int(ids.unique().numel())
    per_expert = mlp.fc1.weight[0].numel() + mlp.fc2.weight[0].numel()
    nbytes = chosen * per_expert * mlp.fc1.weight.element_size()
    if fp8:
        nbytes += chosen * (mlp.fc1.weight.shape[1] + mlp.fc2.weight.shape[1]) * 4
    floor = nbytes / bw * 1e6
    base = {"weights": fmt, "tokens": n, "experts_chosen": chosen, "floor_us": floor}
    base["tie_tokens"] = int((~same).sum())
    log(f"{fmt} n={n}: {chosen} experts chosen, floor {floor:.1f} us, {base['tie_tokens']} ties")
    rows = []
    variants: list[tuple[str, ExpertTiles]] = [("legacy", legacy_tiles(n * k, n_experts))]
    variants += [("tiles", t) for t in candidates]
    for name, tiles in variants:
        row = {**base, "variant": name, "tiles": str(tiles), "bm": tiles.bm}
        row.update({f"up_{f}": getattr(tiles.up, f) for f in vars(tiles.up)})
        row.update({f"down_{f}": getattr(tiles.down, f) for f in vars(tiles.down)})
        t0 = time.time()
        try:
            row.update(measure(mlp, x, ids, tiles, name == "legacy", want, y_want, same))
            if n in (1, 730) and (name == "legacy" or tiles == moe_triton.pick_tiles(n)):
                with torch.no_grad(), table(tiles):
                    row["launches"] = launches(layer_fn(mlp, x, name == "legacy"))
        except Exception as e:  # a tile that does not fit (shared memory) is a result too
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            row["ok"] = False
        log(
            f"  {fmt} n={n:<5} {name:7} {tiles!s:44} "
            + (
                row["error"]
                if "error" in row
                else f"layer {row['layer_us']:8.1f} us  grouped {row['grouped_us']:8.1f} us"
                + ("" if row["ok"] else "  MISMATCH")
            )
            + f"  ({time.time() - t0:.1f}s)"
        )
        rows.append(row)
    return rows


def layer_fn(mlp: MoeMLP, x: torch.Tensor, legacy: bool) -> Callable[[], torch.Tensor]:
    return (lambda: legacy_layer(mlp, x)) if legacy else (lambda: mlp(x))


def measure(
    mlp: MoeMLP,
    x: torch.Tensor,
    ids: torch.Tensor,
    tiles: ExpertTiles,
    legacy: bool,
    want: torch.Tensor,
    y_want: torch.Tensor,
    same: torch.Tensor,
) -> dict:
    """One variant's errors and replay times (the layer; the grouped kernels alone)."""
    n_experts = mlp.fc1.weight.shape[0]
    with torch.no_grad(), table(tiles):
        if legacy:
            routing = moe_routing.Routing(*moe_routing.align(ids, n_experts, tiles.bm), tiles.bm)
        else:
            routing = moe_routing.align_fused(ids, n_experts, tiles.bm)
        layer = layer_fn(mlp, x, legacy)

        def grouped() -> torch.Tensor:
            return _experts(mlp, x, ids, tiles, routing)

        layer_err, layer_ok = err(layer(), want, None if legacy else same)
        grouped_err, grouped_ok = err(grouped(), y_want)
        return {
            "layer_err": layer_err,
            "grouped_err": grouped_err,
            "ok": layer_ok and grouped_ok,
            "layer_us": replay_us(layer),
            "grouped_us": replay_us(grouped),
        }


def candidates_for(n: int, cross: bool) -> list[ExpertTiles]:
    pool = list(DECODE + PREFILL) if cross else list(DECODE if n <= 64 else PREFILL)
    mine = moe_triton.pick_tiles(n)
    return pool if mine in pool else [mine, *pool]


def _tile_src(row: dict, kernel: str) -> str:
    fields = ", ".join(str(row[f"{kernel}_{f}"]) for f in ("bn", "bk", "warps", "stages", "split"))
    return f"Tile({fields})"


def summary(rows: list[dict]) -> None:
    print("\ntimes in us (CUDA-graph replay medians); x: legacy layer / best layer")
    print(
        f"{'weights':7} {'tokens':>6} {'floor':>7} {'legacy':>8} {'best':>8} {'x':>5} "
        f"{'grp_leg':>8} {'grp_best':>8} {'launch':>9}  best tiles (by layer time)"
    )
    winners: dict[str, dict[int, dict]] = {}
    for fmt in dict.fromkeys(r["weights"] for r in rows):
        for n in dict.fromkeys(r["tokens"] for r in rows if r["weights"] == fmt):
            mine = [r for r in rows if r["weights"] == fmt and r["tokens"] == n]
            leg = next(r for r in mine if r["variant"] == "legacy")
            good = [r for r in mine if r["variant"] != "legacy" and r.get("ok")]
            if not good or "layer_us" not in leg:
                print(f"{fmt:7} {n:>6}  no passing candidate")
                continue
            best = min(good, key=lambda r: r["layer_us"])
            grp = min(good, key=lambda r: r["grouped_us"])
            winners.setdefault(fmt, {})[n] = best
            new = next(
                (r.get("launches") for r in mine if r["variant"] != "legacy" and "launches" in r),
                None,
            )
            lau = f"{leg.get('launches', '-')}->{new or '-'}"
            print(
                f"{fmt:7} {n:>6} {leg['floor_us']:7.1f} {leg['layer_us']:8.1f} "
                f"{best['layer_us']:8.1f} {leg['layer_us'] / best['layer_us']:5.2f} "
                f"{leg['grouped_us']:8.1f} {grp['grouped_us']:8.1f} {lau:>9}  {best['tiles']}"
            )
    for fmt, by_n in winners.items():
        print(
            f"\n# moe_triton.TILES from the {fmt} winners (a step takes the next larger count's):"
        )
        print("TILES = (")
        ordered = sorted(by_n.items())
        for i, (n, r) in enumerate(ordered):
            up, dn = _tile_src(r, "up"), _tile_src(r, "down")
            bound = "1 << 62" if i == len(ordered) - 1 else str(n)
            print(f"    ({bound}, ExpertTiles({r['bm']}, {up}, {dn})),")
        print(")")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--weights", nargs="+", default=["fp8", "bf16"], choices=["fp8", "bf16"])
    ap.add_argument("--cross", action="store_true", help="every candidate at every token count")
    ap.add_argument("--json", default=None, help="write every row here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("moe_probe needs a CUDA device", file=sys.stderr)
        return 2
    cap = torch.cuda.get_device_capability()
    fmts = [f for f in args.weights if f != "fp8" or cap >= (9, 0)]
    start = time.time()
    bw = copy_bandwidth()
    log(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s")
    rows = []
    for fmt in fmts:
        mlp = make_layer(fmt == "fp8")
        for n in args.tokens:
            rows += probe(mlp, fmt, n, bw, candidates_for(n, args.cross))
            torch.cuda.empty_cache()
        del mlp
    log(f"done in {time.time() - start:.0f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(), "copy_bw": bw, "rows": rows}, f, indent=1
            )
    summary(rows)
    return 0 if all(r.get("ok") or "error" in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
