"""Image-affinity routing at 8 to 64 replicas, simulated: the gateway's own `ReplicaSet`
against power of two choices, on a simulated clock (no network, no wall time: seeded and
deterministic).

The model. A replica does one unit of work per tick, first come first served. A request costs
one unit where its replica holds its picture's prefix and `MISS_COST` units where it must
compute it (a new moondream2 picture costs a replica about 24 times a repeated one's request:
17 ms against 0.5-0.7 ms). Clients keep ``clients_per_replica x replicas`` requests in flight
(a closed loop: saturation), each client on one gateway worker (a connection stays on the
worker the kernel gave it). Each worker routes with its own `ReplicaSet`: its own requests in
flight as the loads, the holders it knows. With sharing on, every ``share_every`` ticks the
workers' new placements are collected and handed to the other workers at the next collection
(`ReplicaSet.placements`, `ReplicaSet.learn`), as the gateway's parent relays them
(gateway_workers.SHARE_S). A tick stands for about a millisecond: one repeated picture's
request on a GPU answering ~1,000 of them a second.

Policies: ``affinity`` (the gateway's routing, workers sharing their placements),
``affinity_unshared`` (the same, each worker on its own: how the gateway routed before the
workers shared) and ``p2c`` (power of two choices over the replicas' true queue lengths, with
no affinity: the baseline).

Traffic: ``zipf`` (pictures drawn with weight 1/rank^1.2 from 25 per replica) and ``one_hot``
(one picture nine requests in ten, the rest from 64 per replica).

    python -m bench.routing_sim                         # 8, 16, 64 replicas; 1 and 4 workers
    python -m bench.routing_sim --replicas 8 --workers 8 --out /tmp/sim

Writes routing_sim.json and routing_sim.png and prints a table under ``--out`` (default
bench/results/simulated/routing/).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.plotting import pyplot, save
from vlm_server.cluster.replica_set import DEFAULT_MISS_COST, ReplicaSet, Routed
from vlm_server.cluster.ring import two_choices
from vlm_server.cluster.shared_loads import SharedLoads

REPO_ROOT = Path(__file__).resolve().parent.parent
MISS_COST = 24  # the replica's true cost of a new picture, in units of a repeated one's
LOAD_FACTOR = 2.0  # the gateway's default (--affinity-load-factor)
POLICIES = ("affinity", "affinity_unshared", "p2c")
TRAFFIC = ("zipf", "one_hot")


@dataclass(frozen=True)
class Setup:
    """One simulated run."""

    replicas: int
    traffic: str
    workers: int = 1
    clients_per_replica: int = 32
    requests_per_replica: int = 200
    share_every: int = 20  # ticks between two relays of the workers' placements
    seed: int = 0


def keys(traffic: str, count: int, replicas: int, rng: random.Random) -> list[str]:
    """``count`` picture keys of one traffic shape."""
    if traffic == "zipf":
        pictures = 25 * replicas
        weights = [1 / (i + 1) ** 1.2 for i in range(pictures)]
        return [f"img{i}" for i in rng.choices(range(pictures), weights, k=count)]
    if traffic == "one_hot":
        others = 64 * replicas
        return [
            "hot" if rng.random() < 0.9 else f"img{rng.randrange(others)}" for _ in range(count)
        ]
    raise ValueError(f"traffic is one of {', '.join(TRAFFIC)}, not {traffic!r}")


@dataclass
class _Job:
    left: int
    start: int
    client: int
    worker: int
    routed: Routed | None


def _gateways(setup: Setup, share: bool) -> list[ReplicaSet]:
    """The workers' replica sets; ``share``: as the gateway's workers are, each publishing
    its placements and all of them on one table of loads."""
    names = {f"r{i}": {"grpc": f"r{i}", "slot": i} for i in range(setup.replicas)}
    loads = SharedLoads(setup.workers, setup.replicas) if share else None
    out = []
    for w in range(setup.workers):
        gateway = ReplicaSet(
            LOAD_FACTOR,
            random.Random(setup.seed * 1000 + w),
            DEFAULT_MISS_COST,
            publish=share,
            shared=loads.row(w) if loads is not None else None,
        )
        gateway.update(names)
        for name in names:
            gateway.set_serving(name, True)
        out.append(gateway)
    return out


def simulate(setup: Setup, policy: str) -> dict[str, Any]:
    """One policy over one setup's traffic: repeat hit rate, latency (ticks), throughput."""
    if policy not in POLICIES:
        raise ValueError(f"policy is one of {', '.join(POLICIES)}, not {policy!r}")
    rng = random.Random(setup.seed)
    stream = deque(
        keys(setup.traffic, setup.requests_per_replica * setup.replicas, setup.replicas, rng)
    )
    total = len(stream)
    repeats = total - len(set(stream))
    names = [f"r{i}" for i in range(setup.replicas)]
    gateways = _gateways(setup, share=policy == "affinity")
    p2c_rng = random.Random(setup.seed + 1)
    queues: dict[str, deque[_Job]] = {n: deque() for n in names}
    held: dict[str, set[str]] = {n: set() for n in names}
    relay: list[list[tuple[str, str]]] = [[] for _ in gateways]  # collected, per worker
    hits = 0
    waits: list[int] = []
    tick = 0

    def issue(client: int) -> None:
        nonlocal hits
        key = stream.popleft()
        worker = client % setup.workers
        routed = None
        if policy == "p2c":
            name = two_choices(names, lambda n: len(queues[n]), p2c_rng)
        else:
            routed = gateways[worker].route(key)
            name = routed.replica.name
        hit = key in held[name]
        hits += hit
        held[name].add(key)
        queues[name].append(_Job(1 if hit else MISS_COST, tick, client, worker, routed))

    # Clients join one per replica per tick (a burst of thousands in one instant would pile
    # on whichever replica every worker's empty view calls least loaded).
    joining = deque(range(min(total, setup.clients_per_replica * setup.replicas)))
    while joining or any(queues.values()):
        for _ in range(min(len(joining), setup.replicas)):
            issue(joining.popleft())
        freed: list[int] = []
        for name in names:  # one unit of work each, in a fixed order
            queue = queues[name]
            if queue:
                job = queue[0]
                job.left -= 1
                if job.left == 0:
                    queue.popleft()
                    waits.append(tick + 1 - job.start)
                    if job.routed is not None:
                        gateways[job.worker].done(job.routed)
                    freed.append(job.client)
        tick += 1
        if policy == "affinity" and setup.workers > 1 and tick % setup.share_every == 0:
            for w, gateway in enumerate(gateways):  # the last collection reaches the others
                gateway.learn(p for v, batch in enumerate(relay) if v != w for p in batch)
            relay = [gateway.placements() for gateway in gateways]
        for client in freed:  # each finished client asks its next question
            if stream:
                issue(client)
    waits.sort()
    return {
        "repeat_hit_rate": hits / repeats if repeats else 1.0,
        "mean_latency": sum(waits) / len(waits),
        "p99_latency": waits[int(0.99 * (len(waits) - 1))],
        "requests_per_tick": total / tick,
        "ticks": tick,
    }


