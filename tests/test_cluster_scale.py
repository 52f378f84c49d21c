"""The gateway past two GPUs, without Ray or GPUs: its default worker count, the workers'
agreement (placements relayed, loads shared), and image-affinity routing at 8, 16 and 64
replicas against power of two choices (bench/routing_sim.py: seeded, on a simulated clock)."""

from __future__ import annotations

import multiprocessing
import random
from functools import cache

import pytest

from bench import routing_sim
from vlm_server.cluster.gateway_workers import PlacementRelay
from vlm_server.cluster.replica_set import DEFAULT_MISS_COST, ReplicaSet
from vlm_server.cluster.shared_loads import SharedLoads, SlotTable
from vlm_server.options.cluster import ClusterConfig, gateway_workers


def test_the_default_gateway_workers_follow_the_replicas_and_the_cpus() -> None:
    """About two workers a replica (1.5 x 1,000 req/s a GPU over 800 a worker), the most
    replicas when autoscaling, at most half the CPUs, at least one; a set count is kept."""
    many = 256
    assert [gateway_workers(ClusterConfig(replicas=n), many) for n in (1, 2, 4, 8, 16)] == [
        2,
        4,
        8,
        15,
        30,
    ]
    assert gateway_workers(ClusterConfig(replicas=2, max_replicas=8), many) == 15
    assert gateway_workers(ClusterConfig(replicas=16), 32) == 16  # half of 32 CPUs
    assert gateway_workers(ClusterConfig(replicas=8), 2) == 1
    assert gateway_workers(ClusterConfig(replicas=8), None) == 1  # CPUs unknown
    assert gateway_workers(ClusterConfig(replicas=8, gateway_workers=3), many) == 3


def _set(names: list[str], **kwargs) -> ReplicaSet:
    replicas = ReplicaSet(2.0, random.Random(kwargs.pop("seed", 0)), **kwargs)
    replicas.update({n: {"grpc": n, "slot": i} for i, n in enumerate(names)})
    for n in names:
        replicas.set_serving(n, True)
    return replicas


def test_a_picture_moved_by_one_worker_is_found_by_another() -> None:
    names = ["a", "b", "c"]
    first, second, alone = (_set(names, publish=True, seed=s) for s in (1, 2, 3))
    home = first.route("pic").replica.name  # new: its prefix is computed there (cost 24)
    assert first.route("pic").replica.name == home  # a repeat waits behind it (24 <= slack)
    moved = first.route("pic").replica.name  # 25 units there: the next repeat moves
    assert moved != home
    relay = PlacementRelay(2)
    relay.add(0, first.placements())
    relay.add(1, second.placements())
    to_first, to_second = relay.take()
    assert to_first == [] and to_second == [("pic", home), ("pic", moved)]
    assert first.placements() == [] and relay.take() == [[], []]
    second.learn(to_second)
    assert set(second.holders("pic")) == {home, moved}
    # The home dies: the worker that learned finds the picture where it was moved to, as a
    # repeat (cost 1); one that did not must compute it again wherever it sends it.
    for replicas in (second, alone):
        replicas.set_serving(home, False)
    found = second.route("pic")
    assert (found.replica.name, found.cost) == (moved, 1.0)
    assert alone.route("pic").cost == DEFAULT_MISS_COST


def test_workers_route_by_the_work_every_worker_has_sent() -> None:
    """A request with no picture goes to the less loaded of two replicas: the one the other
    worker has not just sent a new picture to, whatever this worker's own random draw."""
    names = ["a", "b"]
    shared = SharedLoads(2, slots=4)
    first = _set(names, shared=shared.row(0))
    busy = first.route("pic")
    picks = set()
    for seed in range(20):
        second = _set(names, shared=shared.row(1), seed=seed)
        picks.add(second.route(None).replica.name)
        assert picks == {n for n in names if n != busy.replica.name}
    first.done(busy)
    own_only = [_set(names, seed=s).route(None).replica.name for s in range(20)]
    assert set(own_only) == set(names)  # without the shared loads: a coin toss


def _write_row(shared: SharedLoads, worker: int, slot: int, work: float) -> None:
    shared.row(worker).set(slot, work)


def test_shared_loads_are_one_memory_for_spawned_workers() -> None:
    shared = SharedLoads(2, slots=8)
    shared.row(0).set(3, 5.0)
    child = multiprocessing.get_context("spawn").Process(
        target=_write_row, args=(shared, 1, 3, 7.0)
    )
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert shared.row(0).totals(4).tolist() == [0.0, 0.0, 0.0, 12.0]
    shared.clear(1)  # a worker that exited leaves no work behind
    assert shared.row(0).totals(4)[3] == 5.0
    with pytest.raises(ValueError, match="worker 2"):
        shared.row(2)


def test_each_replica_keeps_its_slot_and_freed_slots_are_reused() -> None:
    table = SlotTable(slots=3)
    assert table.assign(["a", "b"]) == {"a": 0, "b": 1}
    assert table.assign(["b", "c", "d"]) == {"b": 1, "c": 0, "d": 2}
    assert table.assign(["b", "c", "d", "e"]) == {"b": 1, "c": 0, "d": 2, "e": None}
    # A replica past the slots routes by the worker's own work for it.
    replicas = _set(["x"], shared=SharedLoads(1, slots=1).row(0))
    replicas.update({"x": {"grpc": "x", "slot": None}})
    assert replicas.route("pic").replica.name == "x"


# --- routing at scale, simulated -----------------------------------------------------------

SCALES = [(n, traffic) for n in (8, 16, 64) for traffic in routing_sim.TRAFFIC]


@cache
def _simulated(replicas: int, traffic: str, workers: int, policy: str) -> dict:
    setup = routing_sim.Setup(replicas, traffic, workers, requests_per_replica=120)
    return routing_sim.simulate(setup, policy)


@pytest.mark.parametrize(("replicas", "traffic"), SCALES)
@pytest.mark.parametrize("workers", [1, 4])
def test_affinity_holds_at_scale_under_saturation(replicas: int, traffic: str, workers: int):
    """32 clients a replica: nine repeats in ten find their prefix, and neither the mean nor
    the p99 latency is worse than power of two choices' over the replicas' true queues."""
    affinity = _simulated(replicas, traffic, workers, "affinity")
    p2c = _simulated(replicas, traffic, 1, "p2c")  # no gateway state: workers do not matter
    assert affinity["repeat_hit_rate"] >= 0.9, affinity
    assert affinity["mean_latency"] <= p2c["mean_latency"], (affinity, p2c)
    assert affinity["p99_latency"] <= p2c["p99_latency"], (affinity, p2c)


def test_sharing_is_what_keeps_many_workers_on_the_prefixes() -> None:
    """16 workers on 16 replicas, zipf traffic: each on its own (as before they shared)
    misses far more often and waits longer than the workers that share."""
    shared = _simulated(16, "zipf", 16, "affinity")
    alone = _simulated(16, "zipf", 16, "affinity_unshared")
    assert shared["repeat_hit_rate"] >= 0.9 > alone["repeat_hit_rate"], (shared, alone)
    assert shared["mean_latency"] < alone["mean_latency"], (shared, alone)


def test_the_simulation_is_deterministic() -> None:
    setup = routing_sim.Setup(8, "one_hot", 2, requests_per_replica=40, seed=5)
    assert routing_sim.simulate(setup, "affinity") == routing_sim.simulate(setup, "affinity")
    with pytest.raises(ValueError, match="policy"):
        routing_sim.simulate(setup, "round_robin")
    with pytest.raises(ValueError, match="traffic"):
        routing_sim.keys("uniform", 10, 8, random.Random(0))
