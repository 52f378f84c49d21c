"""The gateway's view of the replicas: where each one's doors are, whether it serves, how
much of the gateway's work it holds, and which replicas hold each affinity key's prefix.

Pure bookkeeping (no Ray, no network): discovery feeds it the directory's entries and health
answers; the doors ask `route` for a replica and call `done` when the request ends. Routing is
`ring.choose` over the serving replicas. A replica's load is the work it holds in units of a
request whose picture it has: a request it must compute the prefix for counts ``miss_cost``
of them (a vision-tower pass and a long prefill against a few decode rows), so that new
pictures balance what the replicas really have to do, and a repeat moves away from its prefix
only when that costs less than the wait it saves.

Several gateway workers each keep a `ReplicaSet` of their own: the members (the same
directory feeds them all) and their health (each worker's own probes), their own requests in
flight, and the holders of the keys they routed. Two things make them agree. With
``publish`` on, a set lists every request it sent to a replica that was not yet a holder of
its key (`placements`); the others `learn` them, so a picture one worker placed or moved is
found where it went by every worker. With ``shared`` loads (`shared_loads`), each set
writes its work in flight per replica where all of them read it, and routes by the sum: the
work every worker has sent there, not its own share.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from vlm_server.cluster.ring import AffinityMemory, HashRing, choose
from vlm_server.cluster.shared_loads import WorkerLoads

# A new moondream2 picture (vision tower, 700-token prefill) against a cached one's few rows,
# as replica time: about 17 ms against 0.5 ms. 24 measured best of 8 and 24 on two GPUs
# (1.95x one replica's throughput against 1.64x).
DEFAULT_MISS_COST = 24.0
# Placements kept for the other workers between two shares (a share is due every few tens of
# milliseconds; the bound only keeps a stalled share from growing without end).
MAX_UNSHARED = 1 << 16
Placement = tuple[str, str]  # (affinity key, replica name)


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
    slot: int | None = None  # its column of the workers' shared loads


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
        publish: bool = False,
        shared: WorkerLoads | None = None,
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
        self._publish = publish
        self._placed: deque[Placement] = deque(maxlen=MAX_UNSHARED)
        self._shared = shared
        self._used_slots = 0  # the shared columns to sum: above every member's slot
        self.routed = 0
        self.home_hits = 0  # requests with a key that went where its prefix is (or, new, home)

    # --- membership ---------------------------------------------------------------------------

    def update(self, entries: Mapping[str, Mapping[str, Any]]) -> tuple[list[str], list[str]]:
        """Set the members from the directory (name -> {"grpc", "http", "metrics", and from
        the workers' parent "slot"}); returns (added, removed). A member whose doors moved is
        a new member (not serving until its health says so); one that left keeps no state,
        though its requests still end."""
        added, removed = [], []
        for name in list(self._replicas):
            entry = entries.get(name)
            if entry is None or entry.get("grpc") != self._replicas[name].grpc:
                self._write(self._replicas.pop(name), 0.0)
                removed.append(name)
        for name, entry in entries.items():
            replica = self._replicas.get(name)
            if replica is None and entry.get("grpc"):
                replica = Replica(name, str(entry["grpc"]), entry.get("http"), entry.get("metrics"))
                self._replicas[name] = replica
                added.append(name)
            if replica is not None and replica.slot != entry.get("slot"):
                self._write(replica, 0.0)
                replica.slot = entry.get("slot")
                self._write(replica, replica.work)
        self._used_slots = 1 + max(
            (r.slot for r in self._replicas.values() if r.slot is not None), default=-1
        )
        if added or removed:
            self._rebuild()
        return added, removed

    def _write(self, replica: Replica, work: float) -> None:
        """This set's work at ``replica`` into its shared column (if it has one)."""
        if self._shared is not None and replica.slot is not None:
            self._shared.set(replica.slot, work)

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

    def _loads(self) -> Callable[[str], float]:
        """Each member's load now: the work of every worker that shares, else this set's."""
        replicas = self._replicas
        if self._shared is None or not self._used_slots:
            return lambda name: replicas[name].work
        totals = self._shared.totals(self._used_slots).tolist()  # host numpy: no device
        by_name = {n: totals[r.slot] if r.slot is not None else r.work for n, r in replicas.items()}
        return by_name.__getitem__

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
            ring, key, self._loads(), self.load_factor, self._rng, holders, self.miss_cost
        )
        cost = 1.0 if key is None or name in holders else self.miss_cost
        replica = self._replicas[name]
        replica.in_flight += 1
        replica.work += cost
        self._write(replica, replica.work)
        replica.routed += 1
        self.routed += 1
        if key is not None:
            self.home_hits += home
            self._memory.sent(key, name)
            if self._publish and name not in holders:
                self._placed.append((key, name))
        return Routed(replica, cost)

    def done(self, routed: Routed) -> None:
        """A routed request ended (however); its replica may have left the set meanwhile."""
        replica = routed.replica
        if replica.in_flight > 0:
            replica.in_flight -= 1
            replica.work = max(0.0, replica.work - routed.cost)
            if self._replicas.get(replica.name) is replica:  # a member: its column is its own
                self._write(replica, replica.work)

    # --- agreement between workers ------------------------------------------------------------

    def placements(self) -> list[Placement]:
        """The keys this set sent to a replica that did not hold them yet, since the last
        call (empty unless ``publish``): what the other workers must `learn`."""
        out = list(self._placed)
        self._placed.clear()
        return out

    def learn(self, placements: Iterable[Placement]) -> None:
        """Another worker placed these keys: their replicas hold them now, as if routed here
        (a holder that left the set is ignored by routing until it serves again)."""
        for key, name in placements:
            self._memory.sent(key, name)

    def holders(self, key: str | None) -> list[str]:
        """The replicas known to hold ``key``'s prefix, most recent first."""
        return self._memory.holders(key)

    def unreachable(self, replica: Replica) -> None:
        """A request could not connect: route no more there until its health says SERVING."""
        self.set_serving(replica.name, False)
