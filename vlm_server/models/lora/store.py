"""Where adapter files come from: the adapter folder, else a download from the configured
endpoint, saved where the reference caches it (``<folder>/<id>/final.pt``). Two schemes, by
family (`LoraTargets.format`): Moondream 2's variants come from
``<endpoint>/v1/variants/<id>/download`` (the reference's URL); a Moondream 3 finetune
``<finetune_id>@<step>`` from ``<endpoint>/v1/tuning/finetunes/<finetune_id>/checkpoints/
<step>/download``, which answers JSON ``{"url": ...}``, a presigned URL fetched next (without
the key: it is not the endpoint's). Both send the key as ``X-Moondream-Auth``.

`AdapterStore.path` blocks (file system, network): callers run it on a thread of their own,
never on an event loop or the engine's scheduler thread. A download is bounded in bytes and
in time, written to a temporary file and renamed into place only once complete.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from vlm_server.models.lora import files
from vlm_server.models.lora.files import AdapterError
from vlm_server.models.lora.spec import AdapterFormat

API_KEY_ENV = "MOONDREAM_API_KEY"  # the reference reads the key from here too
KEY_HEADER = "X-Moondream-Auth"
CHUNK = 1 << 20
MAX_ANSWER_BYTES = 1 << 16  # the finetune endpoint's JSON answer (a URL)


@dataclass
class AdapterStore:
    folder: Path | None  # local adapters (and downloads); None: downloads go to a temp dir
    endpoint: str | None = None  # e.g. https://api.moondream.ai; None: no downloads
    api_key: str | None = None
    max_bytes: int = 1 << 30
    timeout_s: float = 120.0
    scheme: AdapterFormat = "variant"  # the family's: which URL a download starts from

    def __post_init__(self) -> None:
        if self.api_key is None:
            self.api_key = os.environ.get(API_KEY_ENV) or None
        self._downloads = Path(self.folder) if self.folder else None

    @property
    def enabled(self) -> bool:
        return self.folder is not None or self.endpoint is not None

    def path(self, name: str) -> Path:
        """The file of adapter ``name``: found in the folder, or downloaded."""
        files.check_id(name)
        for folder in (self.folder, self._downloads):
            if folder is not None and (found := files.find(Path(folder), name)) is not None:
                return found
        if self.endpoint is None:
            raise AdapterError(f"adapter {name!r} is not in the adapter folder")
        return self.download(name)

    def download(self, name: str) -> Path:
        """Adapter ``name`` from the endpoint (its family's scheme) into
        ``<folder>/<name>/final.pt``."""
        if self._downloads is None:
            self._downloads = Path(tempfile.mkdtemp(prefix="adapters-"))
        dest = self._downloads / name / "final.pt"
        base = str(self.endpoint).rstrip("/")
        keyed = {"User-Agent": "vlm-server"}
        if self.api_key:
            keyed[KEY_HEADER] = self.api_key
        deadline = time.monotonic() + self.timeout_s
        if self.scheme == "finetune":
            finetune, at, step = name.partition("@")
            if not at:
                raise AdapterError(
                    f"adapter {name!r}: a finetune to download is named <finetune_id>@<step>"
                )
            url = f"{base}/v1/tuning/finetunes/{finetune}/checkpoints/{step}/download"
            presigned = _presigned_url(self._get_bytes(url, keyed, name, deadline), name)
            # Not the endpoint's URL (object storage, signed): the key stays home.
            self._get_file(presigned, {"User-Agent": "vlm-server"}, name, dest, deadline)
        else:
            self._get_file(f"{base}/v1/variants/{name}/download", keyed, name, dest, deadline)
        return dest

    def _get_bytes(self, url: str, headers: dict[str, str], name: str, deadline: float) -> bytes:
        """A small answer (at most MAX_ANSWER_BYTES) of a GET, in memory."""
        sink = _Memory()
        self._get(url, headers, name, sink, MAX_ANSWER_BYTES, deadline)
        return sink.data

    def _get_file(
        self, url: str, headers: dict[str, str], name: str, dest: Path, deadline: float
    ) -> None:
        """A GET streamed into a temporary file beside ``dest``, renamed into place once
        complete."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out:
                self._get(url, headers, name, out, self.max_bytes, deadline)
            os.replace(tmp, dest)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def _get(
        self,
        url: str,
        headers: dict[str, str],
        name: str,
        sink: BinaryIO | _Memory,
        limit: int,
        deadline: float,
    ) -> None:
        """GET ``url`` into ``sink``, at most ``limit`` bytes and until ``deadline``; every
        failure an AdapterError naming the adapter (retryable: the network's, or HTTP 5xx)."""
        try:
            request = urllib.request.Request(url, headers=headers)
            timeout = max(0.1, deadline - time.monotonic())
            with _OPENER.open(request, timeout=timeout) as response:
                size = 0
                while chunk := response.read(CHUNK):
                    size += len(chunk)
                    if size > limit:
                        raise AdapterError(f"adapter {name!r}: the download exceeds {limit} bytes")
                    if time.monotonic() > deadline:
                        raise AdapterError(
                            f"adapter {name!r}: the download took over {self.timeout_s:g} s",
                            retryable=True,
                        )
                    sink.write(chunk)
        except AdapterError:
            raise
        except urllib.error.HTTPError as err:
            raise AdapterError(
                f"adapter {name!r}: the download failed: HTTP {err.code} {err.reason}",
                retryable=err.code >= 500,
            ) from None
        except (OSError, ValueError) as err:  # refused, timed out, reset, bad URL
            raise AdapterError(f"adapter {name!r}: the download failed: {err}", True) from None


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urllib.parse.urlsplit(url)
    default = {"http": 80, "https": 443}.get(parts.scheme)
    return parts.scheme, (parts.hostname or "").lower(), parts.port or default


class _KeyStaysHome(urllib.request.HTTPRedirectHandler):
    """Follows redirects, but sends the key only to the origin it was given for: urllib's
    own handler copies every header to wherever a redirect points."""

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: Any,
        code: int,
        msg: str,
        headers: Any,
        newurl: str,
    ) -> urllib.request.Request | None:
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and _origin(newurl) != _origin(req.full_url):
            new.remove_header(KEY_HEADER.capitalize())  # urllib stores names capitalized
        return new


_OPENER = urllib.request.build_opener(_KeyStaysHome())


class _Memory:
    """A sink that keeps what it is written."""

    def __init__(self) -> None:
        self.data = b""

    def write(self, chunk: bytes) -> int:
        self.data += chunk
        return len(chunk)


def _presigned_url(answer: bytes, name: str) -> str:
    """The ``url`` of the finetune endpoint's JSON answer (http or https only)."""
    try:
        url = json.loads(answer).get("url")
    except (ValueError, AttributeError):
        url = None
    if not isinstance(url, str) or not url.startswith(("https://", "http://")):
        raise AdapterError(
            f'adapter {name!r}: the endpoint\'s answer holds no download url (JSON {{"url": '
            '"https://..."}} expected)'
        )
    return url
