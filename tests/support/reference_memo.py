"""The reference's answers, computed once per model and request.

The reference generator is deterministic (greedy, or sampled with the request's seed), and
the same requests recur across the parametrizations of a test (pipeline depths, step
budgets, engines); recomputing each answer on the CPU would be most of those tests' time.
`shared_reference` returns one `MemoReference` per model, tokenizer and adapter; its
task methods answer a request already asked with a copy of the first answer.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Hashable
from typing import Any

from tokenizers import Tokenizer

from vlm_server.models.interface import DeviceModel
from vlm_server.models.lora.spec import AdapterWeights
from vlm_server.reference import ReferenceGenerator, SamplingSettings

_PLAIN = (str, int, float, bool, type(None))


def _key(value: Any, held: list[Any]) -> Hashable:
    """A value as a key: plain values and sampling settings by value, tuples
    element-wise, anything else (an image) by identity, kept alive so its id is never
    reused."""
    if isinstance(value, _PLAIN):
        return (type(value).__name__, value)
    if isinstance(value, tuple):
        return ("tuple", tuple(_key(v, held) for v in value))
    if isinstance(value, SamplingSettings):  # frozen, of plain fields
        return ("settings", value)
    held.append(value)
    return ("id", id(value))


def _remembered(name: str) -> Callable[..., Any]:
    """The task method ``name`` of the reference, through `MemoReference._remember`."""

    def method(self: MemoReference, *args: Any, **kwargs: Any) -> Any:
        return self._remember(getattr(super(MemoReference, self), name), *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    return method


class MemoReference(ReferenceGenerator):
    """A `ReferenceGenerator` whose task methods remember their answers (text tasks only
    without an ``on_token`` callback, which may stop a request)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._answers: dict[Hashable, Any] = {}
        self._held: list[Any] = []

    def _remember(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        bound = inspect.signature(method).bind(*args, **kwargs)
        bound.apply_defaults()
        if bound.arguments.get("on_token") is not None:
            return method(*args, **kwargs)
        held: list[Any] = []
        key = (method.__name__, tuple((k, _key(v, held)) for k, v in bound.arguments.items()))
        if key not in self._answers:
            self._answers[key] = method(*args, **kwargs)
            self._held.extend(held)
        return copy.deepcopy(self._answers[key])

    caption = _remembered("caption")
    query = _remembered("query")
    reasoning_query = _remembered("reasoning_query")
    point = _remembered("point")
    detect = _remembered("detect")
    segment = _remembered("segment")


_SHARED: dict[Hashable, tuple[Any, ...]] = {}


def shared_reference(
    model: DeviceModel,
    tokenizer: Tokenizer,
    adapter: AdapterWeights | Callable[[], AdapterWeights] | None = None,
    adapter_key: Hashable | None = None,
    kv_dtype: str = "auto",
) -> MemoReference:
    """The one `MemoReference` of ``model`` (by identity: a model is never changed once a test
    asked for its reference) with ``tokenizer`` and ``adapter``. With ``adapter_key`` (the
    adapter's file and name), ``adapter`` may be a function loading the weights, called only
    the first time; without it the adapter object itself is the key. ``kv_dtype``: the KV
    format the reference stores and reads back (the engine's of the same name)."""
    adapter_id = adapter_key if adapter_key is not None else id(adapter)
    key = (id(model), id(tokenizer), adapter_id, kv_dtype)
    if key not in _SHARED:
        weights = adapter() if callable(adapter) else adapter
        ref = MemoReference(model, tokenizer, weights, kv_dtype=kv_dtype)
        # The model, tokenizer and adapter are held too, so that no id in a key is reused.
        _SHARED[key] = (ref, model, tokenizer, adapter)
    return _SHARED[key][0]