def run_all(setups: Sequence[Setup]) -> list[dict[str, Any]]:
    """Every policy over every setup, as rows."""
    rows = []
    for setup in setups:
        for policy in POLICIES:
            if policy == "affinity_unshared" and setup.workers == 1:
                continue  # one worker has nobody to share with: the same as affinity
            row = {**asdict(setup), "policy": policy, **simulate(setup, policy)}
            rows.append(row)
            print(_line(row), file=sys.stderr, flush=True)
    return rows


def _line(r: dict[str, Any]) -> str:
    return (
        f"{r['replicas']:>4} {r['traffic']:<8} {r['workers']:>3} {r['policy']:<18} "
        f"{r['repeat_hit_rate']:6.3f} {r['mean_latency']:9.1f} {r['p99_latency']:7d} "
        f"{r['requests_per_tick']:9.2f}"
    )


def table(rows: Sequence[dict[str, Any]]) -> str:
    head = (
        f"{'reps':>4} {'traffic':<8} {'wkr':>3} {'policy':<18} {'hit':>6} {'mean':>9} "
        f"{'p99':>7} {'req/tick':>9}"
    )
    return "\n".join([head, *(_line(r) for r in rows)])


def plot(rows: Sequence[dict[str, Any]], path: Path) -> bool:
    """Mean and p99 latency per setup (a row of plots per traffic), one bar per policy."""
    plt = pyplot()
    if plt is None:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return False
    shapes = sorted({r["traffic"] for r in rows})
    fig, axes = plt.subplots(len(shapes), 2, figsize=(12, 3.4 * len(shapes)), squeeze=False)
    width = 0.8 / len(POLICIES)
    for line, traffic in zip(axes, shapes, strict=True):
        setups = sorted({(r["replicas"], r["workers"]) for r in rows if r["traffic"] == traffic})
        for ax, metric in zip(line, ("mean_latency", "p99_latency"), strict=True):
            for i, policy in enumerate(POLICIES):
                values = []
                for replicas, workers in setups:
                    match = [
                        r[metric]
                        for r in rows
                        if (r["traffic"], r["replicas"], r["workers"], r["policy"])
                        == (traffic, replicas, workers, policy)
                    ]
                    values.append(match[0] if match else 0)
                xs = [j + i * width for j in range(len(setups))]
                ax.bar(xs, values, width, label=policy)
            labels = [f"{n} rep.\n{w} wkr" for n, w in setups]
            ax.set_xticks([j + width for j in range(len(setups))], labels, fontsize=8)
            ax.set_ylabel(f"{metric.replace('_', ' ')} (ticks)")
            ax.set_title(f"{traffic}: {metric.split('_')[0]} latency", fontsize=10)
    axes[0][0].legend(fontsize=8, loc="lower right")
    fig.suptitle("image affinity vs power of two choices, simulated saturation (lower is better)")
    save(plt, fig, str(path))
    return True


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.routing_sim", description=__doc__)
    ap.add_argument("--replicas", type=int, nargs="+", default=[8, 16, 64])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--traffic", nargs="+", default=list(TRAFFIC), choices=TRAFFIC)
    ap.add_argument("--requests-per-replica", type=int, default=200)
    ap.add_argument("--clients-per-replica", type=int, default=32)
    ap.add_argument("--share-every", type=int, default=20, help="ticks between relays")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--out", type=Path, default=REPO_ROOT / "bench" / "results" / "simulated" / "routing"
    )
    args = ap.parse_args(argv)
    setups = [
        Setup(
            replicas,
            traffic,
            workers,
            args.clients_per_replica,
            args.requests_per_replica,
            args.share_every,
            args.seed,
        )
        for traffic in args.traffic
        for replicas in args.replicas
        for workers in args.workers
    ]
    rows = run_all(setups)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "routing_sim.json").write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    plot(rows, args.out / "routing_sim.png")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
