"""Which finetune adapter an HTTP request asks for, as the official clients spell it.

The cloud clients name a finetune in the model: ``"model": "<base>/<finetune_id>@<step>"``
(the ``moondream`` package's ``Finetune.model(step)``); the reference's settings call it
``variant``, Kestrel's ``adapter``. Any of ``model``, ``variant``, ``settings.variant`` and
``settings.adapter`` may carry it; two that disagree are refused.

A ``model`` is read as the cloud reads it: a leading ``moondream/`` (its provider prefix, optional
for its own models: ``moondream/moondream3-preview``) is dropped first. What remains is the
base model when it holds no ``/``, whatever its name (OpenAI clients send their own
defaults); otherwise it must be ``<served model>/<adapter id>``, the served model by its name
or the preset it was started with. Any other base, an empty id (``"<base>/"``) or a
malformed one is a 400 naming ``model``, never a silent base-model answer; so is an empty
``variant`` or ``settings.adapter``. Errors about the adapter name the JSON field the client
used.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.frontend.refusals import invalid
from vlm_server.models.lora.files import AdapterError, check_id

if TYPE_CHECKING:  # the cluster's gateway reads names without the request path's imports
    from vlm_server.engine.api import EngineInfo
    from vlm_server.http.exchange import Exchange

PROTO_FIELD = "settings.adapter"
PROVIDER = "moondream/"  # the cloud's prefix of its first-party models


def served_names(info: EngineInfo) -> frozenset[str]:
    """The names a ``model`` may give the served model by."""
    return frozenset({info.model_name, info.preset} - {""})


def from_model(model: object, served: Collection[str] | None = None) -> str | None:
    """The adapter a ``model`` names (None: the base model).

    ``served``: the served model's names (`served_names`), checked strictly as the module's
    docstring says; None only reads the name (a router, which leaves the check to the
    replica)."""
    if not isinstance(model, str) or "/" not in model:
        return None
    if served is None:
        return model.rsplit("/", 1)[1] or None
    name = model
    if name.startswith(PROVIDER) and PROVIDER[:-1] not in served:
        name = name.removeprefix(PROVIDER)
        if not name:
            raise invalid("model", f"names no model after {PROVIDER!r}")
    if "/" not in name:
        return None
    base, _, adapter = name.rpartition("/")
    if base not in served:
        shown = ", ".join(repr(n) for n in sorted(served))
        raise invalid(
            "model",
            f"names base model {base[:64]!r}, but this server serves {shown}: send "
            "<served model>/<finetune_id>@<step>, or a name without '/' for the base model",
        )
    if not adapter:
        raise invalid("model", f"{model[:80]!r} names no adapter after '/': send <base>/<id>")
    try:
        return check_id(adapter)
    except AdapterError as err:
        raise invalid("model", str(err)) from None


def requested(
    body: dict[str, Any], served: Collection[str] | None = None
) -> tuple[str, str] | None:
    """(adapter, the JSON field that named it), or None for the base model. ``served`` as
    `from_model`'s; with it, an empty ``variant`` or ``settings.adapter`` is refused."""
    settings = body.get("settings") or {}
    fields = [
        ("settings.adapter", settings.get("adapter") if isinstance(settings, dict) else None),
        ("settings.variant", settings.get("variant") if isinstance(settings, dict) else None),
        ("variant", body.get("variant")),
    ]
    if served is not None:
        for name, value in fields:
            if value == "":
                raise invalid(name, "is empty: name an adapter, or leave it out for the base model")
    fields.append(("model", from_model(body.get("model"), served)))
    found = [(value, name) for name, value in fields if value]
    for value, name in found[1:]:
        if value != found[0][0]:
            raise invalid(name, f"names adapter {value!r} but {found[0][1]} names {found[0][0]!r}")
    return found[0] if found else None


def apply(ex: Exchange, body: dict[str, Any], settings: pb.GenerationSettings) -> None:
    """Set ``settings.adapter`` from the body; errors about it will name the client's field."""
    asked = requested(body, served_names(ex.active_call.engine().info))
    if asked is not None:
        settings.adapter = asked[0]
        ex.names[PROTO_FIELD] = asked[1]
