"""Image-affinity routing without Ray: affinity keys, the hash ring, and the load guard
against power of two choices on skewed traffic (a deterministic simulation)."""

from __future__ import annotations

import random
from collections import Counter, deque

import pytest

from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.cluster.affinity import affinity_key, bytes_key, tag_image_id, untag_image_id
from vlm_server.cluster.replica_set import DEFAULT_MISS_COST, ReplicaSet
from vlm_server.cluster.ring import AffinityMemory, HashRing, choose, two_choices

JPEG = b"\xff\xd8\xff" + bytes(range(256)) * 4


def test_the_same_image_has_one_key_as_bytes_and_as_its_cluster_id() -> None:
    key = affinity_key(pb.QueryRequest(image_bytes=JPEG, question="q"))
    assert key == bytes_key(JPEG)
    tagged = tag_image_id("f" * 64, JPEG)
    assert untag_image_id(tagged) == "f" * 64
    assert affinity_key(pb.CaptionRequest(image_id=tagged)) == key
    assert affinity_key(pb.EncodeImageRequest(image_bytes=JPEG)) == key
    # Another picture, another key; an untagged id keys on itself.
    assert affinity_key(pb.DetectRequest(image_bytes=JPEG + b"x", object="a")) != key
    assert affinity_key(pb.PointRequest(image_id="abc", object="a")) == "abc"


def test_the_adapter_is_a_second_key() -> None:
    base = pb.QueryRequest(image_bytes=JPEG, question="q")
    lora = pb.QueryRequest(
        image_bytes=JPEG, question="q", settings=pb.GenerationSettings(adapter="ft@10")
    )
    text_only = pb.QueryRequest(question="q", settings=pb.GenerationSettings(adapter="ft@10"))
    assert affinity_key(lora) not in (None, affinity_key(base))
    assert affinity_key(text_only) == "ft@10"
    assert affinity_key(pb.QueryRequest(question="q")) is None
    assert affinity_key(pb.GetModelInfoRequest()) is None


def test_the_ring_moves_only_the_keys_of_a_replica_that_leaves() -> None:
    names = [f"r{i}" for i in range(4)]
    ring = HashRing(names)
    keys = [f"img{i}" for i in range(2000)]
    home = {k: ring.walk(k)[0] for k in keys}
    assert sorted(ring.walk("img0")) == names
    spread = Counter(home.values())
    assert min(spread.values()) > 2000 / 4 * 0.6, spread
    smaller = HashRing(names[1:])
    for k in keys:
        if home[k] != "r0":
            assert smaller.walk(k)[0] == home[k]
        else:  # its keys go to the next replica on their walk
            assert smaller.walk(k)[0] == ring.walk(k)[1]


def test_the_guard_moves_new_pictures_freely_and_held_ones_only_past_the_slack() -> None:
    ring = HashRing(["a", "b", "c"])
    rng = random.Random(0)
    key = "img"
    home = ring.walk(key)[0]
    idle = {"a": 0, "b": 0, "c": 0}
    assert choose(ring, key, idle.__getitem__, 1.25, rng) == (home, True)
    busy = dict(idle, **{home: 10})
    # A new picture costs a prefix anywhere: the next replica on its walk takes it.
    picked, at_home = choose(ring, key, busy.__getitem__, 1.25, rng)
    assert not at_home and picked == ring.walk(key)[1]
    # A picture its busy home holds stays there within the slack ((4 - 1) x mean = 10) ...
    assert choose(ring, key, busy.__getitem__, 4.0, rng, [home]) == (home, True)
    # ... and past it goes to the least loaded replica, which then holds it too.
    picked, kept = choose(ring, key, busy.__getitem__, 1.25, rng, [home])
    assert not kept and busy[picked] == 0
    other = ring.walk(key)[2]
    both = dict(busy, **{other: 1})
    assert choose(ring, key, both.__getitem__, 1.25, rng, [home, other]) == (other, True)
    memory = AffinityMemory(capacity=2)
    memory.sent(key, home)
    memory.sent(key, other)
    memory.sent(key, other)
    assert memory.holders(key) == [other, home]
    memory.sent("x", home)
    memory.sent("y", home)
    assert memory.holders(key) == [] and memory.holders(None) == []
    # No key: two choices, never the busier of the two.
    for _ in range(50):
        assert choose(ring, None, busy.__getitem__, 1.25, rng)[0] != home
    assert two_choices(["only"], busy.get, rng) == "only"


