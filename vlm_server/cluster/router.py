"""The Ray Serve request router: image affinity with a load guard (`ring.choose`).

Ray calls `choose_replicas` for each request until a replica takes it; the ranks returned are
tried in order, each by Ray's own queue-length check (a full replica is skipped). The first
rank is the replica `ring.choose` picks; the second the other replicas, so a request is never
stuck behind a full home. The router remembers which replica served each key last (it holds
the prefix) and prefers it to the ring's home: a key the load guard once sent away keeps
hitting where its prefix went. Loads are Ray's cached queue lengths (every router's requests), or
this router's own count of requests in flight where the cache has none.

Requests arrive from Ray's gRPC proxy as a pickled envelope around the request message; the
key is read once per request and kept until it is routed.
"""

from __future__ import annotations

import logging
import pickle
import random
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from vlm_server.cluster import proto_names  # noqa: F401  (pickle finds the messages)
from vlm_server.cluster.affinity import affinity_key
from vlm_server.cluster.ring import AffinityMemory, HashRing, choose

log = logging.getLogger(__name__)

DEFAULT_LOAD_FACTOR = 2.0
_MAX_TRACKED = 1 << 16  # bounds the per-request maps whatever Ray reports


def request_message(args: list[Any]) -> Any | None:
    """The API request message among a Ray request's arguments, if there is one."""
    if not args:
        return None
    arg = args[0]
    if isinstance(arg, bytes | bytearray):
        try:  # the gRPC proxy's envelope (an HTTP request's is another type: no key)
            arg = pickle.loads(arg)
        except Exception:
            return None
        arg = getattr(arg, "user_request_proto", None)
    return arg if hasattr(arg, "DESCRIPTOR") else None


def key_of(pending: PendingRequest | None) -> str | None:
    if pending is None:
        return None
    message = request_message(list(pending.args))
    if message is None:
        return None
    try:
        return affinity_key(message)
    except Exception:  # a malformed message routes by load; the replica refuses it
        return None


class ImageAffinityRouter(RequestRouter):
    """Sends requests for one image (and adapter) to the replica that holds its prefix."""

    def initialize_state(self, load_factor: float = DEFAULT_LOAD_FACTOR, **_: Any) -> None:
        self.load_factor = float(load_factor)
        self._rng = random.Random()
        self._ring = HashRing([])
        self._keys: dict[str, str | None] = {}  # internal request id -> key, until routed
        self._own: dict[str, int] = {}  # replica -> this router's requests in flight
        self._where: dict[str, str] = {}  # internal request id -> replica
        self._memory = AffinityMemory()  # key -> the replicas that hold its prefix
        self.routed = 0
        self.home_hits = 0

    def _load(self, name: str) -> int:
        for replica in self._replicas_list:
            if replica.replica_id.unique_id == name:
                cached = self.replica_queue_len_cache.get(replica.replica_id)
                if cached is not None:
                    return cached
        return self._own.get(name, 0)

    def _key(self, pending: PendingRequest | None) -> str | None:
        if pending is None:
            return None
        rid = pending.metadata.internal_request_id
        if rid not in self._keys:
            if len(self._keys) >= _MAX_TRACKED:  # requests cancelled before being routed
                self._keys.pop(next(iter(self._keys)))
            self._keys[rid] = key_of(pending)
        return self._keys[rid]

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        try:
            by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
            if set(by_name) != set(self._ring.names):
                self._ring = HashRing(list(by_name))
            key = self._key(pending_request)
            holders = self._memory.holders(key)
            name, _ = choose(self._ring, key, self._load, self.load_factor, self._rng, holders)
        except Exception:  # never strand a request: Ray picks among all of them instead
            log.exception("affinity routing failed; routing by load")
            return [list(candidate_replicas)]
        rest = [r for n, r in by_name.items() if n != name]
        return [[by_name[name]], rest] if rest else [[by_name[name]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any):
        rid = pending_request.metadata.internal_request_id
        key = self._keys.pop(rid, None)
        name = replica_id.unique_id
        if len(self._where) >= _MAX_TRACKED:  # completions Ray never reported
            self._where.pop(next(iter(self._where)))
        self._where[rid] = name
        self._own[name] = self._own.get(name, 0) + 1
        self.routed += 1
        if key is None:
            return
        holders = self._memory.holders(key)
        home = name in holders if holders else name == next(iter(self._ring.walk(key)), None)
        self.home_hits += home
        self._memory.sent(key, name)

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        name = self._where.pop(internal_request_id, None)
        if name is not None and self._own.get(name, 0) > 0:
            self._own[name] -= 1
