"""A folder of pictures as a batch: one line per picture (and object), its ``custom_id`` the
picture's path relative to the folder; each picture read and turned into a body on a thread.

With several objects (``--object car --object person``) a picture has a line per object,
``custom_id`` ``<path>#<object>``.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlm_server.bulk.lines import BatchRequest, LineError
from vlm_server.bulk.read_ahead import LineSource
from vlm_server.bulk.runner import Item

# Picture files by extension (any case), with the media type their data URL names.
PICTURE_TYPES = {
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
    ".png": "image/png",
    ".webp": "image/webp",
    ".bmp": "image/bmp",
    ".gif": "image/gif",
    ".tif": "image/tiff",
    ".tiff": "image/tiff",
}


def list_pictures(folder: Path) -> list[str]:
    """The paths, relative to ``folder`` and with ``/``, of every picture file under it
    (recursively), sorted. A broken link is listed too: its line says it cannot be read."""
    if not folder.is_dir():
        raise ValueError(f"{folder}: not a folder")
    found = [
        path.relative_to(folder).as_posix()
        for path in folder.rglob("*")
        if path.suffix.lower() in PICTURE_TYPES and not path.is_dir()
    ]
    return sorted(found)


@dataclass(frozen=True)
class PictureLine:
    """One line of a folder batch: a picture, and the object it asks about (if any)."""

    custom_id: str
    picture: str  # relative to the folder
    object: str | None = None


def picture_lines(pictures: Sequence[str], objects: Sequence[str] = ()) -> list[PictureLine]:
    """The lines of ``pictures``: one each, or one per picture and object when several."""
    if len(objects) <= 1:
        obj = objects[0] if objects else None
        return [PictureLine(p, p, obj) for p in pictures]
    return [PictureLine(f"{p}#{o}", p, o) for p in pictures for o in objects]


class FolderSource(LineSource[PictureLine]):
    """The lines of a folder batch: ``url`` the route, ``fields`` the body's members besides
    the picture and the object (a caption's length, a query's question, settings)."""

    def __init__(
        self,
        folder: Path,
        lines: Sequence[PictureLine],
        url: str,
        fields: dict[str, Any],
        max_image_bytes: int,
    ) -> None:
        self.folder = folder
        self.lines = list(lines)
        self.url = url
        self.fields = fields
        self.max_image_bytes = max_image_bytes

    def make(self, line: PictureLine) -> Item:
        """The request of one line, or why its picture cannot be sent (runs on a thread)."""
        path = self.folder / line.picture
        try:
            with path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > self.max_image_bytes:
                    return line.custom_id, LineError(
                        f"{path}: the picture is {size} bytes; the limit is "
                        f"{self.max_image_bytes} (max_image_bytes)",
                        "image_url",
                        "image_too_large",
                    )
                data = f.read()
        except OSError as err:
            reason = err.strerror or str(err)
            return line.custom_id, LineError(
                f"{path}: cannot read the picture ({reason})", "image_url", "unreadable_file"
            )
        media_type = PICTURE_TYPES[path.suffix.lower()]
        url = f"data:{media_type};base64," + base64.b64encode(data).decode("ascii")
        body: dict[str, Any] = {"image_url": url, **self.fields}
        if line.object is not None:
            body["object"] = line.object
        return BatchRequest(line.custom_id, self.url, body)

    def close(self) -> None:
        """Nothing held open (the same shape as a requests file's source)."""
