"""The gateway's view of the replicas: where each one's doors are, whether it serves, how
many of the gateway's requests it holds, and which replica each affinity key went to last.

Pure bookkeeping (no Ray, no network): discovery feeds it the directory's entries and health
answers; the doors ask `route` for a replica and call `done` when the request ends. Routing is
`ring.choose` over the serving replicas with this gateway's exact in-flight counts as loads.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vlm_server.cluster.ring import HashRing, choose

# Keys whose last replica is remembered: far more images than any replica's prefix cache.
MAX_PLACED = 1 << 17


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
    routed: int = 0


class ReplicaSet:
    """The replicas the gateway may route to, and the routing itself."""

    def __init__(self, load_factor: float, rng: random.Random | None = None) -> None:
        if load_factor < 1.0:
            raise ValueError("load_factor must be >= 1")
        self.load_factor = load_factor
        self._rng = rng or random.Random()
        self._replicas: dict[str, Replica] = {}
        self._ring = HashRing([])
        self._placed: OrderedDict[str, str] = OrderedDict()  # key -> replica, oldest first
        self.routed = 0
        self.home_hits = 0  # requests with a key that went where its prefix is (or will be)

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

    def _load(self, name: str) -> int:
        return self._replicas[name].in_flight

    def route(self, key: str | None, exclude: frozenset[str] = frozenset()) -> Replica:
        """The replica for a request with affinity ``key`` (None: by load alone), counted in
        flight until `done`. ``exclude``: replicas this request already failed to reach."""
        ring = self._ring
        if exclude:
            ring = HashRing([n for n in ring.names if n not in exclude])
        if not ring.names:
            raise NoReplica("no replica is serving")
        placed = self._placed.get(key) if key is not None else None
        name, _ = choose(ring, key, self._load, self.load_factor, self._rng, placed)
        replica = self._replicas[name]
        replica.in_flight += 1
        replica.routed += 1
        self.routed += 1
        if key is not None:
            preferred = placed if placed in ring.names else next(iter(ring.walk(key)), None)
            self.home_hits += preferred == name
            self._placed[key] = name
            self._placed.move_to_end(key)
            if len(self._placed) > MAX_PLACED:
                self._placed.popitem(last=False)
        return replica

    def done(self, replica: Replica) -> None:
        """A routed request ended (however); its replica may have left the set meanwhile."""
        if replica.in_flight > 0:
            replica.in_flight -= 1

    def unreachable(self, replica: Replica) -> None:
        """A request could not connect: route no more there until its health says SERVING."""
        self.set_serving(replica.name, False)
