"""The start-up check of what the flags ask of a model: each setting that needs an optional
capability (models/interface.py `Capabilities`) is refused in one line naming its flag when
the loaded model's family lacks it, before anything is built on the model.

A flag's name is its configuration field's name (``vision_fp8``: ``--vision-fp8``), in the
server's option table and in `EngineConfig` alike, so one table here serves both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from vlm_server.models.interface import Capabilities, DeviceModel, Formats

T = TypeVar("T")


class CapabilityError(ValueError):
    """A setting asks for a capability the model's family does not declare."""


_FP8_EXPERTS = "FP8 experts (no mixture of experts)"
_ADAPTERS = "finetune adapters"

# Setting -> (what it needs, in words; that part of the capabilities). The server's and the
# engine's settings, ``vlm run --adapter`` and the benchmarks' ``--fp8-experts``. Settings
# that only prefer a capability where there is one (``fused_decode``: fused products where
# the family and the device have them) are not here.
NEEDS: dict[str, tuple[str, Callable[[Capabilities], object]]] = {
    "vision_fp8": ("FP8 vision tower", lambda c: c.fp8_vision),
    "experts_fp8_activations": (_FP8_EXPERTS, lambda c: c.fp8_experts),
    "fp8_experts": (_FP8_EXPERTS, lambda c: c.fp8_experts),
    "adapters_dir": (_ADAPTERS, lambda c: c.adapters),
    "adapter_endpoint": (_ADAPTERS, lambda c: c.adapters),
    "adapter": (_ADAPTERS, lambda c: c.adapters),
    "segment_refiner": ("segmentation refiner", lambda c: c.segment_refiner),
}


def flag(setting: str) -> str:
    """The command-line flag of a setting."""
    return "--" + setting.replace("_", "-")


def refusal(setting: str, what: str, model_name: str) -> CapabilityError:
    return CapabilityError(f"{flag(setting)}: the model {model_name!r} has no {what}")


def check(model: DeviceModel, settings: Mapping[str, object]) -> None:
    """Refuse the settings among ``settings`` (name -> value) that are set and need a
    capability ``model`` lacks, and a ``kv_dtype`` its family's attention does not read: one
    error naming every such flag."""
    caps = model.capabilities
    lacking = [
        refusal(name, what, model.config.name)
        for name, (what, has) in NEEDS.items()
        if _asked(settings.get(name)) and has(caps) is None
    ]
    kv = settings.get("kv_dtype")
    if isinstance(kv, str) and kv != "auto" and kv not in caps.formats.kv:
        lacking.append(
            CapabilityError(
                f"{flag('kv_dtype')} {kv}: the model {model.config.name!r} takes KV pages in "
                f"{', '.join(caps.formats.kv)} only"
            )
        )
    if lacking:
        raise CapabilityError("; ".join(str(err) for err in lacking))


def _asked(value: object) -> bool:
    """Whether a setting's value asks for its capability (``auto`` and ``off`` do not: an auto
    switch takes the capability only where the model has it)."""
    return bool(value) and value not in ("auto", "off")


def need(part: T | None, setting: str, model: DeviceModel) -> T:
    """``part`` (the capability of ``model`` that ``setting`` needs), or the error naming the
    setting's flag."""
    if part is None:
        raise refusal(setting, NEEDS[setting][0], model.config.name)
    return part


def check_formats(formats: Formats, family: str, weights: str) -> None:
    """Refuse weights in a format (``--dtype``'s name of it) the family does not accept, or
    whose KV pages it cannot read (the engine keeps them in the weights' dtype)."""
    if weights not in formats.weights:
        raise CapabilityError(
            f"--dtype {weights}: the {family} family takes {', '.join(formats.weights)} weights"
        )
    if weights not in formats.kv:
        raise CapabilityError(
            f"--dtype {weights}: the {family} family's attention takes KV pages in "
            f"{', '.join(formats.kv)} only"
        )


def served_weights(formats: Formats) -> list[str]:
    """The ``--weights`` formats a family is served in (bf16, the checkpoint's own values:
    every family)."""
    return ["bf16", *formats.quantized, *(["fp8"] if formats.fp8_experts else [])]


def check_weights(formats: Formats, family: str, weights: str) -> None:
    """Refuse ``--weights`` in a format the family is not served in."""
    served = served_weights(formats)
    if weights not in served:
        raise CapabilityError(
            f"--weights {weights}: the {family} family serves {', '.join(served)} weights"
        )
