"""The gateway's view of the replicas: where each one's doors are, whether it serves, how
much of the gateway's work it holds, and which replicas hold each affinity key's prefix.

Pure bookkeeping (no Ray, no network): discovery feeds it the directory's entries and health
answers; the doors ask `route` for a replica and call `done` when the request ends. Routing is
`ring.choose` over the serving replicas. A replica's load is the work it holds in units of a
request whose picture it has: a request it must compute the prefix for counts ``miss_cost``
of them (a vision-tower pass and a long prefill against a few decode rows), so that new
pictures balance what the replicas really have to do, and a repeat moves away from its prefix
only when that costs less than the wait it saves.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vlm_server.cluster.ring import AffinityMemory, HashRing, choose

# A new moondream2 picture (vision tower, 700-token prefill) against a cached one's few rows,
# as replica time: about 17 ms against 0.5 ms. 24 measured best of 8 and 24 on two GPUs
# (1.95x one replica's throughput against 1.64x).
DEFAULT_MISS_COST = 24.0


class NoReplica(RuntimeError):
    """No replica serves (starting, all replaced, or all draining)."""


@dataclass
class Replica:
    """One replica's doors (``host:port``) and the gateway's counts for it."""

    name: str
    grpc: str
    http: str | None = None
    metrics: str | None = None
    serving: bool = False
    in_flight: int = 0
    work: float = 0.0  # the in-flight requests' costs
    routed: int = 0


@dataclass(frozen=True)
class Routed:
    """A routed request: its replica and the cost it was counted at (until `done`)."""

    replica: Replica
    cost: float


class ReplicaSet:
    """The replicas the gateway may route to, and the routing itself."""

    def __init__(
        self,
        load_factor: float,
        rng: random.Random | None = None,
        miss_cost: float = DEFAULT_MISS_COST,
    ) -> None:
        if load_factor < 1.0:
            raise ValueError("load_factor must be >= 1")
        if miss_cost < 1.0:
            raise ValueError("miss_cost must be >= 1")
        self.load_factor = load_factor
        self.miss_cost = miss_cost
        self._rng = rng or random.Random()
        self._replicas: dict[str, Replica] = {}
        self._ring = HashRing([])
        self._memory = AffinityMemory()
        self.routed = 0
        self.home_hits = 0  # requests with a key that went where its prefix is (or, new, home)

    # --- membership ---------------------------------------------------------------------------

    def update(self, entries: Mapping[str, Mapping[str, Any]]) -> tuple[list[str], list[str]]:
        """Set the members from the directory (name -> {"grpc", "http", "metrics"}); returns
        (added, removed). A member whose doors moved is a new member (not serving until its
        health says so); one that left keeps no state, though its requests still end."""
        added, removed = [], []
        for name in list(self._replicas):
            entry = entries.get(name)
            if entry is None or entry.get("grpc") != self._replicas[name].grpc:
                del self._replicas[name]
                removed.append(name)
        for name, entry in entries.items():
            if name not in self._replicas and entry.get("grpc"):
                self._replicas[name] = Replica(
                    name, str(entry["grpc"]), entry.get("http"), entry.get("metrics")
                )
                added.append(name)
        if added or removed:
            self._rebuild()
        return added, removed

    def set_serving(self, name: str, serving: bool) -> None:
        replica = self._replicas.get(name)
        if replica is not None and replica.serving != serving:
            replica.serving = serving
            self._rebuild()

    def _rebuild(self) -> None:
        self._ring = HashRing([r.name for r in self._replicas.values() if r.serving])

    def get(self, name: str) -> Replica | None:
        return self._replicas.get(name)

    def members(self) -> list[Replica]:
        return list(self._replicas.values())

    def serving(self) -> list[Replica]:
        return [r for r in self._replicas.values() if r.serving]

    # --- routing ------------------------------------------------------------------------------

    def _load(self, name: str) -> float:
        return self._replicas[name].work

    def route(self, key: str | None, exclude: frozenset[str] = frozenset()) -> Routed:
        """The replica for a request with affinity ``key`` (None: by load alone), counted in
        flight until `done`. ``exclude``: replicas this request already failed to reach."""
        ring = self._ring
        if exclude:
            ring = HashRing([n for n in ring.names if n not in exclude])
        if not ring.names:
            raise NoReplica("no replica is serving")
        holders = self._memory.holders(key)
        name, home = choose(
            ring, key, self._load, self.load_factor, self._rng, holders, self.miss_cost
        )
        cost = 1.0 if key is None or name in holders else self.miss_cost
        replica = self._replicas[name]
        replica.in_flight += 1
        replica.work += cost
        replica.routed += 1
        self.routed += 1
        if key is not None:
            self.home_hits += home
            self._memory.sent(key, name)
        return Routed(replica, cost)

    def done(self, routed: Routed) -> None:
        """A routed request ended (however); its replica may have left the set meanwhile."""
        replica = routed.replica
        if replica.in_flight > 0:
            replica.in_flight -= 1
            replica.work = max(0.0, replica.work - routed.cost)

    def unreachable(self, replica: Replica) -> None:
        """A request could not connect: route no more there until its health says SERVING."""
        self.set_serving(replica.name, False)
