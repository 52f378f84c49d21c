"""The scheduler's waiting queue (engine/core/wait_queue.py): highest priority first, FIFO
within one priority, the deque operations the scheduler and the engine use; and random
interleavings of every operation against a plain list kept in admission order."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from vlm_server.engine.core.wait_queue import WaitQueue


@dataclass(eq=False)  # compared by identity, as the scheduler's sequences are
class Item:
    name: str
    priority: int


def _queue(*items: Item) -> WaitQueue[Item]:
    return WaitQueue(lambda item: item.priority, items)


def _names(queue: WaitQueue[Item]) -> list[str]:
    return [item.name for item in queue]


def test_the_head_is_the_oldest_of_the_highest_priority() -> None:
    queue = _queue(Item("a", 0), Item("b", -10), Item("c", 5), Item("d", 0), Item("e", 5))
    assert _names(queue) == ["c", "e", "a", "d", "b"]
    assert queue[0].name == "c" and queue.head_priority() == 5
    assert [queue[i].name for i in range(len(queue))] == _names(queue)
    assert queue[-1].name == "b"
    assert [queue.popleft().name for _ in range(5)] == ["c", "e", "a", "d", "b"]
    assert not queue and len(queue) == 0


def test_a_later_higher_priority_goes_ahead_and_ties_keep_their_order() -> None:
    queue = _queue(*(Item(f"bg{i}", -10) for i in range(3)))
    queue.append(Item("urgent", 5))
    queue.extend([Item("bg3", -10), Item("normal", 0), Item("urgent2", 5)])
    assert _names(queue) == ["urgent", "urgent2", "normal", "bg0", "bg1", "bg2", "bg3"]


def test_remove_takes_that_item_only_and_empty_levels_go() -> None:
    twin_a, twin_b = Item("twin", 1), Item("twin", 1)  # equal fields, two items
    lone = Item("lone", 3)
    queue = _queue(twin_a, lone, twin_b, Item("low", -1))
    queue.remove(twin_b)
    assert [i is twin_a for i in queue if i.name == "twin"] == [True]
    queue.remove(lone)  # its level empties: the head is the next level's
    assert queue.head_priority() == 1 and queue[0] is twin_a
    assert twin_a in queue and lone not in queue
    with pytest.raises(ValueError):
        queue.remove(lone)
    with pytest.raises(ValueError):
        queue.remove(Item("never", 7))  # a priority no item has
    assert len(queue) == 2 and _names(queue) == ["twin", "low"]


def test_an_empty_queue_refuses_as_a_deque_does() -> None:
    queue = _queue()
    assert not queue and list(queue) == []
    with pytest.raises(IndexError):
        queue.popleft()
    with pytest.raises(IndexError):
        _ = queue[0]
    with pytest.raises(IndexError):
        queue.head_priority()
    queue.append(Item("x", 0))
    with pytest.raises(IndexError):
        _ = queue[1]
    with pytest.raises(IndexError):
        _ = queue[-2]


@pytest.mark.parametrize("seed", range(20))
def test_random_operations_match_a_list_in_admission_order(seed: int) -> None:
    """Appends, extends, pops, removes and reads in a seeded random order: the queue always
    holds what a list kept sorted by priority (stably, so FIFO within one) holds."""
    rng = random.Random(seed)
    levels = rng.sample(range(-10, 11), rng.randint(1, 6))  # few levels: many ties
    queue: WaitQueue[Item] = WaitQueue(lambda item: item.priority)
    model: list[Item] = []  # the reference: admission order
    made = 0

    def new() -> Item:
        nonlocal made
        made += 1
        return Item(f"i{made}", rng.choice(levels))

    def insert(item: Item) -> None:
        # After every item of its priority or higher: FIFO within a priority.
        at = sum(1 for other in model if other.priority >= item.priority)
        model.insert(at, item)

    for _ in range(400):
        op = rng.choice(["append", "append", "extend", "popleft", "remove", "read"])
        if op == "append":
            item = new()
            queue.append(item)
            insert(item)
        elif op == "extend":
            items = [new() for _ in range(rng.randint(0, 4))]
            queue.extend(items)
            for item in items:
                insert(item)
        elif op == "popleft":
            if model:
                assert queue.popleft() is model.pop(0)
            else:
                with pytest.raises(IndexError):
                    queue.popleft()
        elif op == "remove" and model:
            victim = rng.choice(model)
            queue.remove(victim)
            model.remove(victim)
        elif op == "read" and model:
            i = rng.randrange(len(model))
            assert queue[i] is model[i]
            assert queue.head_priority() == model[0].priority
        assert len(queue) == len(model) and bool(queue) == bool(model)
        assert [id(x) for x in queue] == [id(x) for x in model]
