"""Which finetune adapter an HTTP request asks for, as the official clients spell it.

The cloud clients name a finetune in the model: ``"model": "<base>/<finetune_id>@<step>"``
(the ``moondream`` package's ``Finetune.model(step)``); the reference's settings call it
``variant``, Kestrel's ``adapter``. Any of ``model``, ``variant``, ``settings.variant`` and
``settings.adapter`` may carry it; two that disagree are refused. A model without ``/`` is the
base model. Errors about the adapter name the JSON field the client used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.frontend.refusals import invalid

if TYPE_CHECKING:  # the cluster's gateway reads names without the request path's imports
    from vlm_server.http.exchange import Exchange

PROTO_FIELD = "settings.adapter"


def from_model(model: object) -> str | None:
    """The adapter of a ``<base>/<id>@<step>`` model name (None: the base model)."""
    if not isinstance(model, str) or "/" not in model:
        return None
    return model.split("/", 1)[1] or None


def requested(body: dict[str, Any]) -> tuple[str, str] | None:
    """(adapter, the JSON field that named it), or None for the base model."""
    settings = body.get("settings") or {}
    found = [
        (value, name)
        for name, value in (
            ("settings.adapter", settings.get("adapter")),
            ("settings.variant", settings.get("variant")),
            ("variant", body.get("variant")),
            ("model", from_model(body.get("model"))),
        )
        if value
    ]
    for value, name in found[1:]:
        if value != found[0][0]:
            raise invalid(name, f"names adapter {value!r} but {found[0][1]} names {found[0][0]!r}")
    return found[0] if found else None


def apply(ex: Exchange, body: dict[str, Any], settings: pb.GenerationSettings) -> None:
    """Set ``settings.adapter`` from the body; errors about it will name the client's field."""
    asked = requested(body)
    if asked is not None:
        settings.adapter = asked[0]
        ex.names[PROTO_FIELD] = asked[1]
