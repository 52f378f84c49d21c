"""Which weight format a start serves (``--weights``), decided by the memory plan alone
(torch-free: a pure function of the model's shape, the engine flags and the card's bytes).

``auto`` takes the most exact format that holds ``--max-batch-size`` picture requests (each
on a picture of its own, so as many picture prefixes) beside the weights; when none does, the
smallest one that holds the model with one request (the most requests run; the rest wait in
the queue). An asked
format that cannot hold the model with one request is refused, naming the flag, the bytes it
needs and the format that would fit.

Exactness order (`EXACTNESS`): the checkpoint's values, then per-channel INT8 (a value's error
at most half a step of 1/127 of its row's maximum), then FP8 e4m3 experts (3 mantissa bits: an
error up to 1/16 of the value itself), then INT4 in groups (half a step of 1/7 of its group's
maximum).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.memory_plan import MemoryPlan, plan_memory
from vlm_server.models.interface import MemoryShape

AUTO = "auto"
# ``--weights`` names, most exact first.
EXACTNESS = ("bf16", "int8", "fp8", "int4")
# The memory plan's format of each ``--weights`` name.
PLAN_FORMATS = {"bf16": "bf16", "int8": "int8", "fp8": "fp8-experts", "int4": "int4"}
GIB = 1 << 30


class WeightsError(ValueError):
    """No format, or not the asked one, holds the model on this card."""


@dataclass(frozen=True)
class WeightsChoice:
    """The format to serve (a ``--weights`` name) and the start-up line that says why."""

    weights: str
    line: str


def fitting(shape: MemoryShape, cfg: EngineConfig, card_bytes: int, weights: str) -> MemoryPlan:
    """The plan of ``weights`` with the KV budget ``cfg.max_batch_size`` requests need."""
    fmt = PLAN_FORMATS[weights]
    plan = plan_memory(shape, cfg, card_bytes, fmt)
    sized = dataclasses.replace(cfg, kv_budget_bytes=plan.kv_needed_bytes)
    return plan_memory(shape, sized, card_bytes, fmt)


def available_bytes(plan: MemoryPlan) -> int:
    """Device memory the start may use, the CUDA context included."""
    return plan.context_bytes + plan.limit_bytes


def least_bytes(plan: MemoryPlan) -> int:
    """Device memory that holds the model with one picture request (and the sink page)."""
    kv = (plan.request_pages + 1) * plan.page_bytes
    return plan.context_bytes + plan.held_at_kv_sizing + kv + plan.workspace_bytes


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def _room(plan: MemoryPlan) -> str:
    if plan.cap_bytes and plan.cap_bytes + plan.context_bytes < plan.card_bytes:
        return f"the cap (--gpu-memory-bytes) leaves {_gib(available_bytes(plan))}"
    return f"the card has {_gib(plan.card_bytes)}"


def choose_weights(
    shape: MemoryShape,
    cfg: EngineConfig,
    card_bytes: int,
    asked: str,
    served: Sequence[str],
    own: str | None = None,
) -> WeightsChoice:
    """The format to serve when ``asked`` (a format, or ``auto``) on a card of
    ``card_bytes`` under ``cfg``'s cap; ``served``: the formats the model, checkpoint and
    chip can be served in; ``own``: the format the checkpoint stores its values in, when not
    16-bit (fp8: Moondream 3's FP8 experts), the most exact there is for it: widening it to
    bf16 adds bytes, not exactness. WeightsError naming ``--weights`` when nothing fits."""
    order = [w for w in EXACTNESS if w in served]
    if own in order:
        order = [own, *(w for w in order if w not in (own, "bf16"))]
    n = cfg.max_batch_size
    plans = {w: fitting(shape, cfg, card_bytes, w) for w in order}
    holding = [w for w in order if least_bytes(plans[w]) <= available_bytes(plans[w])]
    if asked != AUTO:
        plan = plans.get(asked) or fitting(shape, cfg, card_bytes, asked)
        if least_bytes(plan) > available_bytes(plan):
            other = f"; {holding[0]} would fit" if holding else "; no format fits"
            raise WeightsError(
                f"--weights {asked}: the model needs {least_bytes(plan)} bytes "
                f"({_gib(least_bytes(plan))}) with one picture request, and {_room(plan)}"
                f"{other}"
            )
        return WeightsChoice(asked, f"weights: {asked}: needs {_describe(plan)}, {_room(plan)}")
    if not order:
        raise WeightsError("--weights auto: no weight format is served here")
    roomy = [w for w in order if plans[w].needed_bytes <= available_bytes(plans[w])]
    if roomy:
        chosen = roomy[0]
        plan = plans[chosen]
        if chosen == order[0]:
            return WeightsChoice(
                chosen, f"weights: {chosen} (auto): needs {_describe(plan)}, {_room(plan)}"
            )
        best = order[0]
        return WeightsChoice(
            chosen,
            f"weights: {chosen} (auto): {best} needs {_describe(plans[best])}, {_room(plan)}; "
            f"{chosen} needs {_gib(plan.needed_bytes)}",
        )
    if holding:
        # Nothing has room for the batch: the format with the most room for requests (the
        # smallest), so that the fewest wait.
        chosen = min(holding, key=lambda w: plans[w].needed_bytes)
        plan = plans[chosen]
        held = (available_bytes(plan) - least_bytes(plan)) // _request_bytes(plan) + 1
        return WeightsChoice(
            chosen,
            f"weights: {chosen} (auto): no format has room for {n} picture requests "
            f"({chosen} needs {_describe(plan)}, {_room(plan)}); {chosen} holds the model and "
            f"about {held} requests at once, the rest wait in the queue",
        )
    smallest = min(order, key=lambda w: least_bytes(plans[w]))
    plan = plans[smallest]
    raise WeightsError(
        f"--weights auto: no format holds the model: the smallest, {smallest}, needs "
        f"{least_bytes(plan)} bytes ({_gib(least_bytes(plan))}) with one picture request, and "
        f"{_room(plan)}"
    )


def _request_bytes(plan: MemoryPlan) -> int:
    return plan.request_pages * plan.page_bytes


def _describe(plan: MemoryPlan) -> str:
    return f"{_gib(plan.needed_bytes)} for {plan.max_batch_size} picture requests"


__all__ = ["AUTO", "EXACTNESS", "WeightsChoice", "WeightsError", "choose_weights", "fitting"]
