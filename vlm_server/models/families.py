"""The model families the server ships, one line each: a family's name and the module holding
its `ModelFamily` as ``FAMILY``. The registry and the layout test read this table; adding a
family is one line here plus its package.

Order matters: a checkpoint belongs to the first family whose ``reads`` accepts its
config.json, and Moondream 3's can look like Moondream 2's, never the other way round.
"""

from __future__ import annotations

FAMILIES: dict[str, str] = {
    "moondream3": "vlm_server.models.moondream3.family",
    "moondream2": "vlm_server.models.moondream2.family",
}