def _simulate(
    policy: str,
    keys: list[str],
    replicas: int = 4,
    miss_cost: int = 23,
    rate: float = 0.5,
    clients: int = 0,
    load_factor: float = 2.0,
    estimate: float = DEFAULT_MISS_COST,
) -> dict:
    """A replica does one unit of work per tick, first come first served; a request costs 1
    unit, plus ``miss_cost`` where its replica has not seen its image before (a new moondream2
    picture costs a replica about 30 times a cached one's request). Requests arrive
    at ``rate`` of what the replicas could serve were every request a hit, or, with
    ``clients``, as a closed loop keeping that many in flight. The affinity policy is the
    gateway's own `ReplicaSet` with its default miss cost (the true one here is 1 + miss_cost
    units: the estimate need not be exact)."""
    names = [f"r{i}" for i in range(replicas)]
    rng = random.Random(7)
    gateway = ReplicaSet(load_factor, random.Random(7), estimate)
    gateway.update({n: {"grpc": n} for n in names})
    for n in names:
        gateway.set_serving(n, True)
    queues: dict[str, deque[list]] = {n: deque() for n in names}
    seen: dict[str, set[str]] = {n: set() for n in names}
    hits = tick = 0
    waits: list[int] = []
    pending = deque(keys)
    credit = 0.0
    while pending or any(queues.values()):
        credit += rate * replicas
        while pending and (sum(map(len, queues.values())) < clients if clients else credit >= 1):
            credit -= 1
            key = pending.popleft()
            routed = None
            if policy == "affinity":
                routed = gateway.route(key)
                name = routed.replica.name
            else:
                name = two_choices(names, lambda n: len(queues[n]), rng)
            hit = key in seen[name]
            hits += hit
            seen[name].add(key)
            queues[name].append([1 if hit else 1 + miss_cost, tick, routed])
        for q in queues.values():
            if q:
                q[0][0] -= 1
                if q[0][0] == 0:
                    _, start, routed = q.popleft()
                    waits.append(tick + 1 - start)
                    if routed is not None:
                        gateway.done(routed)
        tick += 1
    waits.sort()
    repeats = len(keys) - len(set(keys))
    return {
        "mean_latency": sum(waits) / len(waits),
        "p99_latency": waits[int(0.99 * (len(waits) - 1))],
        "repeat_hit_rate": hits / repeats if repeats else 1.0,
    }


@pytest.mark.parametrize(
    "name",
    ["zipf", "one_hot_image", "one_hot_image_two_busy_replicas", "four_questions_each"],
)
def test_affinity_never_does_worse_than_two_choices_on_skewed_traffic(name: str) -> None:
    rng = random.Random(3)
    setup: dict = {}
    if name == "zipf":  # a few images asked about far more often than the rest
        weights = [1 / (i + 1) ** 1.2 for i in range(200)]
        keys = [f"img{i}" for i in rng.choices(range(200), weights, k=3000)]
    elif name.startswith("one_hot_image"):  # one image is 90% of the traffic
        keys = ["hot" if rng.random() < 0.9 else f"img{rng.randrange(500)}" for _ in range(3000)]
        if name.endswith("two_busy_replicas"):
            setup = {"replicas": 2, "clients": 64}
    else:  # each image asked 4 questions, interleaved with other images'
        images = [f"img{i}" for i in range(750)]
        blocks = [images[b : b + 8] for b in range(0, 750, 8)]
        keys = [k for block in blocks for _ in range(4) for k in block]
    affinity = _simulate("affinity", keys, **setup)
    p2c = _simulate("p2c", keys, **setup)
    assert affinity["mean_latency"] <= p2c["mean_latency"], (affinity, p2c)
    assert affinity["p99_latency"] <= p2c["p99_latency"], (affinity, p2c)
    assert affinity["repeat_hit_rate"] >= max(0.8, p2c["repeat_hit_rate"]), (affinity, p2c)


def test_four_questions_per_image_stay_together_under_saturation() -> None:
    """The scale-out benchmark's affinity run: two replicas near saturation, blocks of 32
    images each asked four questions in turn. The first questions spread by work; the others
    follow their image's prefix, so nine in ten repeats hit, and nobody waits longer than
    under two choices."""
    images = [f"img{i}" for i in range(1024)]
    blocks = [images[b : b + 32] for b in range(0, len(images), 32)]
    keys = [k for block in blocks for _ in range(4) for k in block]
    affinity = _simulate("affinity", keys, replicas=2, clients=128)
    p2c = _simulate("p2c", keys, replicas=2, clients=128)
    assert affinity["repeat_hit_rate"] >= 0.9, affinity
    assert affinity["mean_latency"] <= p2c["mean_latency"], (affinity, p2c)
    assert affinity["p99_latency"] <= p2c["p99_latency"], (affinity, p2c)


def test_a_large_pictures_key_reads_its_ends_and_length() -> None:
    big = bytes(3 << 20)
    assert bytes_key(big) == bytes_key(bytearray(big))
    assert bytes_key(big) != bytes_key(big + b"\x00")
    assert bytes_key(big) != bytes_key(b"\x01" + big[1:])
    assert bytes_key(big) != bytes_key(big[:-1] + b"\x01")
